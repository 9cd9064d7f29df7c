"""How sizes are written for people, in one place: the CLI's tables and the console (which shows the
text the server sends) agree to the byte. Decimal units, as disk and download tools count them."""

from __future__ import annotations

_UNITS = ("B", "KB", "MB", "GB", "TB")


def fmt_size(n: int | None) -> str:
    """Bytes as `906 B`, `906.4 KB`, `2.7 MB`, `1.3 GB` (1 KB = 1000 B); None -> '-'."""
    if n is None:
        return "-"
    x, unit = float(n), 0
    while abs(x) >= 1000 and unit < len(_UNITS) - 1:
        x, unit = x / 1000, unit + 1
    return f"{int(x)} B" if unit == 0 else f"{x:,.1f} {_UNITS[unit]}"

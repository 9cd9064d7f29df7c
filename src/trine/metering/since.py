"""Parse the `--since` / `since=` filter of usage queries into unix seconds."""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str | float | int, now: float | None = None) -> float:
    """Unix seconds from a number ("1767600000"), a relative age ("90s", "30m", "2h", "1d", "1w": that long
    ago), or an ISO 8601 date or time ("2026-01-05", "2026-01-05T08:00", with an offset or "Z"; naive
    times are UTC)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    s = str(text).strip()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", s)
    if m:
        return (time.time() if now is None else now) - float(m[1]) * _UNITS[m[2]]
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"since: {text!r} is not a time; use unix seconds, an age like 2h or 1d, "
            "or an ISO date such as 2026-01-05T08:00"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()

"""How the CLI prints listings: a rich table for people, the same records as JSON for programs.

Every listing command (`trine models`, `checkpoints`, `keys list`, `usage`) goes through here, so
they look alike and each has `--json`. Money is printed fixed-point (never `5e-06`), times as local
`YYYY-MM-DD HH:MM`.

Invariants: a table never squeezes a column to zero width. Long text columns (names, URIs, paths)
fold instead of pushing the numbers off screen, and output that is piped or redirected is not
limited to 80 columns (rich's default when it cannot see a terminal).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

from ..metering.money import dumps
from ..metering.money import fmt_money as money

PIPED_WIDTH = 200  # a pipe has no width: wide enough for every listing to keep one line per row


@dataclass(frozen=True)
class Column:
    header: str
    numeric: bool = False  # right-aligned and never wrapped
    fold: bool = False  # long text (URIs, paths): folded onto several lines rather than cut


def console(stderr: bool = False):
    from rich.console import Console

    c = Console(stderr=stderr)
    if not c.is_terminal:
        c = Console(stderr=stderr, width=PIPED_WIDTH)
    return c


def print_table(
    title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], *, empty: str = ""
) -> None:
    """One table; `empty` is printed (to stderr) instead when there are no rows."""
    from rich.table import Table

    if not rows and empty:
        console(stderr=True).print(empty)
        return
    t = Table(title=title, title_justify="left")
    for col in columns:
        if col.numeric:
            t.add_column(col.header, justify="right", no_wrap=True)
        else:
            t.add_column(
                col.header,
                overflow="fold" if col.fold else "ellipsis",
                no_wrap=not col.fold,
                min_width=len(col.header),
            )
    for row in rows:
        t.add_row(*row)
    console().print(t)


def print_json(records) -> None:
    """Records (a list of dicts, or one dict) as indented JSON on stdout."""
    print(dumps(records, indent=2, default=str))


def price(x: float | None) -> str:
    """A price per million tokens, fixed-point with 3 decimals (0.002, 0.130, 1.200)."""
    return money(x, 3)


def when(ts: float | None, never: str = "-") -> str:
    return never if not ts else datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def size(n: int | None) -> str:
    """A size as the console shows it too (`trine.sizes`)."""
    from ..sizes import fmt_size

    return fmt_size(n)

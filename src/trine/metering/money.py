"""Money as every surface shows it: fixed-point decimals, never `6.7e-07` or `0.014000000000000002`.

The one definition the CLI, the JSON APIs (usage, rates, sample and training results, OpenAI usage,
Tinker billing, the console) and the SDK's `Usage` use:
- `money(x)` rounds an amount to `DECIMALS` places (a millionth of a micro-dollar: a single cached
  token of the cheapest row still shows) and returns a `Money`, a float that is also a number to
  JSON consumers and arithmetic;
- `money_text(x)` is its fixed-point text, trailing zeros cut (`0.00000067`, `12.5`, `0.0`);
- `dumps(obj)` writes JSON in which every `Money` is that text as a number literal (the standard
  encoder prints small floats in exponent form); the server's JSON responses go through it
  (`metering.http.MoneyJSONResponse`);
- `fmt_money(x, decimals)` is the fixed-width column form of tables (`0.000005`).
Invariant: `float(money_text(x)) == money(x)`, and no surface prints an exponent for an amount.
"""

from __future__ import annotations

import json
from decimal import ROUND_HALF_EVEN, Decimal

DECIMALS = 12
_QUANTUM = Decimal(1).scaleb(-DECIMALS)


class Money(float):
    """An amount already rounded to DECIMALS places; JSON (through `dumps`) writes it fixed-point."""

    def __repr__(self) -> str:
        return money_text(self)

    __str__ = __repr__


def _decimal(x: float) -> Decimal:
    d = Decimal(repr(float(x))).quantize(_QUANTUM, rounding=ROUND_HALF_EVEN)
    return d.normalize() if d else Decimal(0)


def money(x: float | None) -> Money | None:
    """`x` rounded to DECIMALS places (None stays None)."""
    return None if x is None else Money(_decimal(x))


def money_text(x: float) -> str:
    """Fixed-point text of an amount, always with a decimal point (JSON readers keep it a float):
    `6.7e-07` -> `0.00000067`, `0.014000000000000002` -> `0.014`, `0` -> `0.0`."""
    text = format(_decimal(x), "f")
    return text if "." in text else text + ".0"


def fmt_money(x: float | None, decimals: int = 6) -> str:
    """Fixed-width money for table columns, never scientific: 0.000005 -> '0.000005'; None -> '-'."""
    return "-" if x is None else f"{x:,.{decimals}f}"


class _Encoder(json.JSONEncoder):
    """The standard encoder, except that a Money is written as its fixed-point text."""

    def iterencode(self, o, _one_shot=False):
        def floatstr(x: float) -> str:
            if isinstance(x, Money):
                return money_text(x)
            if x != x or x in (float("inf"), float("-inf")):
                if not self.allow_nan:
                    raise ValueError(f"Out of range float values are not JSON compliant: {x!r}")
                return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")
            return float.__repr__(x)

        enc = json.encoder.encode_basestring_ascii if self.ensure_ascii else json.encoder.encode_basestring
        return json.encoder._make_iterencode(
            {} if self.check_circular else None,
            self.default,
            enc,
            self.indent,
            floatstr,
            self.key_separator,
            self.item_separator,
            self.sort_keys,
            self.skipkeys,
            _one_shot,
        )(o, 0)


def dumps(obj, **kw) -> str:
    """`json.dumps`, writing every Money fixed-point."""
    return json.dumps(obj, cls=_Encoder, **kw)

"""The real ranges of wire numbers, as pydantic field types.

Every integer a client sends is checked against the range the server can hold (a 64-bit SQLite
integer, a torch seed) before anything is queued or stored, so an out-of-range value is a 400
naming the field, never a 500 or a half-done write. Floats that parametrise computation are finite;
sampling parameters keep the ranges of `limits.SAMPLING_BOUNDS` (`sampling_field`).
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field

from ...limits import INT64_MAX, MAX_TTL_SECONDS, SAMPLING_BOUNDS

Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]  # counts, offsets, steps
Positive = Annotated[int, Field(ge=1, le=INT64_MAX)]  # indexes (from 1), sizes
SeqId = Annotated[int, Field(ge=1, le=INT64_MAX - 1)]  # Tinker's per-model call number (stored as seq_id + 1)
Seed = Annotated[int, Field(ge=0, le=INT64_MAX)]
TtlSeconds = Annotated[int, Field(ge=1, le=MAX_TTL_SECONDS)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def sampling_field(name: str, default: float):
    """A pydantic field of sampling parameter `name` with its range from `limits.SAMPLING_BOUNDS`
    (pydantic's own messages name the field and the bound)."""
    b = SAMPLING_BOUNDS[name]
    limits = {"gt" if b.low_open else "ge": b.low}
    if b.high != math.inf:
        limits["le"] = b.high
    return Field(default=default, **limits)

"""Usage by phase, with the engine's field names.

Sampling fills prompt/prefill/cached/sample tokens, training fills train/loss/sequence tokens.
Invariants: prompt_tokens == prefill_tokens + cached_tokens; train_tokens <= train_sequence_tokens
(a prefix several datums share is computed once); loss_tokens <= train_sequence_tokens.
`cost` is set only when the server reports one; a sum has a cost only if every term had one. Costs
are rounded and shown fixed-point as everywhere in trine (`trine.metering.money`).
"""

from __future__ import annotations

from ..metering.money import money
from .base import BaseModel

PHASE_FIELDS = (
    "prompt_tokens",
    "prefill_tokens",
    "cached_tokens",
    "sample_tokens",
    "train_tokens",
    "loss_tokens",
    "train_sequence_tokens",
)


class Usage(BaseModel):
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens computed
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    sample_tokens: int = 0  # generated tokens, all samples together
    train_tokens: int = 0  # training positions computed (what is priced)
    loss_tokens: int = 0  # positions with a non-zero weight or advantage
    train_sequence_tokens: int = 0  # training positions of the datums as sent
    cost: float | None = None

    def __add__(self, other: Usage) -> Usage:
        fields = {f: getattr(self, f) + getattr(other, f) for f in PHASE_FIELDS}
        cost = None if self.cost is None or other.cost is None else money(self.cost + other.cost)
        return Usage(**fields, cost=cost)

    def __sub__(self, earlier: Usage) -> Usage:
        """What was used since `earlier` (a previous reading of the same running total)."""
        fields = {f: getattr(self, f) - getattr(earlier, f) for f in PHASE_FIELDS}
        cost = None if self.cost is None or earlier.cost is None else money(self.cost - earlier.cost)
        return Usage(**fields, cost=cost)

    @classmethod
    def from_wire(cls, usage: dict | None, cost: float | None = None) -> Usage:
        """Read the trine fields from a response's `usage` map (unknown keys are ignored)."""
        usage = usage or {}
        fields = {f: int(usage.get(f) or 0) for f in PHASE_FIELDS}
        fields["train_sequence_tokens"] = fields["train_sequence_tokens"] or fields["train_tokens"]
        c = usage.get("cost", cost)
        return cls(**fields, cost=money(c))

    def __repr_args__(self):
        """`cost` fixed-point (0.0000057, not 5.7000000000000005e-06), as every trine surface shows money."""
        for name, value in super().__repr_args__():
            yield name, (money(value) if name == "cost" else value)

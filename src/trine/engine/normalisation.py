"""Gradient denominators: the number one forward_backward chunk's summed loss is divided by.

A client may split one logical batch into chunks and send the whole batch's counts with every
chunk (PyTRIO's `gradient_accumulation`). Each chunk's summed loss is then divided by the whole
batch's count, so a batch sent whole or in chunks gives one gradient and a repeated datum leaves
the mean unchanged:

| loss | counted positions |
|---|---|
| cross_entropy | active tokens: target != -100 and weight != 0 |
| importance_sampling, ppo, cispo, gspo, stable_reinforce | active tokens: target != -100 |
| dro | advantage tokens: target != -100 and advantage != 0 |

A count of 0 (nothing in the loss) counts as 1. Without the whole batch's counts the chunk is its
own whole batch. A caller that wants the plain sum (the Tinker contract) asks for no denominator
at all. The reported metrics (`loss_sum`, `token_count`) never depend on it.

Invariant: a chunk never holds more samples or tokens than the whole batch's counts say; otherwise
`denominator` raises ValueError whose message starts with the count's name (`total_active_tokens
is 3, but ...`), so the caller can prefix the field it came from.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass

from .losses import IGNORE_INDEX, Loss
from .requests import TrainDatum

ADVANTAGE_NORMALISED = ("dro",)
COUNT_NAMES = ("total_samples", "total_active_tokens", "total_advantage_tokens")


@dataclass(frozen=True)
class BatchCounts:
    """What a loss divides by, counted over a chunk or over the whole logical batch."""

    samples: int
    active_tokens: int
    advantage_tokens: int


def chunk_counts(data: list[TrainDatum], loss: Loss) -> BatchCounts:
    """This chunk's own counts, as the client counts them (targets already shifted)."""
    active = advantage = 0
    for d in data:
        weights = None if loss.is_policy else d.weights
        for k, target in enumerate(d.target_tokens):
            if target == IGNORE_INDEX:
                continue
            if loss.is_policy:
                active += 1
                advantage += d.advantages is not None and d.advantages[k] != 0
            elif weights is None or weights[k] != 0:
                active += 1
    return BatchCounts(len(data), active, advantage)


def denominator(loss: Loss, data: list[TrainDatum], whole: BatchCounts | None) -> float:
    """The number this chunk's gradient is divided by (>= 1). `whole`: the logical batch's counts,
    or None when the chunk is the whole batch."""
    own = chunk_counts(data, loss)
    if whole is None:
        whole = own
    for name, mine, theirs in zip(COUNT_NAMES, astuple(own), astuple(whole)):
        if mine > theirs:
            raise ValueError(f"{name} is {theirs}, but this chunk alone has {mine}: the totals must "
                             "describe the whole logical batch")
    count = whole.advantage_tokens if loss.name in ADVANTAGE_NORMALISED else whole.active_tokens
    return float(max(count, 1))

"""PyTRIO's gradient normalisation: the denominator of one forward_backward chunk.

The PyTRIO client splits one logical forward_backward call into chunks and sends the whole batch's
totals (`gradient_accumulation`: total_samples, total_active_tokens, total_advantage_tokens),
identical in every chunk. Each chunk's summed loss is divided by the whole batch's denominator, so
a batch sent whole or in chunks gives one gradient and a repeated datum leaves the mean unchanged:

| loss | denominator |
|---|---|
| cross_entropy | total_active_tokens (target != -100 and weight != 0) |
| importance_sampling, ppo, cispo | total_active_tokens (target != -100) |
| dro | total_advantage_tokens (target != -100 and advantage != 0) |

A denominator of 0 (nothing in the loss) counts as 1. Without `gradient_accumulation` the chunk is
its own whole batch. The reported metrics (`loss_sum`, `token_count`) stay unnormalised.

Invariant: a chunk never holds more samples or tokens than the totals say the whole batch has;
otherwise the event is refused (400) naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from ..engine.requests import TrainDatum
from ..service.errors import InvalidRequest
from .bounds import Count, Positive

ADVANTAGE_NORMALISED = ("dro",)


class GradientAccumulation(BaseModel):
    model_config = ConfigDict(extra="ignore")
    total_samples: Positive
    total_active_tokens: Count
    total_advantage_tokens: Count


@dataclass(frozen=True)
class ChunkCounts:
    samples: int
    active_tokens: int
    advantage_tokens: int


def chunk_counts(data: list[TrainDatum], loss: str) -> ChunkCounts:
    """This chunk's own totals, counted as the client counts them (targets already shifted)."""
    active = advantage = 0
    policy = loss != "cross_entropy"
    for d in data:
        weights = d.weights if not policy else None
        for k, target in enumerate(d.target_tokens):
            if target == -100:
                continue
            if policy:
                active += 1
                advantage += d.advantages is not None and d.advantages[k] != 0
            elif weights is None or weights[k] != 0:
                active += 1
    return ChunkCounts(len(data), active, advantage)


def denominator(loss: str, totals: GradientAccumulation | None, data: list[TrainDatum]) -> float:
    """The number this chunk's gradient is divided by (>= 1)."""
    loss = loss.strip().lower()
    own = chunk_counts(data, loss)
    if totals is None:
        whole = own
    else:
        whole = ChunkCounts(totals.total_samples, totals.total_active_tokens, totals.total_advantage_tokens)
        for field, mine, theirs in (("total_samples", own.samples, whole.samples),
                                    ("total_active_tokens", own.active_tokens, whole.active_tokens),
                                    ("total_advantage_tokens", own.advantage_tokens, whole.advantage_tokens)):
            if mine > theirs:
                raise InvalidRequest(f"payload.gradient_accumulation.{field} is {theirs}, but this chunk alone "
                                     f"has {mine}: the totals must describe the whole logical batch")
    count = whole.advantage_tokens if loss in ADVANTAGE_NORMALISED else whole.active_tokens
    return float(max(count, 1))

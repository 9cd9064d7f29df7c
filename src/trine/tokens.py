"""What a training loss counts: one definition for the SDK, the service and the trainer.

| loss | active tokens | advantage tokens |
|---|---|---|
| cross_entropy | target != -100 and weight != 0 | 0 |
| policy losses (importance_sampling, ppo, cispo, dro, gspo, stable_reinforce) | target != -100 | active and advantage != 0 |

PyTRIO normalises a batch by these counts (`total_active_tokens`, or `total_advantage_tokens` for
dro), and a forward_backward's `loss_tokens` usage is the positions that move the loss: active
tokens for cross_entropy, advantage tokens for the policy losses. Vectorised with numpy (no torch, so
the SDK uses it too); `start` skips leading positions (an auto-shifted datum's
first target scores nothing).
"""  # noqa: E501  (a table)

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenCounts:
    """Counts of one datum, a chunk or a whole logical batch."""

    samples: int
    active_tokens: int
    advantage_tokens: int

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(
            self.samples + other.samples,
            self.active_tokens + other.active_tokens,
            self.advantage_tokens + other.advantage_tokens,
        )

    def loss_tokens(self, policy: bool) -> int:
        """Positions whose weight (cross_entropy) or advantage (policy losses) is non-zero."""
        return self.advantage_tokens if policy else self.active_tokens


def count_tokens(
    targets,
    *,
    policy: bool,
    weights=None,
    advantages=None,
    start: int = 0,
) -> TokenCounts:
    """One datum's counts (see the module docstring): `weights` is read for cross_entropy only,
    `advantages` for the policy losses. Sequences of numbers (lists or numpy arrays) of one length."""
    active = np.asarray(targets)[start:] != IGNORE_INDEX
    advantage = 0
    if policy:
        if advantages is not None:
            advantage = int(
                np.count_nonzero(active & (np.asarray(advantages, dtype=np.float64)[start:] != 0))
            )
    elif weights is not None:
        active &= np.asarray(weights, dtype=np.float64)[start:] != 0
    return TokenCounts(1, int(np.count_nonzero(active)), advantage)

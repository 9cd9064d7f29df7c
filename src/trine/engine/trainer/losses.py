"""Per-token training losses, computed on tensors.

Every loss is a function of the target-token log-probability `logp` alone (elementwise), plus the
datum's fixed inputs. Losses are **summed** over tokens here; the trainer may divide a call's
gradient by a denominator (PyTRIO's whole-batch token count, see `engine/prepare.py`),
otherwise normalisation is the user's, folded into `weights` or `advantages` (Tinker semantics).

| name | inputs | per-token loss |
|---|---|---|
| cross_entropy | weights w (default 1) | -w * logp |
| importance_sampling | logprobs q, advantages A | -exp(logp - q) * A |
| ppo | q, A | -min(r * A, clip(r, lo, hi) * A), r = exp(logp - q) |
| cispo | q, A | -sg(clip(r, lo, hi)) * logp * A |
| dro | q, A | -(logp * A - beta/2 * (logp - q)^2) |
| gspo | q, A, sequence_ratio_mask m | -min(s * A, clip(s, lo, hi) * A), s = exp(sg(M) + logp - sg(logp)) |
| stable_reinforce | q, A | -sg(min(r, hi)) * logp * A + kl_coeff * (exp(q - logp) - (q - logp) - 1) |
| custom | the graph's inputs | sg(dC/dlogp) * logp, C the client's graph (custom_graph.py) |

`gspo` is token-level GSPO: M is the datum's mean log-ratio `logp - q` over the positions where
`sequence_ratio_mask` is non-zero (default: the active positions with a non-zero advantage), so
every token's ratio has the sequence's value and its own gradient `s * dlogp`, then PPO-style
clipping. It is the one loss that is not elementwise: the trainer computes every logp of a datum
before its gradients (`Loss.sequence_level`).

`custom` is a client's loss C(logprobs, inputs) per datum. The trainer runs the graph on the datum's
logprobs first (values only, like gspo) and keeps dC/dlogp, so each token's loss here is linear in
logp with that slope: the backward pass is the graph's exact gradient, and the reported loss is C.

`stable_reinforce` is REINFORCE with a truncated, detached importance weight against the sampler
(`r = exp(logp - q)` capped at `clip_high_threshold`, default 2) and an optional k3 estimate of
KL(pi || sampler) weighted by `kl_coeff` (default 0). Tinker's own objective is unpublished (alpha);
this is trine's reading of it. Through the Tinker API, q comes from what the server recorded when it
sampled the sequence (`record_stability_info`, provenance spans), not from the client.

PPO / CISPO thresholds follow Tinker's code: `clip_low_threshold` and `clip_high_threshold` are
**bounds on the ratio r** (`torch.clamp(r, clip_low_threshold, clip_high_threshold)`), not epsilons.
The defaults 0.8 and 1.2 are the usual epsilon 0.2 on both sides. `dro`'s `beta` defaults to 0.05.

Invariants
- Positions whose target is -100 have logprob 0.0 and loss 0.0, and never reach a loss function.
- cross_entropy is exactly linear in the weights (any real value, negative included), which
  `forward_backward_custom` relies on.
- Inputs were checked once, when their event was accepted (`engine/prepare.py`); nothing here
  checks them again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import IGNORE_INDEX, Loss, TrainDatum
from .custom_graph import input_tensor


@dataclass
class LossInputs:
    """Float tensors aligned with some positions of data. A loss reads only its own fields; the
    others hold neutral values (weights 1, logprobs and advantages 0, ratio_mask 0) so data of
    different losses concatenate. `seq_log_ratio` (gspo) is filled in by the trainer once every
    logp of the datum is known."""

    weights: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    ratio_mask: torch.Tensor | None = None
    seq_log_ratio: torch.Tensor | None = None
    custom_grad: torch.Tensor | None = None  # custom: dC/dlogp, filled in like seq_log_ratio

    def __post_init__(self):
        if self.ratio_mask is None:
            self.ratio_mask = torch.zeros_like(self.weights)
        if self.seq_log_ratio is None:
            self.seq_log_ratio = torch.zeros_like(self.weights)
        if self.custom_grad is None:
            self.custom_grad = torch.zeros_like(self.weights)

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (
            self.weights,
            self.logprobs,
            self.advantages,
            self.ratio_mask,
            self.seq_log_ratio,
            self.custom_grad,
        )

    def select(self, index) -> "LossInputs":
        return LossInputs(*(t[index] for t in self._fields()))

    def to(self, device) -> "LossInputs":
        return LossInputs(*(t.to(device) for t in self._fields()))

    @staticmethod
    def cat(parts: list["LossInputs"]) -> "LossInputs":
        return LossInputs(*(torch.cat(ts) for ts in zip(*(p._fields() for p in parts))))


def sequence_log_ratios(
    logp: torch.Tensor, inputs: LossInputs, segments: torch.Tensor, num_segments: int
) -> torch.Tensor:
    """For each position, the mean of `logp - q` over the masked positions of its segment (datum):
    GSPO's sequence log-ratio, as a constant (no gradient). 0 for a segment with no masked position."""
    mask = inputs.ratio_mask.to(logp.dtype)
    num = torch.zeros(num_segments, dtype=logp.dtype, device=logp.device)
    den = torch.zeros_like(num)
    num.index_add_(0, segments, (logp.detach() - inputs.logprobs) * mask)
    den.index_add_(0, segments, mask)
    return (num / den.clamp(min=1.0))[segments]


def loss_values(loss: Loss, logp: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """Per-token losses of `loss` for some active positions; `inputs` holds the same positions."""
    if loss.name == "cross_entropy":
        return -inputs.weights * logp
    if loss.name == "custom":
        return inputs.custom_grad * logp
    q, adv = inputs.logprobs, inputs.advantages
    if loss.name == "dro":
        return -(logp * adv - 0.5 * loss.beta * (logp - q) ** 2)
    if loss.name == "gspo":
        ratio = torch.exp(inputs.seq_log_ratio + logp - logp.detach())
        return -torch.minimum(ratio * adv, ratio.clamp(loss.clip_low, loss.clip_high) * adv)
    ratio = torch.exp(logp - q)
    if loss.name == "importance_sampling":
        return -ratio * adv
    if loss.name == "stable_reinforce":
        out = -ratio.clamp(max=loss.clip_high).detach() * logp * adv
        if loss.kl_coeff:
            d = q - logp
            out = out + loss.kl_coeff * (torch.exp(d) - d - 1)
        return out
    clipped = ratio.clamp(loss.clip_low, loss.clip_high)
    if loss.name == "ppo":
        return -torch.minimum(ratio * adv, clipped * adv)
    return -clipped.detach() * logp * adv  # cispo


@dataclass
class PreparedDatum:
    """A prepared datum as tensors. `active` = positions whose target is not -100."""

    tokens: torch.Tensor  # int64 [N]
    targets: torch.Tensor  # int64 [N]
    inputs: LossInputs  # each [N]
    active: torch.Tensor  # int64 indices into [0, N)
    custom: list[torch.Tensor] | None = None  # a custom loss's inputs, in the order it takes them
    images: tuple = ()  # its ImageInputs (engine/images.py), their placeholders in `tokens`

    def __len__(self) -> int:
        return self.tokens.numel()


def datum_tensors(datum: TrainDatum, loss: Loss) -> PreparedDatum:
    """A datum that `engine.prepare.check_datum` accepted, as tensors (no checks: it was checked
    when its event was accepted)."""
    tokens = torch.tensor(datum.tokens, dtype=torch.int64)
    targets = torch.tensor(datum.target_tokens, dtype=torch.int64)
    n = tokens.numel()
    mask = targets != IGNORE_INDEX
    custom = None
    if loss.custom is not None:
        custom = [input_tensor(datum.custom_inputs[name], "cpu") for name in loss.custom.input_names]
        inputs = LossInputs(torch.ones(n), torch.zeros(n), torch.zeros(n))
    elif loss.is_policy:
        inputs = LossInputs(
            torch.ones(n),
            torch.tensor(datum.logprobs, dtype=torch.float32),
            torch.tensor(datum.advantages, dtype=torch.float32),
        )
        if loss.name == "gspo":
            if datum.sequence_ratio_mask is not None:
                inputs.ratio_mask = torch.tensor(datum.sequence_ratio_mask, dtype=torch.float32) * mask
            else:
                inputs.ratio_mask = (mask & (inputs.advantages != 0)).float()
    else:
        weights = torch.ones(n) if datum.weights is None else torch.tensor(datum.weights, dtype=torch.float32)
        inputs = LossInputs(weights, torch.zeros(n), torch.zeros(n))
    return PreparedDatum(
        tokens, targets, inputs, mask.nonzero().squeeze(1), custom, tuple(datum.images or ())
    )

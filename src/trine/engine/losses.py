"""Per-token training losses and the validation of their inputs.

Every loss is a function of the target-token log-probability `logp` alone (elementwise), plus the
datum's fixed inputs. Losses are **summed** over tokens here; the trainer may divide a call's
gradient by a denominator (PyTRIO's whole-batch token count, see `engine/normalisation.py`),
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

`gspo` is token-level GSPO: M is the datum's mean log-ratio `logp - q` over the positions where
`sequence_ratio_mask` is non-zero (default: the active positions with a non-zero advantage), so
every token's ratio has the sequence's value and its own gradient `s * dlogp`, then PPO-style
clipping. It is the one loss that is not elementwise: the trainer computes every logp of a datum
before its gradients (`Loss.sequence_level`).

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
- Every check runs before any computation: bad input raises `ValueError` naming the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .requests import TrainDatum

IGNORE_INDEX = -100
POLICY_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
LOSS_NAMES = ("cross_entropy",) + POLICY_LOSSES
_CONFIG_KEYS = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
    "gspo": ("clip_low_threshold", "clip_high_threshold"),
    "stable_reinforce": ("clip_high_threshold", "kl_coeff"),
}
_DEFAULT_CLIP_HIGH = {"stable_reinforce": 2.0}


@dataclass(frozen=True)
class Loss:
    """A loss function with its resolved config. Build it with `Loss.parse`."""

    name: str
    clip_low: float = 0.8
    clip_high: float = 1.2
    beta: float = 0.05
    kl_coeff: float = 0.0

    @classmethod
    def parse(cls, name: str, config: dict | None = None) -> "Loss":
        if not isinstance(name, str) or name.lower() not in LOSS_NAMES:
            raise ValueError(f"loss_fn {name!r} is not supported; use one of {', '.join(LOSS_NAMES)}")
        name = name.lower()
        config = dict(config or {})
        unknown = sorted(set(config) - set(_CONFIG_KEYS[name]))
        if unknown:
            allowed = ", ".join(_CONFIG_KEYS[name]) or "none"
            raise ValueError(f"loss_fn_config key(s) {unknown} are not used by {name} (allowed: {allowed})")
        values = {}
        for key, value in config.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"loss_fn_config.{key} must be a finite number, got {value!r}")
            values[key] = float(value)
        loss = cls(name, clip_low=values.get("clip_low_threshold", 0.8),
                   clip_high=values.get("clip_high_threshold", _DEFAULT_CLIP_HIGH.get(name, 1.2)),
                   beta=values.get("beta", 0.05), kl_coeff=values.get("kl_coeff", 0.0))
        if not 0.0 <= loss.clip_low <= 1.0:
            raise ValueError(f"loss_fn_config.clip_low_threshold is a lower bound on the ratio p/q and must be "
                             f"in [0, 1] (0.8 clips at 1 - 0.2), got {loss.clip_low}")
        if loss.clip_high < 1.0:
            raise ValueError(f"loss_fn_config.clip_high_threshold is an upper bound on the ratio p/q and must be "
                             f">= 1 (1.2 clips at 1 + 0.2), got {loss.clip_high}")
        if loss.beta < 0:
            raise ValueError(f"loss_fn_config.beta must be >= 0, got {loss.beta}")
        if loss.kl_coeff < 0:
            raise ValueError(f"loss_fn_config.kl_coeff must be >= 0, got {loss.kl_coeff}")
        return loss

    @property
    def is_policy(self) -> bool:
        return self.name in POLICY_LOSSES

    @property
    def sequence_level(self) -> bool:
        """True when a token's loss depends on the other tokens of its datum (needs
        `LossInputs.seq_log_ratio`, see `sequence_log_ratios`)."""
        return self.name == "gspo"

    def __call__(self, logp: torch.Tensor, inputs: "LossInputs") -> torch.Tensor:
        """Per-token losses for the active positions; `inputs` holds the same positions."""
        if self.name == "cross_entropy":
            return -inputs.weights * logp
        q, adv = inputs.logprobs, inputs.advantages
        if self.name == "dro":
            return -(logp * adv - 0.5 * self.beta * (logp - q) ** 2)
        if self.name == "gspo":
            ratio = torch.exp(inputs.seq_log_ratio + logp - logp.detach())
            return -torch.minimum(ratio * adv, ratio.clamp(self.clip_low, self.clip_high) * adv)
        ratio = torch.exp(logp - q)
        if self.name == "importance_sampling":
            return -ratio * adv
        if self.name == "stable_reinforce":
            loss = -ratio.clamp(max=self.clip_high).detach() * logp * adv
            if self.kl_coeff:
                d = q - logp
                loss = loss + self.kl_coeff * (torch.exp(d) - d - 1)
            return loss
        clipped = ratio.clamp(self.clip_low, self.clip_high)
        if self.name == "ppo":
            return -torch.minimum(ratio * adv, clipped * adv)
        return -clipped.detach() * logp * adv  # cispo


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

    def __post_init__(self):
        if self.ratio_mask is None:
            self.ratio_mask = torch.zeros_like(self.weights)
        if self.seq_log_ratio is None:
            self.seq_log_ratio = torch.zeros_like(self.weights)

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return self.weights, self.logprobs, self.advantages, self.ratio_mask, self.seq_log_ratio

    def select(self, index) -> "LossInputs":
        return LossInputs(*(t[index] for t in self._fields()))

    def to(self, device) -> "LossInputs":
        return LossInputs(*(t.to(device) for t in self._fields()))

    @staticmethod
    def cat(parts: list["LossInputs"]) -> "LossInputs":
        return LossInputs(*(torch.cat(ts) for ts in zip(*(p._fields() for p in parts))))


def sequence_log_ratios(logp: torch.Tensor, inputs: LossInputs, segments: torch.Tensor,
                        num_segments: int) -> torch.Tensor:
    """For each position, the mean of `logp - q` over the masked positions of its segment (datum):
    GSPO's sequence log-ratio, as a constant (no gradient). 0 for a segment with no masked position."""
    mask = inputs.ratio_mask.to(logp.dtype)
    num = torch.zeros(num_segments, dtype=logp.dtype, device=logp.device)
    den = torch.zeros_like(num)
    num.index_add_(0, segments, (logp.detach() - inputs.logprobs) * mask)
    den.index_add_(0, segments, mask)
    return (num / den.clamp(min=1.0))[segments]


@dataclass
class PreparedDatum:
    """A validated datum as tensors. `active` = positions whose target is not -100."""

    tokens: torch.Tensor  # int64 [N]
    targets: torch.Tensor  # int64 [N]
    inputs: LossInputs  # each [N]
    active: torch.Tensor  # int64 indices into [0, N)
    token_count: int  # cross_entropy: active and weight != 0; policy losses: active
    loss_tokens: int  # active and weight (or advantage) != 0

    def __len__(self) -> int:
        return self.tokens.numel()


def _ints(values, field: str, where: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where}.{field} must be a list of integers ({e})") from None
    if t.dtype in (torch.bool,) or t.is_floating_point() or t.is_complex() or t.dim() != 1:
        raise ValueError(f"{where}.{field} must be a flat list of integers")
    return t.to(torch.int64)


def _floats(values, field: str, where: str, n: int) -> torch.Tensor:
    try:
        t = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where}.{field} must be a list of numbers ({e})") from None
    if t.dim() != 1 or t.numel() != n:
        raise ValueError(f"{where}.{field} has {t.numel()} values; it needs one per input token ({n})")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}.{field} holds NaN or infinite values; every value must be finite")
    return t


def prepare_datum(datum: TrainDatum, loss: Loss, vocab_size: int, where: str = "datum") -> PreparedDatum:
    """Check one datum against `loss` and the vocabulary; return it as tensors."""
    if not isinstance(datum, TrainDatum):
        raise ValueError(f"{where} must be a TrainDatum, got {type(datum).__name__}")
    tokens = _ints(datum.tokens, "tokens", where)
    n = tokens.numel()
    if n == 0:
        raise ValueError(f"{where}.tokens is empty; a datum needs at least one token")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"{where}.tokens has ids outside the vocabulary [0, {vocab_size})")
    targets = _ints(datum.target_tokens, "target_tokens", where)
    if targets.numel() != n:
        raise ValueError(f"{where}.target_tokens has {targets.numel()} values; it needs one per input "
                         f"token ({n}), pre-shifted (position i predicts target i)")
    ok = (targets == IGNORE_INDEX) | ((targets >= 0) & (targets < vocab_size))
    if not bool(ok.all()):
        raise ValueError(f"{where}.target_tokens has ids outside the vocabulary [0, {vocab_size}) "
                         f"(use {IGNORE_INDEX} to ignore a position)")
    mask = targets != IGNORE_INDEX
    if loss.is_policy:
        for field in ("logprobs", "advantages"):
            if getattr(datum, field) is None:
                raise ValueError(f"{where}.{field} is required by the {loss.name} loss")
        inputs = LossInputs(torch.ones(n), _floats(datum.logprobs, "logprobs", where, n),
                            _floats(datum.advantages, "advantages", where, n))
        if loss.name == "gspo":
            if datum.sequence_ratio_mask is not None:
                inputs.ratio_mask = _floats(datum.sequence_ratio_mask, "sequence_ratio_mask", where, n) * mask
            else:
                inputs.ratio_mask = (mask & (inputs.advantages != 0)).float()
        counted = mask
        nonzero = mask & (inputs.advantages != 0)
    else:
        weights = (torch.ones(n) if datum.weights is None
                   else _floats(datum.weights, "weights", where, n))
        inputs = LossInputs(weights, torch.zeros(n), torch.zeros(n))
        counted = nonzero = mask & (weights != 0)
    return PreparedDatum(tokens, targets, inputs, mask.nonzero().squeeze(1),
                         int(counted.sum()), int(nonzero.sum()))

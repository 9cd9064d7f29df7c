"""Per-token training losses and the validation of their inputs.

Every loss is a function of the target-token log-probability `logp` alone (elementwise), plus the
datum's fixed inputs. Losses are **summed** over tokens here; the trainer may divide a call's
gradient by a denominator (PyTRIO's whole-batch token count, see `server/normalisation.py`),
otherwise normalisation is the user's, folded into `weights` or `advantages` (Tinker semantics).

| name | inputs | per-token loss |
|---|---|---|
| cross_entropy | weights w (default 1) | -w * logp |
| importance_sampling | logprobs q, advantages A | -exp(logp - q) * A |
| ppo | q, A | -min(r * A, clip(r, lo, hi) * A), r = exp(logp - q) |
| cispo | q, A | -sg(clip(r, lo, hi)) * logp * A |
| dro | q, A | -(logp * A - beta/2 * (logp - q)^2) |

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
POLICY_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")
LOSS_NAMES = ("cross_entropy",) + POLICY_LOSSES
_CONFIG_KEYS = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
}


@dataclass(frozen=True)
class Loss:
    """A loss function with its resolved config. Build it with `Loss.parse`."""

    name: str
    clip_low: float = 0.8
    clip_high: float = 1.2
    beta: float = 0.05

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
                   clip_high=values.get("clip_high_threshold", 1.2), beta=values.get("beta", 0.05))
        if not 0.0 <= loss.clip_low <= 1.0:
            raise ValueError(f"loss_fn_config.clip_low_threshold is a lower bound on the ratio p/q and must be "
                             f"in [0, 1] (0.8 clips at 1 - 0.2), got {loss.clip_low}")
        if loss.clip_high < 1.0:
            raise ValueError(f"loss_fn_config.clip_high_threshold is an upper bound on the ratio p/q and must be "
                             f">= 1 (1.2 clips at 1 + 0.2), got {loss.clip_high}")
        if loss.beta < 0:
            raise ValueError(f"loss_fn_config.beta must be >= 0, got {loss.beta}")
        return loss

    @property
    def is_policy(self) -> bool:
        return self.name in POLICY_LOSSES

    def __call__(self, logp: torch.Tensor, inputs: "LossInputs") -> torch.Tensor:
        """Per-token losses for the active positions; `inputs` holds the same positions."""
        if self.name == "cross_entropy":
            return -inputs.weights * logp
        q, adv = inputs.logprobs, inputs.advantages
        if self.name == "dro":
            return -(logp * adv - 0.5 * self.beta * (logp - q) ** 2)
        ratio = torch.exp(logp - q)
        if self.name == "importance_sampling":
            return -ratio * adv
        clipped = ratio.clamp(self.clip_low, self.clip_high)
        if self.name == "ppo":
            return -torch.minimum(ratio * adv, clipped * adv)
        return -clipped.detach() * logp * adv  # cispo


@dataclass
class LossInputs:
    """Float tensors aligned with some positions of data. A loss reads only its own fields; the
    others hold neutral values (weights 1, logprobs and advantages 0) so data of different losses
    concatenate."""

    weights: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor

    def select(self, index: torch.Tensor) -> "LossInputs":
        return LossInputs(self.weights[index], self.logprobs[index], self.advantages[index])

    def to(self, device) -> "LossInputs":
        return LossInputs(self.weights.to(device), self.logprobs.to(device), self.advantages.to(device))

    @staticmethod
    def cat(parts: list["LossInputs"]) -> "LossInputs":
        return LossInputs(torch.cat([p.weights for p in parts]), torch.cat([p.logprobs for p in parts]),
                          torch.cat([p.advantages for p in parts]))


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
        counted = mask
        nonzero = mask & (inputs.advantages != 0)
    else:
        weights = (torch.ones(n) if datum.weights is None
                   else _floats(datum.weights, "weights", where, n))
        inputs = LossInputs(weights, torch.zeros(n), torch.zeros(n))
        counted = nonzero = mask & (weights != 0)
    return PreparedDatum(tokens, targets, inputs, mask.nonzero().squeeze(1),
                         int(counted.sum()), int(nonzero.sum()))

"""User-set parameters: sampling, the Adam optimizer step, and a LoRA adapter's shape.

Defaults equal PyTRIO's. Invalid values raise ValueError naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import model_validator

from ..limits import ADAM_BOUNDS, SAMPLING_BOUNDS, check_adam_value, sampling_bound_error
from .base import BaseModel

EXTENSIONS = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0}


class SamplingParams(BaseModel):
    max_tokens: int | None = None  # required by sample(); None here so the type can be built in steps
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None  # stop strings, or stop token ids
    temperature: float = 1
    top_k: int = -1  # -1: off
    top_p: float = 1
    # trine extensions (vLLM's semantics), off by default and sent only when set
    presence_penalty: float = 0  # minus this on the logit of each token the sample has generated
    frequency_penalty: float = 0  # minus this once per time the sample has generated the token
    repetition_penalty: float = 1  # tokens of the prompt or the sample: logit / p if > 0, else * p
    min_p: float = 0  # drop tokens less likely than min_p x the most likely one
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"SamplingParams.max_tokens must be > 0, got {self.max_tokens}")
        for name in SAMPLING_BOUNDS:
            if (error := sampling_bound_error(name, getattr(self, name))) is not None:
                raise ValueError(f"SamplingParams.{name} {error}")
        if any(t < 0 or not math.isfinite(v) for t, v in (self.logit_bias or {}).items()):
            raise ValueError("SamplingParams.logit_bias maps token ids (>= 0) to finite biases")
        return self

    def to_wire(self) -> dict:
        """The PyTRIO wire form: `stop` strings and `stop_token_ids` are separate fields."""
        out: dict = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
        }
        if self.seed is not None:
            out["seed"] = self.seed
        for name, off in EXTENSIONS.items():
            if getattr(self, name) != off:
                out[name] = getattr(self, name)
        if self.logit_bias:
            out["logit_bias"] = {str(t): v for t, v in self.logit_bias.items()}
        stop = self.stop
        if isinstance(stop, str):
            out["stop"] = [stop]
        elif stop is not None:
            items = list(stop)
            if items and all(isinstance(s, int) and not isinstance(s, bool) for s in items):
                out["stop_token_ids"] = items
            elif all(isinstance(s, str) for s in items):
                out["stop"] = items
            else:
                raise ValueError(
                    "SamplingParams.stop must be a str, a list of str, or a list of int token ids"
                )
        return out


class AdamParams(BaseModel):
    """AdamW. grad_clip_norm 0.0 = no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    @model_validator(mode="after")
    def _check(self) -> AdamParams:
        for name in ADAM_BOUNDS:
            check_adam_value(name, getattr(self, name))
        return self


class LoraConfig(BaseModel):
    """The LoRA adapter of a training run. rank must be in [4, 64] (as PyTRIO enforces). With `full`
    (trine's own), the run fine-tunes the model's own weights instead (its rank is 0): the attention
    layers, the MLPs and, with train_unembed, the embedding and head; `trainable_token_indices`
    restricts the embedding and head to those rows."""

    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    full: bool = False
    trainable_token_indices: list[int] | None = None

    @model_validator(mode="after")
    def _shape(self) -> LoraConfig:
        if self.full:
            self.rank = 0
        elif not 4 <= self.rank <= 64:
            raise ValueError(
                f"LoraConfig.rank must be in [4, 64], got {self.rank} (full=True fine-tunes every weight)"
            )
        elif self.trainable_token_indices:
            raise ValueError(
                "LoraConfig.trainable_token_indices: only full fine-tuning (full=True) trains embedding rows"
            )
        if not (self.train_mlp or self.train_attn or self.train_unembed or self.full):
            raise ValueError("LoraConfig: at least one of train_mlp, train_attn, train_unembed must be True")
        return self

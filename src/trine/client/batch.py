"""Checking and splitting one logical forward / forward_backward batch (PyTRIO's rules).

Every datum is validated before anything is sent (errors name the sample and field). Totals
(`gradient_accumulation`) describe the whole logical batch and are identical in every chunk, so
the server can normalise each chunk's gradient by the full batch. Chunks keep input order and
split greedily at the run's `max_batch_size` samples / `max_tokens_per_request` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ValidationError
from ..tokens import TokenCounts, count_tokens
from ..types import Datum, ImageChunk, ModelInput
from .wire import model_input_to_wire

LOSS_INPUTS = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),  # + optional sequence_ratio_mask
    "stable_reinforce": ("target_tokens", "logprobs", "advantages"),
    "custom": ("target_tokens",),  # + the traced loss's own inputs (traced_loss.py)
}


@dataclass(frozen=True)
class Limits:
    max_batch_size: int | None = None
    max_tokens_per_request: int | None = None
    max_seq_len: int | None = None

    @classmethod
    def from_wire(cls, capability: dict | None) -> Limits:
        c = capability or {}
        return cls(c.get("max_batch_size"), c.get("max_tokens_per_request"), c.get("max_seq_len"))


@dataclass(frozen=True)
class Plan:
    loss_fn: str
    chunks: list[list[dict]]  # wire datums per chunk
    totals: dict  # gradient_accumulation, identical for every chunk

    def payloads(self, loss_fn_config: dict | None, auto_shift: bool) -> list[dict]:
        return [
            {
                "data": chunk,
                "auto_shift": auto_shift,
                "loss": {"type": self.loss_fn, "config": dict(loss_fn_config or {})},
                "gradient_accumulation": self.totals,
            }
            for chunk in self.chunks
        ]


def normalize_loss_fn(loss_fn: str) -> str:
    name = loss_fn.strip().lower() if isinstance(loss_fn, str) else loss_fn
    if name not in LOSS_INPUTS or name == "custom":
        raise ValidationError(
            f"Unsupported loss function type: {loss_fn!r} (use one of {', '.join(LOSS_INPUTS)})",
            code="validation.unsupported_loss",
        )
    return name


def _fill_image_length(datum: Datum, i: int) -> ModelInput:
    """If exactly one image lacks expected_tokens, infer it from len(target_tokens)."""
    mi = datum.model_input
    missing = [k for k, c in enumerate(mi.chunks) if isinstance(c, ImageChunk) and c.expected_tokens is None]
    if not missing:
        return mi
    if len(missing) > 1:
        raise ValidationError(f"data[{i}].model_input: more than one ImageChunk lacks expected_tokens")
    known = sum(len(c) if not isinstance(c, ImageChunk) else (c.expected_tokens or 0) for c in mi.chunks)
    n = len(datum.loss_fn_inputs["target_tokens"].data) - known
    if n <= 0:
        raise ValidationError(
            f"data[{i}].model_input: cannot infer the image's expected_tokens from target_tokens"
        )
    chunks = list(mi.chunks)
    chunks[missing[0]] = chunks[missing[0]].model_copy(update={"expected_tokens": n})
    return ModelInput(chunks=chunks)


def _floats(datum: Datum, name: str, n: int, i: int) -> list[float]:
    t = datum.loss_fn_inputs[name]
    if t.shape != [n]:
        raise ValidationError(
            f"data[{i}].loss_fn_inputs['{name}'] must have shape [{n}] (the input length), got {t.shape}"
        )
    values = [float(v) for v in t.data]
    for k, v in enumerate(values):
        if not math.isfinite(v):
            raise ValidationError(f"data[{i}].loss_fn_inputs['{name}'][{k}] must be finite, got {v}")
    return values


def _custom_input(datum: Datum, name: str, rank: int, i: int) -> dict:
    t = datum.loss_fn_inputs[name]
    if len(t.shape) != rank:
        raise ValidationError(
            f"data[{i}].loss_fn_inputs['{name}'] has rank {len(t.shape)}; the custom loss declared {rank}"
        )
    if t.dtype == "float32" and not all(math.isfinite(v) for v in t.data):
        raise ValidationError(f"data[{i}].loss_fn_inputs['{name}'] must be finite")
    return {"shape": list(t.shape), "values": list(t.data), "dtype": t.dtype}


def plan_batch(
    data: list[Datum],
    *,
    loss_fn: str,
    auto_shift: bool,
    limits: Limits,
    vocab_size: int,
    custom: dict[str, int] | None = None,
) -> Plan:
    """`custom`: the inputs (name -> rank) of a traced custom loss (loss_fn is then "custom")."""
    if not data:
        raise ValidationError(
            "data: the batch is empty; pass at least one Datum", code="validation.empty_training_data"
        )
    loss = "custom" if custom is not None else normalize_loss_fn(loss_fn)
    start = 1 if auto_shift else 0
    wire_data: list[tuple[dict, int]] = []
    totals = TokenCounts(0, 0, 0)
    for i, datum in enumerate(data):
        if not isinstance(datum, Datum):
            raise ValidationError(f"data[{i}] must be a trine.Datum, got {type(datum).__name__}")
        for name in LOSS_INPUTS[loss] + tuple(custom or ()):
            if name not in datum.loss_fn_inputs:
                raise ValidationError(f"data[{i}].loss_fn_inputs['{name}'] is required by loss_fn '{loss}'")
        mi = _fill_image_length(datum, i)
        n = len(mi)
        if n < 1:
            raise ValidationError(f"data[{i}].model_input is empty", code="validation.empty_training_sample")
        pos = 0
        for c in mi.chunks:
            if isinstance(c, ImageChunk):
                pos += c.expected_tokens
                continue
            for tok in c.tokens:
                if not 0 <= tok < vocab_size:
                    raise ValidationError(
                        f"data[{i}].model_input token {pos} = {tok} is outside the vocabulary "
                        f"[0, {vocab_size})",
                        code="validation.token_id_out_of_range",
                    )
                pos += 1
        if limits.max_seq_len is not None and n > limits.max_seq_len:
            raise ValidationError(
                f"data[{i}] has {n} tokens, more than the model's max_seq_len {limits.max_seq_len}",
                code="validation.training_sample_too_long",
            )
        if limits.max_tokens_per_request is not None and n > limits.max_tokens_per_request:
            raise ValidationError(
                f"data[{i}] has {n} tokens, more than max_tokens_per_request {limits.max_tokens_per_request}",
                code="validation.training_sample_too_large",
            )
        target = datum.loss_fn_inputs["target_tokens"]
        if target.dtype != "int64":
            raise ValidationError(
                f"data[{i}].loss_fn_inputs['target_tokens'] must be integers (int64), got {target.dtype}"
            )
        if target.shape != [n]:
            raise ValidationError(
                f"data[{i}].loss_fn_inputs['target_tokens'] must have shape [{n}] "
                f"(the input length), got {target.shape}"
            )
        targets = [int(t) for t in target.data]
        for k, t in enumerate(targets):
            if t != -100 and not 0 <= t < vocab_size:
                raise ValidationError(
                    f"data[{i}].loss_fn_inputs['target_tokens'][{k}] = {t} is outside the vocabulary "
                    f"[0, {vocab_size}) (use -100 to ignore a position)",
                    code="validation.token_id_out_of_range",
                )
        wire = {"model_input": model_input_to_wire(mi, json=False), "target_ids": targets}
        if loss == "custom":
            wire["custom_inputs"] = {
                name: _custom_input(datum, name, rank, i) for name, rank in custom.items()
            }
            totals += count_tokens(targets, policy=False, start=start)
        elif loss == "cross_entropy":
            weights = _floats(datum, "weights", n, i) if "weights" in datum.loss_fn_inputs else [1.0] * n
            wire["weights"] = weights
            totals += count_tokens(targets, policy=False, weights=weights, start=start)
        else:
            wire["logprobs"] = _floats(datum, "logprobs", n, i)
            adv = _floats(datum, "advantages", n, i)
            wire["advantages"] = adv
            if loss == "gspo" and "sequence_ratio_mask" in datum.loss_fn_inputs:
                wire["sequence_ratio_mask"] = _floats(datum, "sequence_ratio_mask", n, i)
            totals += count_tokens(targets, policy=True, advantages=adv, start=start)
        wire_data.append((wire, n))

    chunks: list[list[dict]] = []
    current: list[dict] = []
    tokens = 0
    for wire, n in wire_data:
        full = (limits.max_batch_size is not None and len(current) + 1 > limits.max_batch_size) or (
            limits.max_tokens_per_request is not None and tokens + n > limits.max_tokens_per_request
        )
        if current and full:
            chunks.append(current)
            current, tokens = [], 0
        current.append(wire)
        tokens += n
    chunks.append(current)
    counts = {
        "total_samples": len(data),
        "total_active_tokens": totals.active_tokens,
        "total_advantage_tokens": totals.advantage_tokens,
    }
    return Plan(loss_fn=loss, chunks=chunks, totals=counts)

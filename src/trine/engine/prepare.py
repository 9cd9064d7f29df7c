"""Preparing a forward op when its event is accepted: every datum checked once, counted once, and
the gradient denominator resolved. The trainer trusts a prepared op and checks nothing again.

Gradient denominators. A client may split one logical batch into chunks and send the whole batch's
counts with every chunk (PyTRIO's `gradient_accumulation`). Each chunk's summed loss is then
divided by the whole batch's count, so a batch sent whole or in chunks gives one gradient and a
repeated datum leaves the mean unchanged. The count is `trine.tokens`' active tokens, or advantage
tokens for dro; a count of 0 counts as 1. Without the whole batch's counts the chunk is its own
whole batch. Tinker's contract (`normalise=False`) is the plain sum: no denominator at all. The
reported metrics (`loss_sum`, `token_count`) never depend on it.

Invariants
- Torch-free (numpy), so acceptance runs it in the server process without the engine.
- Bad input raises ValueError naming the field (`data[2].target_tokens ...`), before anything runs.
- A chunk never holds more samples or tokens than the whole batch's counts say; otherwise the error
  names the count and the field the totals came from (`gradient_accumulation.total_active_tokens`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..tokens import IGNORE_INDEX, TokenCounts, count_tokens
from .api import ADVANTAGE_NORMALISED, Forward, Loss, TrainDatum
from .loss_graph import MAX_INPUT_ELEMENTS

COUNT_NAMES = ("total_samples", "total_active_tokens", "total_advantage_tokens")


def prepare_forward(op: Forward, vocab_size: int, max_seq_len: int | None = None, model: str = "") -> Forward:
    """`op` with its datums checked against `loss`, the vocabulary and the context, its `counts`
    and its `denominator` filled in (ValueError naming the field otherwise)."""
    if not op.data:
        raise ValueError("data: the batch is empty; send at least one datum")
    counts = tuple(check_datum(d, op.loss, vocab_size, f"data[{i}]") for i, d in enumerate(op.data))
    n = max(len(d.tokens) for d in op.data)
    if max_seq_len is not None and n > max_seq_len:
        raise ValueError(f"data: a sequence has {n} tokens; {model} handles at most {max_seq_len}")
    denominator = _denominator(op, counts) if op.normalise else None
    return dataclasses.replace(op, counts=counts, denominator=denominator)


def check_datum(datum: TrainDatum, loss: Loss, vocab_size: int, where: str = "datum") -> TokenCounts:
    """Check one datum against `loss` and the vocabulary; its counts."""
    if not isinstance(datum, TrainDatum):
        raise ValueError(f"{where} must be a TrainDatum, got {type(datum).__name__}")
    tokens = _ints(datum.tokens, "tokens", where)
    n = tokens.size
    if n == 0:
        raise ValueError(f"{where}.tokens is empty; a datum needs at least one token")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"{where}.tokens has ids outside the vocabulary [0, {vocab_size})")
    targets = _ints(datum.target_tokens, "target_tokens", where)
    if targets.size != n:
        raise ValueError(
            f"{where}.target_tokens has {targets.size} values; it needs one per input "
            f"token ({n}), pre-shifted (position i predicts target i)"
        )
    ok = (targets == IGNORE_INDEX) | ((targets >= 0) & (targets < vocab_size))
    if not bool(ok.all()):
        raise ValueError(
            f"{where}.target_tokens has ids outside the vocabulary [0, {vocab_size}) "
            f"(use {IGNORE_INDEX} to ignore a position)"
        )
    if loss.custom is not None:
        _custom_inputs(datum, loss, where)
        return count_tokens(targets, policy=False)
    if loss.is_policy:
        for name in ("logprobs", "advantages"):
            if getattr(datum, name) is None:
                raise ValueError(f"{where}.{name} is required by the {loss.name} loss")
        _floats(datum.logprobs, "logprobs", where, n)
        advantages = _floats(datum.advantages, "advantages", where, n)
        if loss.name == "gspo" and datum.sequence_ratio_mask is not None:
            _floats(datum.sequence_ratio_mask, "sequence_ratio_mask", where, n)
        return count_tokens(targets, policy=True, advantages=advantages)
    weights = None if datum.weights is None else _floats(datum.weights, "weights", where, n)
    return count_tokens(targets, policy=False, weights=weights)


def _custom_inputs(datum: TrainDatum, loss: Loss, where: str) -> None:
    """Each input the custom loss declares is there, at its rank, with finite values."""
    given = datum.custom_inputs or {}
    for name, rank in loss.custom.inputs[1:]:
        field = f"{where}.loss_fn_inputs[{name!r}]"
        t = given.get(name)
        if t is None:
            raise ValueError(f"{field} is required by custom loss {loss.custom.name!r}")
        if len(t.shape) != rank:
            raise ValueError(
                f"{field} has rank {len(t.shape)}, but custom loss {loss.custom.name!r} declared "
                f"{name} with rank {rank}"
            )
        numel = int(np.prod(t.shape, dtype=np.int64))
        if numel > MAX_INPUT_ELEMENTS or numel != len(t.values):
            raise ValueError(
                f"{field}: shape {list(t.shape)} with {len(t.values)} values (at most {MAX_INPUT_ELEMENTS})"
            )
        if t.dtype == "float32" and not bool(np.isfinite(np.asarray(t.values, dtype=np.float64)).all()):
            raise ValueError(f"{field} holds NaN or infinite values; every value must be finite")


def _denominator(op: Forward, counts: tuple[TokenCounts, ...]) -> float:
    own = sum(counts, TokenCounts(0, 0, 0))
    whole = op.totals or own
    for name, mine, theirs in zip(COUNT_NAMES, dataclasses.astuple(own), dataclasses.astuple(whole)):
        if mine > theirs:
            raise ValueError(
                f"{op.totals_field}.{name} is {theirs}, but this chunk alone has {mine}: the totals "
                "must describe the whole logical batch"
            )
    count = whole.advantage_tokens if op.loss.name in ADVANTAGE_NORMALISED else whole.active_tokens
    return float(max(count, 1))


def _ints(values, name: str, where: str) -> np.ndarray:
    try:
        a = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.{name} must be a list of integers ({e})") from None
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"{where}.{name} must be a flat list of integers")
    return a.astype(np.int64, copy=False)


def _floats(values, name: str, where: str, n: int) -> np.ndarray:
    try:
        a = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.{name} must be a list of numbers ({e})") from None
    if a.ndim != 1 or a.size != n:
        raise ValueError(f"{where}.{name} has {a.size} values; it needs one per input token ({n})")
    if not bool(np.isfinite(a).all()):
        raise ValueError(f"{where}.{name} holds NaN or infinite values; every value must be finite")
    return a

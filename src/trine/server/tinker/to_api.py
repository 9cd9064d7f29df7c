"""Tinker bodies (bodies.py) -> the engine's vocabulary (`engine/api.py`): a `forward_backward`
protobuf's data as `TrainDatum`s (shapes and dtypes checked: one value per input token), its loss
config, an optimizer family and an optim step. Every error is an InvalidRequest whose message names
the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...engine.api import (
    ADAMW,
    DIMUON,
    MAX_INPUT_ELEMENTS,
    DimuonConfig,
    LossTensor,
    OptimStep,
    TrainDatum,
)
from ...service import InvalidRequest
from ..http.context import parse_model
from ..pytrio.to_api import optim_step as adam_optim_step
from .bodies import DimuonBody, OptimStepBody

_NUMPY = {1: np.float32, 2: np.int64, 3: np.int32}  # proto DType -> numpy (bf16 handled apart)
FLOAT_INPUTS = ("weights", "advantages", "logprobs", "sequence_ratio_mask")
KNOWN_INPUTS = ("target_tokens",) + FLOAT_INPUTS  # anything else is refused, never dropped silently


@dataclass
class Span:
    """One provenance run over a datum's loss rows: `length` positions that are positions
    [offset, offset + length) of sequence `sequence_id`'s sampled tokens (sampled=True) or of its
    request's prompt (sampled=False)."""

    sequence_id: str
    offset: int
    length: int
    sampled: bool


@dataclass
class ForwardBackwardBody:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict
    forward_only: bool
    data: list[TrainDatum]
    spans: list[list[Span]] = field(default_factory=list)  # per datum; [] = none sent


def _tensor(t, where: str, size: int) -> np.ndarray:
    """A proto Tensor of `size` values as a flat numpy array (sparse CSR densified with zeros). The
    shape is checked against `size` before anything is allocated."""
    shape = list(t.shape)
    if any(d < 0 for d in shape) or (shape and math.prod(shape) != size):
        raise InvalidRequest(f"{where}: shape {shape} does not hold {size} values (one per input token)")
    if t.dtype == 4:  # bfloat16: the upper half of a float32
        dtype = np.uint16
    elif t.dtype in _NUMPY:
        dtype = _NUMPY[t.dtype]
    else:
        raise InvalidRequest(
            f"{where}: dtype {t.dtype} is not a tensor dtype (float32, int64, int32, bfloat16)"
        )

    def read(raw: bytes, dt, what: str) -> np.ndarray:
        if len(raw) % np.dtype(dt).itemsize:
            raise InvalidRequest(f"{where}.{what}: {len(raw)} bytes is not a whole number of values")
        return np.frombuffer(raw, dtype=dt)

    if t.HasField("sparse_csr"):
        if len(shape) != 2:
            raise InvalidRequest(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
        values = read(t.sparse_csr.values, dtype, "sparse_csr.values")
        crow = read(t.sparse_csr.crow_indices, np.int64, "sparse_csr.crow_indices")
        col = read(t.sparse_csr.col_indices, np.int64, "sparse_csr.col_indices")
        rows, cols = shape
        if (
            len(crow) != rows + 1
            or len(col) != len(values)
            or (len(col) and (col.min() < 0 or col.max() >= cols))
            or crow[0] != 0
            or crow[-1] != len(values)
            or np.any(np.diff(crow) < 0)
        ):
            raise InvalidRequest(f"{where}: the sparse CSR indices do not describe a {rows}x{cols} tensor")
        dense = np.zeros((rows, cols), dtype=dtype)
        row_of = np.repeat(np.arange(rows), np.diff(crow))
        dense[row_of, col] = values
        arr = dense.reshape(-1)
    else:
        arr = read(t.dense, dtype, "dense")
    if t.dtype == 4:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def _tokens(chunks, where: str) -> list[int]:
    out: list[int] = []
    for k, c in enumerate(chunks):
        kind = c.WhichOneof("chunk")
        if kind == "encoded_text":
            raw = c.encoded_text.tokens
            if len(raw) % 4:
                raise InvalidRequest(f"{where}.model_input[{k}].tokens: not int32 values")
            out.extend(np.frombuffer(raw, dtype=np.int32).tolist())
        else:
            raise InvalidRequest(
                f"{where}.model_input[{k}]: {kind or 'image/audio'} chunks are not "
                "supported; the served models are text-only: send encoded_text chunks",
                code="not_supported",
            )
    return out


def _spans(spans, where: str) -> list[Span]:
    out = []
    for k, s in enumerate(spans):
        arm = s.WhichOneof("span")
        if arm not in ("prompt_tokens", "sampled_tokens"):
            raise InvalidRequest(f"{where}[{k}]: a provenance span must be prompt_tokens or sampled_tokens")
        run = getattr(s, arm)
        if run.offset < 0 or run.length < 0:
            raise InvalidRequest(f"{where}[{k}]: offset {run.offset} and length {run.length} must be >= 0")
        out.append(Span(run.sequence_id, int(run.offset), int(run.length), arm == "sampled_tokens"))
    return out


def _loss_tensor(t, where: str, rank: int) -> LossTensor:
    """A custom loss input at its own shape (an empty shape: a scalar for a rank-0 input, else a
    vector), bounded before anything is allocated."""
    shape = list(t.shape)
    if len(shape) > 2 or any(d < 0 for d in shape) or math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise InvalidRequest(
            f"{where}: shape {shape[:4]}: at most 2 dimensions and {MAX_INPUT_ELEMENTS} values"
        )
    arr = _tensor(t, where, math.prod(shape))
    if arr.size > MAX_INPUT_ELEMENTS:
        raise InvalidRequest(
            f"{where}: {arr.size} values; a custom loss input holds at most {MAX_INPUT_ELEMENTS}"
        )
    if not shape:
        shape = [] if rank == 0 and arr.size == 1 else [arr.size]
    if arr.dtype.kind in "iu":
        return LossTensor(tuple(shape), arr.astype(np.int64).tolist(), "int64")
    return LossTensor(tuple(shape), arr.astype(np.float64).tolist(), "float32")


def loss_config(msg) -> dict:
    config: dict = {}
    for k, v in msg.loss_fn_config.items():
        config[k] = float(v)
    for k, v in msg.loss_fn_config_v2.items():  # preferred when set
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return config


def forward_backward_body(msg, custom: dict[str, int] | None = None) -> ForwardBackwardBody:
    """The request's content as plain values; validates shapes (one value per input token) and dtypes.

    `custom`: the inputs (name -> rank) of the custom loss the request names. Those inputs keep
    their own shapes; the others, apart from target_tokens, are the client's and are not read."""
    if not msg.data:
        raise InvalidRequest("data: the batch is empty; send at least one Datum")
    data, spans = [], []
    for i, d in enumerate(msg.data):
        where = f"data[{i}]"
        tokens = _tokens(d.model_input, where)
        n = len(tokens)
        if n == 0:
            raise InvalidRequest(f"{where}.model_input is empty")
        inputs, custom_inputs = {}, {}
        for name, t in d.loss_fn_inputs.items():
            if custom is not None and name in custom:  # target_tokens too, if the loss reads it
                custom_inputs[name] = _loss_tensor(t, f"{where}.loss_fn_inputs[{name!r}]", custom[name])
            if custom is not None and name != "target_tokens":
                continue
            if name not in KNOWN_INPUTS:
                hint = "; give clip thresholds in loss_fn_config" if "threshold" in name else ""
                raise InvalidRequest(
                    f"{where}.loss_fn_inputs[{name!r}] is not a loss input trine uses "
                    f"({', '.join(KNOWN_INPUTS)}){hint}"
                )
            arr = _tensor(t, f"{where}.loss_fn_inputs[{name!r}]", n)
            if arr.size != n:
                raise InvalidRequest(
                    f"{where}.loss_fn_inputs[{name!r}] has {arr.size} values; it needs one "
                    f"per input token ({n})"
                )
            inputs[name] = arr
        if "target_tokens" not in inputs:
            raise InvalidRequest(f"{where}.loss_fn_inputs['target_tokens'] is required")
        targets = inputs["target_tokens"]
        if targets.dtype.kind == "f":
            if (
                not np.all(np.isfinite(targets))
                or np.any(targets != np.round(targets))
                or np.any(np.abs(targets) >= 2.0**62)
            ):
                raise InvalidRequest(f"{where}.loss_fn_inputs['target_tokens'] must hold integers")
        floats = {k: [float(x) for x in inputs[k].astype(np.float64)] for k in FLOAT_INPUTS if k in inputs}
        for k, vs in floats.items():
            if not all(math.isfinite(x) for x in vs):
                raise InvalidRequest(f"{where}.loss_fn_inputs[{k!r}] holds NaN or infinite values")
        data.append(
            TrainDatum(
                tokens=tokens,
                target_tokens=[int(x) for x in targets.astype(np.int64)],
                weights=floats.get("weights"),
                logprobs=floats.get("logprobs"),
                advantages=floats.get("advantages"),
                sequence_ratio_mask=floats.get("sequence_ratio_mask"),
                custom_inputs=custom_inputs if custom is not None else None,
            )
        )
        runs = _spans(d.loss_fn_input_spans, f"{where}.loss_fn_input_spans")
        if runs and sum(s.length for s in runs) != n:
            raise InvalidRequest(
                f"{where}.loss_fn_input_spans cover {sum(s.length for s in runs)} "
                f"positions; they must tile all {n} loss rows"
            )
        spans.append(runs)
    return ForwardBackwardBody(
        msg.model_id,
        int(msg.seq_id),
        msg.loss_fn or "cross_entropy",
        loss_config(msg),
        bool(msg.forward_only),
        data,
        spans,
    )


# ---------------------------------------------------------------------------- optimizer steps
def optimizer_family(config: dict | None) -> str:
    """The optimizer family of an `optimizer_config` ("" when none was sent)."""
    if config is None:
        return ""
    kind = config.get("type", ADAMW)
    if kind in ("adam", ADAMW):
        return ADAMW
    if kind == DIMUON:
        if config.get("version", 1) != 1:
            raise InvalidRequest(
                f"optimizer_config.version {config.get('version')!r}: trine implements Dimuon version 1"
            )
        return DIMUON
    raise InvalidRequest(
        f"optimizer_config.type {kind!r}: not supported; use AdamOptimizerConfig (adamw) or "
        "DimuonOptimizerConfig (dimuon)",
        code="not_supported",
    )


def optim_step(b: OptimStepBody) -> OptimStep:
    """AdamParams (`adam_params`) or DimuonParams (`optimizer_params` of type dimuon)."""
    if b.optimizer_params is None:
        return adam_optim_step({"adam_params": b.adam_params})
    kind = b.optimizer_params.get("type")
    if kind != DIMUON:
        raise InvalidRequest(
            f"optimizer_params.type {kind!r}: not supported; send AdamParams or DimuonParams",
            code="not_supported",
        )
    p = parse_model(DimuonBody, b.optimizer_params, "optimizer_params")
    settings = DimuonConfig(
        learning_rate=p.learning_rate,
        beta1=p.beta1,
        grad_clip_norm=p.grad_clip_norm,
        damping=p.damping,
        rank_lr_correction_exponent=p.rank_lr_correction_exponent,
    )
    try:
        return OptimStep(settings.check())
    except ValueError as e:
        raise InvalidRequest(str(e)) from None

"""Tinker bodies (bodies.py) -> the engine's vocabulary (`engine/api.py`) and service commands: a
`forward_backward` protobuf's data as `TrainDatum`s (shapes and dtypes checked: one value per input
token), its loss config and `Forward`, an optimizer family and an optim step, a training run's spec,
a save, and a sample request. Every error is an InvalidRequest whose message names
the field.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np

from ...engine.api import (
    ADAMW,
    DIMUON,
    MAX_INPUT_ELEMENTS,
    CustomLoss,
    DimuonConfig,
    Forward,
    LoRAConfig,
    Loss,
    LossTensor,
    OptimStep,
    PromptImage,
    SampleRequest,
    TrainDatum,
    mask_image_targets,
)
from ...service import (
    InitByUri,
    InvalidRequest,
    ModelView,
    RunLabels,
    SaveByName,
    TrainingRun,
    TrainingRunSpec,
)
from ..http.context import parse_model
from ..pytrio.bodies import ModelInputBody, SamplingParamsBody
from ..pytrio.to_api import optim_step as adam_optim_step
from ..pytrio.to_api import read_input, sampling_options
from .bodies import (
    AsampleBody,
    CreateModelBody,
    DimuonBody,
    LoadBody,
    LoraBody,
    OptimStepBody,
    SaveBody,
    SaveExternalBody,
)
from .sample_extras import TargetLayout, parse_extras

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


def _pieces(chunks, where: str) -> list[list[int] | PromptImage]:
    """A proto model input's chunks as `read_input` takes them: token ids and images."""
    out: list[list[int] | PromptImage] = []
    for k, c in enumerate(chunks):
        kind, at = c.WhichOneof("chunk"), f"{where}.model_input[{k}]"
        if kind == "encoded_text":
            raw = c.encoded_text.tokens
            if len(raw) % 4:
                raise InvalidRequest(f"{at}.tokens: not int32 values")
            out.append(np.frombuffer(raw, dtype=np.int32).tolist())
        elif kind == "image":
            im = c.image
            if im.HasField("override_dimensions"):
                raise InvalidRequest(
                    f"{at}.override_dimensions: not supported; trine sizes an image from its pixels",
                    code="not_supported",
                )
            out.append(
                PromptImage(
                    im.data, im.format, im.expected_tokens if im.HasField("expected_tokens") else None, at
                )
            )
        else:
            raise InvalidRequest(
                f"{at}: {kind or 'empty'} chunks are not supported; send encoded_text and image chunks",
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


def forward_backward_body(
    msg, custom: dict[str, int] | None = None, model: ModelView | None = None
) -> ForwardBackwardBody:
    """The request's content as plain values; validates shapes (one value per input token) and dtypes,
    and reads its images for the run's `model` (blocking: call it off the event loop).

    `custom`: the inputs (name -> rank) of the custom loss the request names. Those inputs keep
    their own shapes; the others, apart from target_tokens, are the client's and are not read."""
    if not msg.data:
        raise InvalidRequest("data: the batch is empty; send at least one Datum")
    data, spans = [], []
    for i, d in enumerate(msg.data):
        where = f"data[{i}]"
        tokens, images = read_input(_pieces(d.model_input, where), f"{where}.model_input", model)
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
                target_tokens=mask_image_targets([int(x) for x in targets.astype(np.int64)], images),
                weights=floats.get("weights"),
                logprobs=floats.get("logprobs"),
                advantages=floats.get("advantages"),
                sequence_ratio_mask=floats.get("sequence_ratio_mask"),
                custom_inputs=custom_inputs if custom is not None else None,
                images=images or None,
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


# ---------------------------------------------------------------------------- runs, losses, saves
def create_model_spec(b: CreateModelBody) -> TrainingRunSpec:
    """create_model's training run: its LoRA (LoraBody's defaults when none is sent), labels from
    `user_metadata` and optimizer family."""
    optimizer = optimizer_family(b.optimizer_config)
    lora = b.lora_config or LoraBody()
    return TrainingRunSpec(
        b.base_model,
        LoRAConfig.named_by(lora),
        labels=RunLabels(user_metadata=b.user_metadata or {}),
        optimizer=optimizer,
    )


def load_weights_spec(b: LoadBody, uri: str) -> TrainingRunSpec:
    """load_weights' create-from-state run: its LoRA and base model come from the checkpoint `uri`."""
    return TrainingRunSpec(
        b.base_model or "",
        LoRAConfig(rank=1),
        uri,
        b.optimizer,
        optimizer=optimizer_family(b.optimizer_config),
    )


def init_run(run: TrainingRun) -> InitByUri:
    """create_model's init: the run's own LoRA on its base model."""
    return InitByUri(lora=LoRAConfig.named_by(run), base_model=run.base_model)


def load_weights_init(run: TrainingRun, uri: str, b: LoadBody) -> InitByUri:
    """load_weights' init: the run's LoRA with the weights (and, if asked, optimizer) of `uri`."""
    return InitByUri(lora=LoRAConfig.named_by(run), checkpoint_uri=uri, load_optimizer=b.optimizer)


def forward(body: ForwardBackwardBody, data: list[TrainDatum], custom: CustomLoss | None) -> Forward:
    """The forward(_backward) op of a decoded body: its loss summed per token (Tinker's contract: no
    normalisation); `custom` is the stored custom loss the body names."""
    try:
        loss = Loss.of_custom(custom) if custom else Loss.parse(body.loss_fn, body.loss_config)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    return Forward(data=data, loss=loss, backward=not body.forward_only)  # plain sums


def save(b: SaveBody, seq: int, sampler: bool) -> SaveByName | InvalidRequest:
    """save_weights (a training state) or save_weights_for_sampler: named and persistent, or (no
    path) a temporary snapshot for a sampling session; the InvalidRequest that refuses the call
    (queued in its place)."""
    inflight = b.kind == "inflight"  # the run's inflight samplers follow this save
    if not sampler:
        return SaveByName(
            kind="state", name=b.path or f"state-{seq}", ttl_seconds=b.ttl_seconds, overwrite=b.overwrite
        )
    if b.kind not in ("snapshot", "inflight"):
        return InvalidRequest(f"kind {b.kind!r}: use 'snapshot' or 'inflight'")
    if b.path:
        return SaveByName(
            kind="weights", name=b.path, ttl_seconds=b.ttl_seconds, overwrite=b.overwrite, inflight=inflight
        )
    if b.sampling_session_seq_id is None:
        return InvalidRequest("save_weights_for_sampler: send a path (a name) or sampling_session_seq_id")
    return SaveByName(
        kind="weights",
        name=f"sampler-{seq}",
        visibility="TEMPORARY",
        ttl_seconds=b.ttl_seconds,
        overwrite=True,
        inflight=inflight,
    )


def save_external(b: SaveExternalBody) -> SaveByName | InvalidRequest:
    """save_weights_external: the merged model under the name `path`; the InvalidRequest that
    refuses the call (queued in its place)."""
    if b.age_encryption_recipients:
        return InvalidRequest(
            "age_encryption_recipients: trine does not encrypt exported files; omit it (the files "
            "are served to this key only, through signed URLs)",
            code="not_supported",
        )
    if not b.path:
        return InvalidRequest("path: name the external weights (save_weights_external(name))")
    return SaveByName(kind="external", name=b.path, ttl_seconds=b.ttl_seconds)


# ---------------------------------------------------------------------------- samples
def sample_request(
    b: dict, body: AsampleBody, seq: int, model: ModelView | None = None
) -> tuple[SampleRequest, TargetLayout | None, str]:
    """asample's sample request (`b` as sent, `body` its typed top-level fields; its images read for
    `model`, blocking), the layout of the target ids it scores (sample_extras.py), and the body's
    fingerprint (a retry must repeat it). Tinker's `stop`: token ids or strings; [] disables every
    stop, EOS included."""
    p = dict(b.get("sampling_params") or {})
    stop = p.pop("stop", None)
    no_stop = isinstance(stop, list) and not stop
    if isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
        p["stop_token_ids"] = stop
    elif stop:
        p["stop"] = stop
    prompt, images = read_input(
        parse_model(ModelInputBody, b.get("prompt"), "prompt").pieces("prompt"), "prompt", model
    )
    params = parse_model(SamplingParamsBody, p, "sampling_params")
    with_prompt_logprobs = bool(b.get("prompt_logprobs")) or bool(b.get("topk_prompt_logprobs"))
    fields, targets = parse_extras(b, len(prompt), bool(b.get("prompt_logprobs")))
    top_logprobs = fields.pop("top_logprobs")
    options = sampling_options(
        params,
        stop_at_eos=not no_stop,  # Tinker: [] disables every stop, EOS included
        top_logprobs=top_logprobs,
    )
    req = SampleRequest(
        request_id=f"tk-{seq}",
        prompt=prompt,
        options=options,
        num_samples=body.num_samples,
        prompt_logprobs=with_prompt_logprobs,
        topk_prompt_logprobs=body.topk_prompt_logprobs or 0,
        images=images,
        **fields,
    )
    fingerprint = hashlib.sha256(json.dumps(b, sort_keys=True).encode()).hexdigest()
    return req, targets, fingerprint

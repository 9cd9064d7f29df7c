"""PyTRIO bodies (bodies.py) -> the engine's vocabulary (`engine/api.py`) and service commands: a
sample request, an event's op or command, an optim step (which Tinker's front end shares), a run's
spec and labels. The only place PyTRIO's wire names become trine's.

Every error becomes an InvalidRequest whose message names the field (`sampling_params.top_k: ...`,
`payload.data.0.target_ids: ...`).
"""

from __future__ import annotations

import hashlib
import json

import msgpack

from ...engine.api import (
    FULL_RANK,
    AdamConfig,
    EndRun,
    Forward,
    ImageInput,
    ImagesNotServed,
    LoRAConfig,
    Loss,
    LossTensor,
    OptimStep,
    PromptImage,
    SampleRequest,
    SamplingOptions,
    TrainDatum,
    mask_image_targets,
    parse_custom_loss,
    read_model_input,
)
from ...limits import (
    END_RUN,
    EVENT_TYPES,
    FORWARD,
    FORWARD_BACKWARD,
    INIT_RUN,
    OPTIMIZE_STEP,
    SAVE_STATE,
    SAVE_WEIGHTS,
    sampling_bound_error,
)
from ...service import (
    InitByUri,
    InvalidRequest,
    ModelView,
    RunLabels,
    SamplingRunSpec,
    SaveByName,
    TrainingCommand,
    TrainingRunSpec,
)
from ...tokens import TokenCounts
from ..http.context import parse_model
from .bodies import (
    Datum,
    EndRunPayload,
    Envelope,
    ForwardPayload,
    InitRunPayload,
    OptimStepPayload,
    SampleBody,
    SamplingParamsBody,
    SamplingRunCreate,
    SavePayload,
    SessionCreate,
    TrainingRunCreate,
)
from .shapes import SampleShape


# ---------------------------------------------------------------------------- model inputs
def read_input(
    pieces: list[list[int] | PromptImage], field: str, model: ModelView | None
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A model input's tokens and images as `model` reads them (None: a text-only model): images
    decoded, checked and counted now, at acceptance (blocking: call it off the event loop). Every
    refusal an InvalidRequest naming the field; valid images the model does not serve yet, a 400
    `not_supported`. Tinker's front end shares it."""
    try:
        vision, name = (model.vision, model.name) if model is not None else (None, "this model")
        return read_model_input(pieces, vision, name, field)
    except ImagesNotServed as e:
        raise InvalidRequest(str(e), code="not_supported") from None
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


# ---------------------------------------------------------------------------- samples
def parse_sample(
    body: dict, model: ModelView | None = None, *, stop_at_eos: bool = True
) -> tuple[SampleRequest, SampleShape, str]:
    """The sample request of a sample body for `model` (its images read; the engine checks the rest
    against the model), the shape its answer takes, and the body's fingerprint (a retry must repeat
    it). Blocking when it holds images: call it off the event loop."""
    b = parse_model(SampleBody, body)
    options = sampling_options(b.sampling_params, stop_at_eos=stop_at_eos)
    compute_logprobs = b.return_prompt_logprobs and not b.return_token_logprobs
    prompt, images = read_input(b.prompt.pieces("prompt"), "prompt", model)
    req = SampleRequest(
        request_id=b.request_id,
        prompt=prompt,
        images=images,
        options=options,
        num_samples=b.num_samples,
        prompt_logprobs=b.return_prompt_logprobs,
        topk_prompt_logprobs=b.topk_prompt_logprobs,
        generate=not compute_logprobs,
    )
    fingerprint = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return req, SampleShape(b.return_text, b.return_token_logprobs), fingerprint


def sampling_options(
    p: SamplingParamsBody, *, stop_at_eos: bool = True, top_logprobs: int = 0
) -> SamplingOptions:
    """The engine's sampling options of a `sampling_params` body (Tinker's, or PyTRIO's with trine's
    extensions)."""
    if (error := sampling_bound_error("top_k", p.top_k)) is not None:
        raise InvalidRequest(f"sampling_params.top_k {error}")
    stop = tuple([p.stop] if isinstance(p.stop, str) else p.stop or ())
    if any(not isinstance(s, str) or not s for s in stop):  # named as sent (the engine's stop_strings)
        raise InvalidRequest("sampling_params.stop: stop strings must be non-empty strings")
    return SamplingOptions(
        max_tokens=p.max_tokens,
        temperature=float(p.temperature),
        top_p=float(p.top_p),
        top_k=p.top_k,
        seed=p.seed,
        stop_strings=stop,
        stop_token_ids=tuple(p.stop_token_ids or ()),
        stop_at_eos=stop_at_eos,
        top_logprobs=top_logprobs,
        presence_penalty=float(getattr(p, "presence_penalty", 0.0)),
        frequency_penalty=float(getattr(p, "frequency_penalty", 0.0)),
        repetition_penalty=float(getattr(p, "repetition_penalty", 1.0)),
        min_p=float(getattr(p, "min_p", 0.0)),
        logit_bias=tuple(sorted((getattr(p, "logit_bias", None) or {}).items())),
    )


def optim_step(body: dict, prefix: str = "") -> OptimStep:
    """The optim step of `{"adam_params": {...}}` (trine.types.AdamParams: its fields, defaults and
    bounds)."""
    a = parse_model(OptimStepPayload, body, prefix).adam_params
    return OptimStep(
        AdamConfig(
            learning_rate=a.learning_rate,
            beta1=a.beta1,
            beta2=a.beta2,
            eps=a.eps,
            weight_decay=a.weight_decay,
            grad_clip_norm=a.grad_clip_norm,
        )
    )


# ---------------------------------------------------------------------------- events
def decode_msgpack(body: bytes) -> dict:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise InvalidRequest(
            f"body: not valid MessagePack ({type(e).__name__}); send the event as a MessagePack map",
            code="invalid_request_body",
        ) from None
    if not isinstance(obj, dict):
        raise InvalidRequest("body: the event must be a MessagePack map", code="invalid_request_body")
    return obj


def parse_event(
    body: bytes, model: ModelView | None = None
) -> tuple[Envelope, TrainingCommand | InvalidRequest, str, dict]:
    """The envelope, the command (its data's images read for the run's `model`; the refusal where
    the envelope is sound but its payload is not), the request's
    fingerprint (type, index, step and payload: what a retry must repeat; the timestamp and SDK
    fields may differ), and the notes its answer is shaped by (`auto_shift`: shapes.unshift undoes
    the shift on the answer)."""
    env = parse_model(Envelope, decode_msgpack(body))
    if env.type not in EVENT_TYPES:
        raise InvalidRequest(f"type {env.type!r} is not an event type; use one of {', '.join(EVENT_TYPES)}")
    try:
        command = parse_command(env.type, env.payload, model)
    except InvalidRequest as refusal:  # the envelope is sound: the event takes its index, and fails
        command = refusal
    packed = msgpack.packb([env.type, env.metadata.index, env.metadata.step, env.payload], use_bin_type=True)
    notes = (
        {"auto_shift": True}
        if env.type in (FORWARD, FORWARD_BACKWARD) and env.payload.get("auto_shift")
        else {}
    )
    return env, command, hashlib.sha256(packed).hexdigest(), notes


def parse_command(type_: str, payload: dict, model: ModelView | None = None) -> TrainingCommand:
    if type_ == INIT_RUN:
        p = parse_model(InitRunPayload, payload, "payload")
        lora = LoRAConfig.named_by(p.lora_config)
        return InitByUri(
            lora=lora,
            base_model=p.base_model,
            checkpoint_uri=p.checkpoint_uri or "",
            load_optimizer=p.load_optimizer,
        )
    if type_ in (FORWARD, FORWARD_BACKWARD):
        p = parse_model(ForwardPayload, payload, "payload")
        ga = p.gradient_accumulation
        totals = (
            None
            if ga is None
            else TokenCounts(ga.total_samples, ga.total_active_tokens, ga.total_advantage_tokens)
        )
        loss = _loss(p)
        return Forward(
            data=[_datum(d, i, p.auto_shift, model) for i, d in enumerate(p.data)],
            loss=loss,
            backward=type_ == FORWARD_BACKWARD,
            normalise=True,
            totals=totals,
            totals_field="payload.gradient_accumulation",
        )
    if type_ == OPTIMIZE_STEP:
        return optim_step(payload, "payload")
    if type_ in (SAVE_STATE, SAVE_WEIGHTS):
        p = parse_model(SavePayload, payload, "payload")
        if p.kind == "inflight" and type_ == SAVE_STATE:
            raise InvalidRequest(
                "payload.kind 'inflight' is for save_weights (sampler weights), not save_state"
            )
        return SaveByName(
            kind="state" if type_ == SAVE_STATE else "weights",
            name=p.name,
            visibility=p.visibility,
            ttl_seconds=p.ttl_seconds,
            overwrite=p.overwrite,
            inflight=p.kind == "inflight",
        )
    assert type_ == END_RUN
    return EndRun(parse_model(EndRunPayload, payload, "payload").reason)


def _loss(p: ForwardPayload) -> Loss:
    """The payload's loss; a custom one (type "custom", config {name, inputs, graph}: a traced graph,
    see engine/loss_graph.py) is checked node by node."""
    try:
        if p.loss.type != "custom":
            return Loss.parse(p.loss.type, dict(p.loss.config))
        if p.auto_shift:
            raise ValueError("auto_shift is not supported with a custom loss: send pre-shifted targets")
        c = p.loss.config
        if set(c) != {"name", "inputs", "graph"}:
            raise ValueError("a custom loss's config is {name, inputs, graph} (trine.custom_loss traces it)")
        return Loss.of_custom(parse_custom_loss(c["name"], c["inputs"], c["graph"]))
    except ValueError as e:
        raise InvalidRequest(
            f"payload.loss: {e}", code="invalid_custom_loss" if p.loss.type == "custom" else None
        ) from None


def _datum(d: Datum, i: int, auto_shift: bool, model: ModelView | None) -> TrainDatum:
    where = f"payload.data.{i}"
    tokens, images = read_input(d.model_input.pieces(f"{where}.model_input"), f"{where}.model_input", model)
    n = len(tokens)
    fields = {
        "target_ids": d.target_ids,
        "weights": d.weights,
        "logprobs": d.logprobs,
        "advantages": d.advantages,
        "sequence_ratio_mask": d.sequence_ratio_mask,
    }
    for name, values in fields.items():
        if values is not None and len(values) != n:
            held = f" ({sum(im.tokens for im in images)} of them its images')" if images else ""
            raise InvalidRequest(
                f"{where}.{name} has {len(values)} values; model_input has {n} tokens{held} "
                "and every per-token field needs exactly one value per token"
            )
    targets, weights, logprobs, advantages, ratio_mask = (
        d.target_ids,
        d.weights,
        d.logprobs,
        d.advantages,
        d.sequence_ratio_mask,
    )
    if auto_shift:  # wire targets are labels of their own position: score target j from j-1
        targets = list(targets[1:]) + [-100]
        weights, logprobs, advantages, ratio_mask = (
            None if v is None else list(v[1:]) + [0.0] for v in (weights, logprobs, advantages, ratio_mask)
        )
    return TrainDatum(
        tokens=tokens,
        target_tokens=mask_image_targets(targets, images),
        weights=weights,
        logprobs=logprobs,
        advantages=advantages,
        sequence_ratio_mask=ratio_mask,
        custom_inputs=None
        if d.custom_inputs is None
        else {k: LossTensor(tuple(t.shape), t.values, t.dtype) for k, t in d.custom_inputs.items()},
        images=images or None,
    )


# ---------------------------------------------------------------------------- control plane
def run_labels(body: SessionCreate | TrainingRunCreate) -> RunLabels:
    """The labels a session or training run body names (trine's own fields; PyTRIO never sends them)."""
    return RunLabels(body.name, tuple(body.tags), body.user_metadata or {})


def training_run_spec(body: TrainingRunCreate) -> TrainingRunSpec:
    """A training run's spec. lora_rank 0 is refused: PyTRIO has no full fine-tuning (its client bounds
    rank to 4..64); trine's SDK asks for it by its own `full_fine_tuning` field."""
    if body.full_fine_tuning:
        body = body.model_copy(update={"lora_rank": FULL_RANK})
    elif body.lora_rank == FULL_RANK:
        raise InvalidRequest(
            "lora_rank 0: the PyTRIO protocol trains LoRA adapters (its client bounds rank to 4..64) "
            "and has no full fine-tuning; ask for full fine-tuning with trine's SDK "
            "(create_lora_training_client(full=True)) or the Tinker API (rank=0)",
            code="not_supported",
        )
    lora = LoRAConfig.named_by(body)
    return TrainingRunSpec(
        body.base_model, lora, body.source_checkpoint_uri, body.restore_optimizer, run_labels(body)
    )


def sampling_run_spec(body: SamplingRunCreate) -> SamplingRunSpec:
    return SamplingRunSpec(body.base_model, body.source_checkpoint_uri)

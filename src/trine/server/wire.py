"""PyTRIO wire bodies -> service operations. Shapes follow `reference/pytrio-protocol.md` §4.

Unknown keys are ignored (the client never sends any); every error becomes an InvalidRequest whose
message names the field (`payload.data.0.target_ids: ...`).
"""
from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.lora import LoRAConfig
from ..engine.ops import EndRun, Forward, InitRun, Op, OptimStep, Save
from ..engine.requests import AdamConfig, SamplingOptions, TrainDatum
from ..limits import (END_RUN, EVENT_TYPES, FORWARD, FORWARD_BACKWARD, INIT_RUN, MAX_REQUEST_ID_CHARS,
                      MAX_SAMPLES_PER_REQUEST, MAX_TOPK_PROMPT_LOGPROBS, OPTIMIZE_STEP, SAVE_STATE,
                      SAVE_WEIGHTS)
from ..service import SampleSpec
from ..service.errors import InvalidRequest
from ..types import AdamParams
from .bounds import Count, FiniteFloat, Int64, Positive, Seed, TtlSeconds
from .normalisation import GradientAccumulation, denominator
from .shapes import SampleShape


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextChunk(_Model):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[Int64]


class ImageChunk(_Model):
    type: Literal["image"]
    format: str = ""


class ModelInput(_Model):
    chunks: list[Annotated[TextChunk | ImageChunk, Field(discriminator="type")]] = Field(min_length=1)

    def tokens(self, field: str) -> list[int]:
        if any(isinstance(c, ImageChunk) for c in self.chunks):
            raise InvalidRequest(f"{field}: image chunks are not supported; the served models are "
                                 "text-only")
        return [t for c in self.chunks for t in c.tokens]


class Metadata(_Model):
    index: Positive
    step: Count = 0
    run_id: str = ""


class Envelope(_Model):
    version: Int64 = 1
    event_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    type: str
    metadata: Metadata
    payload: dict[str, Any] = Field(default_factory=dict)


class Lora(_Model):
    rank: Positive
    seed: Seed | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class InitRunPayload(_Model):
    base_model: str = ""
    lora_config: Lora
    checkpoint_uri: str | None = None
    load_optimizer: bool = False


class Datum(_Model):
    model_input: ModelInput
    target_ids: list[Int64] = Field(min_length=1)
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    sequence_ratio_mask: list[float] | None = None  # gspo (trine extension; pytrio never sends it)


class LossSpec(_Model):
    type: str
    config: dict[str, Any] = Field(default_factory=dict)


class ForwardPayload(_Model):
    data: list[Datum] = Field(min_length=1)
    auto_shift: bool = False
    loss: LossSpec
    gradient_accumulation: GradientAccumulation | None = None


class OptimPayload(_Model):
    adam_params: AdamParams


class SavePayload(_Model):
    name: str
    ttl_seconds: TtlSeconds | None = None
    overwrite: bool = False
    visibility: str = "WORKSPACE"


class EndRunPayload(_Model):
    reason: str = ""


class SamplingParams(_Model):
    max_tokens: Positive
    temperature: FiniteFloat = Field(default=1.0, ge=0)
    top_k: Int64 = -1
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: Seed | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[Int64] | None = None


class SampleBody(_Model):
    request_id: str = Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    prompt: ModelInput
    sampling_params: SamplingParams
    num_samples: int = Field(default=1, ge=1, le=MAX_SAMPLES_PER_REQUEST)
    return_text: bool = True
    return_token_logprobs: bool = True
    return_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)


def validation_message(e: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in (prefix, *err["loc"]) if x != "")
        parts.append(f"{loc or 'body'}: {err['msg']}")
    return "; ".join(parts)


def _parse(cls, data, prefix: str):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise InvalidRequest(validation_message(e, prefix)) from None


# ---------------------------------------------------------------------------- events
def decode_msgpack(body: bytes) -> dict:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise InvalidRequest(f"body: not valid MessagePack ({type(e).__name__}); send the event as a "
                             "MessagePack map", code="invalid_request_body") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("body: the event must be a MessagePack map", code="invalid_request_body")
    return obj


def parse_event(body: bytes) -> tuple[Envelope, Op, str]:
    """The envelope, the operation, and the request's fingerprint (type, index, step and payload:
    what a retry must repeat; the timestamp and SDK fields may differ)."""
    env = _parse(Envelope, decode_msgpack(body), "")
    if env.type not in EVENT_TYPES:
        raise InvalidRequest(f"type {env.type!r} is not an event type; use one of "
                             f"{', '.join(EVENT_TYPES)}")
    op = parse_op(env.type, env.payload)
    packed = msgpack.packb([env.type, env.metadata.index, env.metadata.step, env.payload], use_bin_type=True)
    return env, op, hashlib.sha256(packed).hexdigest()


def parse_op(type_: str, payload: dict) -> Op:
    if type_ == INIT_RUN:
        p = _parse(InitRunPayload, payload, "payload")
        lora = LoRAConfig(rank=p.lora_config.rank, train_attn=p.lora_config.train_attn,
                          train_mlp=p.lora_config.train_mlp, train_unembed=p.lora_config.train_unembed,
                          seed=p.lora_config.seed or 0)
        return InitRun(lora, p.base_model, p.checkpoint_uri or "", p.load_optimizer)
    if type_ in (FORWARD, FORWARD_BACKWARD):
        p = _parse(ForwardPayload, payload, "payload")
        data = [_datum(d, i, p.auto_shift) for i, d in enumerate(p.data)]
        return Forward(data, p.loss.type, dict(p.loss.config), backward=type_ == FORWARD_BACKWARD,
                       auto_shift=p.auto_shift,
                       denominator=denominator(p.loss.type, p.gradient_accumulation, data))
    if type_ == OPTIMIZE_STEP:
        a = _parse(OptimPayload, payload, "payload").adam_params  # validated by trine.types.AdamParams
        return OptimStep(AdamConfig(a.learning_rate, a.beta1, a.beta2, a.eps, a.weight_decay,
                                    a.grad_clip_norm))
    if type_ in (SAVE_STATE, SAVE_WEIGHTS):
        p = _parse(SavePayload, payload, "payload")
        return Save("state" if type_ == SAVE_STATE else "weights", p.name, p.visibility, p.ttl_seconds,
                    p.overwrite)
    assert type_ == END_RUN
    return EndRun(_parse(EndRunPayload, payload, "payload").reason)


def _datum(d: Datum, i: int, auto_shift: bool) -> TrainDatum:
    where = f"payload.data.{i}"
    tokens = d.model_input.tokens(f"{where}.model_input")
    n = len(tokens)
    fields = {"target_ids": d.target_ids, "weights": d.weights, "logprobs": d.logprobs,
              "advantages": d.advantages, "sequence_ratio_mask": d.sequence_ratio_mask}
    for name, values in fields.items():
        if values is not None and len(values) != n:
            raise InvalidRequest(f"{where}.{name} has {len(values)} values; model_input has {n} tokens "
                                 "and every per-token field needs exactly one value per token")
    targets, weights, logprobs, advantages, ratio_mask = (d.target_ids, d.weights, d.logprobs,
                                                          d.advantages, d.sequence_ratio_mask)
    if auto_shift:  # wire targets are labels of their own position: score target j from j-1
        targets = list(targets[1:]) + [-100]
        weights, logprobs, advantages, ratio_mask = (
            None if v is None else list(v[1:]) + [0.0]
            for v in (weights, logprobs, advantages, ratio_mask))
    return TrainDatum(tokens, list(targets), weights, logprobs, advantages, ratio_mask)


# ---------------------------------------------------------------------------- sampling
def parse_sample(body: dict) -> tuple[SampleSpec, SampleShape]:
    b = _parse(SampleBody, body, "")
    p = b.sampling_params
    if p.top_k != -1 and p.top_k < 1:
        raise InvalidRequest(f"sampling_params.top_k {p.top_k}: use -1 (off) or a positive integer")
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    if any(s == "" for s in stop):
        raise InvalidRequest("sampling_params.stop: stop strings must be non-empty")
    opts = SamplingOptions(max_tokens=p.max_tokens, temperature=float(p.temperature),
                           top_p=float(p.top_p), top_k=p.top_k, seed=p.seed, stop_strings=tuple(stop),
                           stop_token_ids=tuple(p.stop_token_ids or ()))
    try:
        opts.check_stops()
    except ValueError as e:
        raise InvalidRequest(f"sampling_params.{e}") from None
    compute_logprobs = b.return_prompt_logprobs and not b.return_token_logprobs
    spec = SampleSpec(b.request_id, b.prompt.tokens("prompt"), opts, b.num_samples,
                      b.return_prompt_logprobs, b.topk_prompt_logprobs, not compute_logprobs,
                      fingerprint=hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest())
    return spec, SampleShape(b.return_text, b.return_token_logprobs)

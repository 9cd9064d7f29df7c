"""PyTRIO actor-plane event bodies (MessagePack) -> engine ops and service commands. Shapes follow the
official
`pytrio` 0.2.9 client (docs/architecture.md, "Front ends"); sample bodies are in params.py.

Unknown keys are ignored (the client never sends any); every error becomes an InvalidRequest whose
message names the field (`payload.data.0.target_ids: ...`).
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgpack
from pydantic import Field

from ..engine.api import EndRun, Forward, LoRAConfig, Loss, LossTensor, TrainDatum, parse_custom_loss
from ..limits import (
    END_RUN,
    EVENT_TYPES,
    FORWARD,
    FORWARD_BACKWARD,
    INIT_RUN,
    OPTIMIZE_STEP,
    SAVE_STATE,
    SAVE_WEIGHTS,
)
from ..service import InitByUri, InvalidRequest, SaveByName, TrainingCommand
from ..tokens import TokenCounts
from .bounds import Count, Int64, Positive, Seed, TtlSeconds
from .context import parse_model
from .params import Body, ModelInputBody, optim_step


class Metadata(Body):
    index: Positive
    step: Count = 0
    run_id: str = ""


class Envelope(Body):
    version: Int64 = 1
    event_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    type: str
    metadata: Metadata
    payload: dict[str, Any] = Field(default_factory=dict)


class Lora(Body):
    rank: Positive
    seed: Seed | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class InitRunPayload(Body):
    base_model: str = ""
    lora_config: Lora
    checkpoint_uri: str | None = None
    load_optimizer: bool = False


class CustomInput(Body):
    """One custom loss input of a datum (trine extension): row-major values of `shape`."""

    shape: list[Count] = Field(max_length=2)
    values: list[float] | list[Int64]
    dtype: Literal["float32", "int64"] = "float32"


class Datum(Body):
    model_input: ModelInputBody
    target_ids: list[Int64] = Field(min_length=1)
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    sequence_ratio_mask: list[float] | None = None  # gspo (trine extension; pytrio never sends it)
    custom_inputs: dict[str, CustomInput] | None = None  # a custom loss's (trine extension)


class LossSpec(Body):
    type: str
    config: dict[str, Any] = Field(default_factory=dict)


class GradientAccumulation(Body):
    total_samples: Positive
    total_active_tokens: Count
    total_advantage_tokens: Count


class ForwardPayload(Body):
    data: list[Datum] = Field(min_length=1)
    auto_shift: bool = False
    loss: LossSpec
    gradient_accumulation: GradientAccumulation | None = None


class SavePayload(Body):
    name: str
    ttl_seconds: TtlSeconds | None = None
    overwrite: bool = False
    visibility: str = "WORKSPACE"
    kind: Literal["snapshot", "inflight"] = (
        "snapshot"  # trine's extension (save_weights); stock clients omit it
    )


class EndRunPayload(Body):
    reason: str = ""


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


def parse_event(body: bytes) -> tuple[Envelope, TrainingCommand, str, dict]:
    """The envelope, the command, the request's fingerprint (type, index, step and payload: what a
    retry must repeat; the timestamp and SDK fields may differ), and the notes its answer is shaped
    by (`auto_shift`: shapes.unshift undoes the shift on the answer)."""
    env = parse_model(Envelope, decode_msgpack(body))
    if env.type not in EVENT_TYPES:
        raise InvalidRequest(f"type {env.type!r} is not an event type; use one of {', '.join(EVENT_TYPES)}")
    command = parse_command(env.type, env.payload)
    packed = msgpack.packb([env.type, env.metadata.index, env.metadata.step, env.payload], use_bin_type=True)
    notes = (
        {"auto_shift": True}
        if env.type in (FORWARD, FORWARD_BACKWARD) and env.payload.get("auto_shift")
        else {}
    )
    return env, command, hashlib.sha256(packed).hexdigest(), notes


def parse_command(type_: str, payload: dict) -> TrainingCommand:
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
            data=[_datum(d, i, p.auto_shift) for i, d in enumerate(p.data)],
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


def _datum(d: Datum, i: int, auto_shift: bool) -> TrainDatum:
    where = f"payload.data.{i}"
    tokens = d.model_input.tokens(f"{where}.model_input")
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
            raise InvalidRequest(
                f"{where}.{name} has {len(values)} values; model_input has {n} tokens "
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
        target_tokens=list(targets),
        weights=weights,
        logprobs=logprobs,
        advantages=advantages,
        sequence_ratio_mask=ratio_mask,
        custom_inputs=None
        if d.custom_inputs is None
        else {k: LossTensor(tuple(t.shape), t.values, t.dtype) for k, t in d.custom_inputs.items()},
    )

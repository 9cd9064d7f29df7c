"""Tinker training calls -> service events: create_model, get_info, forward(_backward), optim_step,
save_weights, save_weights_for_sampler, load_weights.

save_weights_for_sampler with `kind="inflight"` publishes the weights as the model's inflight
target: its sampling session, and every earlier one made the same way, samples the newest such
weights from then on (service/inflight.py).

Every call of one model becomes one event of its training run with index `seq_id + 1` (the run's
init is index 1, the SDK's seq 0), and event id `tk-<run>-<seq_id>`. So the service runs a model's
calls in seq_id order exactly once, however the SDK's parallel chunks arrive, and a retried call
(same seq_id) joins the first. Losses are summed per token (no normalisation: Tinker's contract);
metric keys are `name:reduction` so the SDK can combine chunks (`loss:sum`, `clock_cycle:unique`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
from typing import Awaitable, Callable

from fastapi import APIRouter, Request
from pydantic import BaseModel

from ...engine.api import FULL_RANK
from ...limits import MAX_EVENT_BYTES
from ...service import (
    ApiKey,
    EventResult,
    InvalidRequest,
    SaveByName,
    Service,
    ServiceError,
    TrainingCommand,
)
from ...uris import to_tinker_path
from ..http.context import json_model, json_object, parse_model, read_body
from . import shapes, to_api
from .bodies import (
    PROTOBUF,
    CreateModelBody,
    LoadBody,
    ModelCall,
    OptimStepBody,
    SaveBody,
    SaveExternalBody,
    decode_forward_backward,
    decompress,
)
from .custom_losses import stored_loss
from .errors import public_message
from .futures import Failure, Reply
from .state import Model, TinkerState, caller, model_id_of, optimizer_config, to_trio_uri

router = APIRouter(prefix="/api/v1")


# ---------------------------------------------------------------------------- event plumbing
def _outcome(rec) -> EventResult:
    """A settled event's protocol-neutral result; raises Failure for a failed event."""
    res = EventResult.of(rec)
    if res.status != "succeeded":
        err = res.error or {"code": "failed", "message": "the request failed"}
        category = "server" if err.get("code") in ("internal_error", "worker_lost") else "user"
        raise Failure(f"{public_message(err.get('code'), err.get('message'))} ({err.get('code')})", category)
    return res


async def _settled(svc: Service, key: ApiKey, run_id: str, event_id: str):
    while True:
        rec = await svc.events.event(key, run_id, event_id, 30.0)
        if rec.status in ("succeeded", "failed"):
            return rec


Shape = Callable[[EventResult], Awaitable[Reply]]


class _RefusedBody(Exception):
    """A numbered call (model_id, seq_id) whose other fields its body model refused."""

    def __init__(self, call: ModelCall, refusal: InvalidRequest, raw: dict):
        super().__init__(refusal.message)
        self.call, self.refusal = call, refusal
        self.raw = json.dumps(raw, sort_keys=True, default=str).encode()  # its fingerprint's body


async def _numbered_body(request: Request, cls):
    """The body of a numbered call as `cls` (a ModelCall). Where its model_id and seq_id are sound
    but another field is refused, `_RefusedBody` carries the refusal to `numbered`."""
    raw = await json_object(request)
    try:
        return parse_model(cls, raw)
    except InvalidRequest as refusal:
        try:
            call = parse_model(ModelCall, {"model_id": raw.get("model_id"), "seq_id": raw.get("seq_id")})
        except InvalidRequest:
            raise refusal from None  # no sound (model_id, seq_id): nothing to number, a plain 400
        if call.seq_id is None:
            raise
        raise _RefusedBody(call, refusal, raw) from None


def numbered(handler):
    """A route of numbered calls: a call whose body is refused (`_numbered_body`) still takes its
    seq_id, as `_submit` lets any refused call, so the SDK's later calls do not wait for it."""

    @functools.wraps(handler)
    async def route(request: Request):
        try:
            return await handler(request)
        except _RefusedBody as r:
            svc, st, key = caller(request)
            m = st.model(key, r.call.model_id)
            reply = _json_reply({"model_id": r.call.model_id})
            return await _submit(svc, st, key, r.call.model_id, m, r.call.seq_id, r.refusal, reply, r.raw)

    return route


async def _submit(
    svc: Service,
    st: TinkerState,
    key: ApiKey,
    model_id: str,
    m: Model,
    seq_id: int,
    command: TrainingCommand | ServiceError,
    shape: Shape,
    body: BaseModel | bytes,
) -> dict:
    """Queue `command` as the model's call `seq_id`; `body` is the request as sent (its fingerprint:
    a retry of the call must repeat it, another body under the same seq_id is a 409). A refused
    call (`command` already an InvalidRequest, or refused by the service) still takes its index,
    as a placeholder that fails with the message: the SDK has numbered the call, and its later
    calls must not wait for it."""
    event_id = f"tk-{m.run_id}-{seq_id}"
    await svc.events.submit_or_refuse(
        key,
        m.run_id,
        event_id=event_id,
        index=seq_id + 1,
        step=0,
        command=command,
        fingerprint=_fingerprint(body),
    )

    async def finish() -> Reply:
        return await shape(_outcome(await _settled(svc, key, m.run_id, event_id)))

    st.futures.start(key.id, event_id, finish)
    return {"request_id": event_id, "model_id": model_id}


def _fingerprint(body: BaseModel | bytes) -> str:
    raw = body if isinstance(body, bytes) else f"{type(body).__name__}:{body.model_dump_json()}".encode()
    return hashlib.sha256(raw).hexdigest()


def _command_or_refusal(build: Callable[[], TrainingCommand]) -> TrainingCommand | InvalidRequest:
    """The command, or the error that refuses it (queued in its place by `_submit`)."""
    try:
        return build()
    except InvalidRequest as e:
        return e


def _json_reply(obj) -> Shape:
    async def shape(res):
        return Reply.json(obj)

    return shape


# ---------------------------------------------------------------------------- models
async def _create(
    svc: Service,
    st: TinkerState,
    key: ApiKey,
    session_id: str,
    model_seq_id: int,
    make_run,
    init_of,
    reply: dict,
    body: BaseModel,
) -> dict:
    """Create the training run behind model `<session>:train:<seq>` once (a retry joins), and queue
    its init as event index 1."""
    model_id = model_id_of(session_id, model_seq_id)
    if model_id not in st.models:  # no await in between: a concurrent retry finds the model made
        st.models[model_id] = Model(make_run().id, key.id, session_id)
    m = st.model(key, model_id)
    run = svc.ownership.training_run(key, m.run_id)
    return await _submit(
        svc, st, key, model_id, m, 0, init_of(run), _json_reply({**reply, "model_id": model_id}), body
    )


@router.post("/create_model")
async def create_model(request: Request):
    svc, st, key = caller(request)
    b = await json_model(request, CreateModelBody)
    spec = to_api.create_model_spec(b)
    return await _create(
        svc,
        st,
        key,
        b.session_id,
        b.model_seq_id,
        lambda: svc.runs.create_training_run(key, b.session_id, spec),
        to_api.init_run,
        {"type": "create_model"},
        b,
    )


@router.post("/load_weights")
@numbered
async def load_weights(request: Request):
    svc, st, key = caller(request)
    b = await _numbered_body(request, LoadBody)
    reply = {"type": "load_weights", "path": b.path}
    if b.session_id is not None:  # create-from-state: the model's seq 0, no create_model first
        uri = to_trio_uri(b.path)
        if b.model_seq_id is None:
            raise InvalidRequest("model_seq_id: required with session_id (create-from-state)")
        return await _create(
            svc,
            st,
            key,
            b.session_id,
            b.model_seq_id,
            lambda: svc.runs.create_training_run(key, b.session_id, to_api.load_weights_spec(b, uri)),
            lambda run: to_api.load_weights_init(run, uri, b),
            reply,
            b,
        )
    if b.model_id is None or b.seq_id is None:
        raise InvalidRequest("load_weights: send model_id and seq_id, or session_id and model_seq_id")
    m = st.model(key, b.model_id)
    run = svc.ownership.training_run(key, m.run_id)
    command = _command_or_refusal(lambda: to_api.load_weights_init(run, to_trio_uri(b.path), b))
    return await _submit(
        svc, st, key, b.model_id, m, b.seq_id, command, _json_reply({**reply, "model_id": b.model_id}), b
    )


@router.post("/get_info")
async def get_info(request: Request):
    svc, st, key = caller(request)
    b = await json_model(request, ModelCall)
    run = svc.ownership.training_run(key, st.model(key, b.model_id).run_id)
    served = svc.queries.model(run.base_model)
    return {
        "type": "get_info",
        "model_id": b.model_id,
        "model_name": run.base_model,
        "is_lora": run.lora_rank != FULL_RANK,  # rank 0: full fine-tuning
        "lora_rank": run.lora_rank,
        "optimizer_config": optimizer_config(run.optimizer_family),
        # the directory, not the name: samplers made from this client take model_data.model_name
        # as their base model and load their tokenizer from it (offline)
        "model_data": {
            "arch": served.architecture,
            "model_name": served.model_id,
            "tokenizer_id": served.model_id,
        },
    }


# ---------------------------------------------------------------------------- training
def _with_recorded_logprobs(st: TinkerState, key: ApiKey, body: to_api.ForwardBackwardBody) -> list:
    """stable_reinforce: the data, with the behaviour logprobs of sampled positions taken from the
    server's records."""
    data = []
    for i, (d, spans) in enumerate(zip(body.data, body.spans)):
        pos = 0
        q = list(d.logprobs) if d.logprobs is not None else [0.0] * len(d.tokens)
        for k, s in enumerate(spans):
            if s.sampled and s.length:
                try:
                    q[pos : pos + s.length] = st.stability.sampled_logprobs(
                        key.id,
                        s.sequence_id,
                        s.offset,
                        s.length,
                        d.target_tokens[pos : pos + s.length],
                        f"data[{i}].loss_fn_input_spans[{k}]",
                    )
                except ValueError as e:
                    raise InvalidRequest(str(e), code="stability_info_missing") from None
            pos += s.length
        data.append(dataclasses.replace(d, logprobs=q))
    return data


@router.post("/forward_backward")
async def forward_backward(request: Request):
    svc, st, key = caller(request)
    raw = decompress(await read_body(request, MAX_EVENT_BYTES), request.headers.get("content-encoding"))
    msg = await asyncio.get_running_loop().run_in_executor(None, decode_forward_backward, raw)
    m = st.model(key, msg.model_id)
    if msg.seq_id < 1:
        raise InvalidRequest(f"seq_id {msg.seq_id}: training calls start at 1")
    try:
        custom = stored_loss(st, key, m, to_api.loss_config(msg)) if msg.loss_fn.lower() == "custom" else None
        model = svc.queries.find_model(svc.ownership.training_run(key, m.run_id).base_model)
        body = await asyncio.get_running_loop().run_in_executor(
            None, to_api.forward_backward_body, msg, custom and dict(custom.inputs[1:]), model
        )
        data = (
            _with_recorded_logprobs(st, key, body)
            if body.loss_fn.lower() == "stable_reinforce"
            else body.data
        )
        command = to_api.forward(body, data, custom)
    except InvalidRequest as e:
        command = e

    async def shape(res):
        metrics = {"loss:sum": float(res.metrics.get("loss_sum", 0.0))}
        metrics.update((k, float(v)) for k, v in res.metrics.items() if k.startswith("custom/"))
        if res.cycle is not None:
            metrics["clock_cycle:unique"] = float(res.cycle)
        return Reply(shapes.forward_backward_output(res.logprobs or [], metrics), PROTOBUF)

    return await _submit(
        svc, st, key, msg.model_id, m, msg.seq_id, command, shape, msg.SerializeToString(deterministic=True)
    )


def _seq(b: ModelCall) -> int:
    if b.seq_id is None:
        raise InvalidRequest("seq_id: required (the SDK numbers a model's calls from 1)")
    return b.seq_id


@router.post("/optim_step")
@numbered
async def optim_step(request: Request):
    svc, st, key = caller(request)
    b = await _numbered_body(request, OptimStepBody)
    m = st.model(key, b.model_id)

    command = _command_or_refusal(lambda: to_api.optim_step(b))

    async def shape(res):
        return Reply.json({"type": "optim_step", "metrics": res.metrics})

    return await _submit(svc, st, key, b.model_id, m, _seq(b), command, shape, b)


def _path_reply(type_: str) -> Shape:
    async def shape(res):
        return Reply.json({"type": type_, "path": to_tinker_path(res.checkpoint["uri"])})

    return shape


async def _save(request: Request, sampler: bool) -> dict:
    """save_weights (a training state) or save_weights_for_sampler: named and persistent, or (no
    path) an in-memory snapshot plus a sampling session on it."""
    svc, st, key = caller(request)
    b = await _numbered_body(request, SaveBody)
    m = st.model(key, b.model_id)
    seq = _seq(b)
    type_ = "save_weights_for_sampler" if sampler else "save_weights"
    shape = _path_reply(type_)
    command = to_api.save(b, seq, sampler)
    if sampler and not b.path and isinstance(command, SaveByName):  # a snapshot and its sampling session
        sampler_seq = b.sampling_session_seq_id

        async def shape(res):
            from .routes_sampling import sampling_session

            sid = sampling_session(svc, st, key, m.session_id, sampler_seq, "", res.checkpoint["uri"])
            return Reply.json({"type": type_, "sampling_session_id": sid})

    return await _submit(svc, st, key, b.model_id, m, seq, command, shape, b)


@router.post("/save_weights")
@numbered
async def save_weights(request: Request):
    return await _save(request, sampler=False)


@router.post("/save_weights_for_sampler")
@numbered
async def save_weights_for_sampler(request: Request):
    return await _save(request, sampler=True)


@router.post("/save_weights_external")
@numbered
async def save_weights_external(request: Request):
    """The model as a Hugging Face directory (safetensors, config, tokenizer, chat template): a LoRA
    run's adapter merged into the base weights by the code `trine export --merged` runs, a full
    run's own weights. It is checkpoint `tinker://<run>/external_weights/<name>`, whose files
    `external_weights_urls` signs (routes_checkpoints.py)."""
    svc, st, key = caller(request)
    b = await _numbered_body(request, SaveExternalBody)
    m = st.model(key, b.model_id)

    async def shape(res):
        path = to_tinker_path(res.checkpoint["uri"])
        size = res.checkpoint["size_bytes"]
        return Reply.json({"type": "save_weights_external", "path": path, "size_bytes": size})

    return await _submit(svc, st, key, b.model_id, m, _seq(b), to_api.save_external(b), shape, b)

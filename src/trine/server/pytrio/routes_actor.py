"""The actor plane (`/actor/v1/...`, bearer JWT): training events (MessagePack), their long-poll,
heartbeats, and sampling (JSON). Shapes follow the official `pytrio` 0.2.9 client
(docs/architecture.md, "Front ends").
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from ...diskspace import DiskFull
from ...limits import MAX_EVENT_BYTES, MAX_SAMPLE_BYTES
from ...service import ApiKey, EventRecord, EventResult, NotFound, Service, ServiceError
from ..http.access_log import note_key
from ..http.auth import bearer
from ..http.connections import ABORT_RESPONSE
from ..http.context import json_object, read_body, service_of, signer_of
from ..http.refusals import public_message
from .shapes import event_envelope, sample_response
from .to_api import parse_event, parse_sample

log = logging.getLogger("trine.server")
MAX_POLL_SECONDS = 55.0
KEEPALIVE_AFTER = 20.0  # a sample still running after this streams whitespace until it is done
KEEPALIVE_EVERY = 20.0
HEARTBEAT_MS = 60_000
MSGPACK = "application/msgpack"

router = APIRouter(prefix="/actor/v1")


def _caller(request: Request, kind: str) -> tuple[ApiKey, str]:
    claims = signer_of(request).verify(bearer(request.headers.get("authorization")), kind)
    key = service_of(request).ownership.key(claims["key"])
    note_key(request, key.name)
    return key, claims["sub"]


def _wait_seconds(prefer: str | None) -> float:
    m = re.search(r"wait\s*=\s*(\d+(?:\.\d+)?)", prefer or "")
    return min(float(m.group(1)) * 0.9, MAX_POLL_SECONDS) if m else 0.0


def envelope(svc: Service, rec: EventRecord) -> bytes:
    def model_id(name: str) -> str:
        m = svc.queries.find_model(name)
        return m.model_id if m else name

    res = EventResult.of(rec)
    if (
        res is not None and res.error
    ):  # a failed event's message names no server path (server/http/refusals.py)
        public = public_message(svc, res.error["message"])
        res = dataclasses.replace(res, error={**res.error, "message": public})
    return event_envelope(rec, res, model_id)


@router.post("/events")
async def submit_event(request: Request):
    key, run_id = _caller(request, "training")
    body = await read_body(request, MAX_EVENT_BYTES)
    svc = service_of(request)
    model = svc.queries.find_model(svc.ownership.training_run(key, run_id).base_model)
    env, command, fingerprint, notes = await asyncio.get_running_loop().run_in_executor(
        None, parse_event, body, model
    )
    if env.metadata.run_id and env.metadata.run_id != run_id:
        raise NotFound(
            f"training run {env.metadata.run_id} not found (this token is for {run_id})",
            code="training_run_not_found",
        )
    rec = await svc.events.submit_or_refuse(  # a refused event fails alone: the client's later ones go on
        key,
        run_id,
        event_id=env.event_id,
        index=env.metadata.index,
        step=env.metadata.step,
        command=command,
        fingerprint=fingerprint,
        notes=notes,
        shown_as=env.type,
    )
    return Response(envelope(svc, rec), status_code=200 if rec.response else 202, media_type=MSGPACK)


@router.get("/events/{event_id}")
async def get_event(event_id: str, request: Request):
    key, run_id = _caller(request, "training")
    svc = service_of(request)
    rec = await svc.events.event(key, run_id, event_id, _wait_seconds(request.headers.get("prefer")))
    return Response(envelope(svc, rec), media_type=MSGPACK)


@router.post("/client/heartbeat")
async def heartbeat(request: Request):
    key, run_id = _caller(request, "training")
    service_of(request).runs.heartbeat(key, run_id)
    return {"heartbeat_ms": HEARTBEAT_MS}


@router.post("/sampling-runs/{sampling_run_id}/sample")
async def sample(sampling_run_id: str, request: Request):
    key, run_id = _caller(request, "sampling")
    if run_id != sampling_run_id:
        raise NotFound(f"sampling run {sampling_run_id} not found", code="sampling_run_not_found")
    body = await json_object(
        request, MAX_SAMPLE_BYTES, "the sample request must be a JSON object", empty_ok=False
    )
    svc = service_of(request)
    model = svc.queries.find_model(svc.ownership.sampling_run(key, sampling_run_id).base_model)
    req, shape, fingerprint = await asyncio.get_running_loop().run_in_executor(
        None, parse_sample, body, model
    )
    task = asyncio.ensure_future(svc.sampling.sample(key, sampling_run_id, req, fingerprint))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if unawaited
    await asyncio.wait({task}, timeout=KEEPALIVE_AFTER)
    if task.done():
        return Response(sample_response(task.result(), shape), media_type="application/json")

    abort = request.scope.get("extensions", {}).get(ABORT_RESPONSE)

    async def keepalive():
        """Leading whitespace keeps the client's idle watchdog fed; JSON parsers skip it.

        The 200 is sent with the first whitespace, so a sample that then fails (a shutdown's
        drain stopped it: 503 `server_shutting_down`; a full disk) cannot answer its status: the
        response is broken off instead, which every client retries with the same request_id (and
        gets the real status then, or, after a restart, the sample). Never a complete 200 body with
        no sequences, which a client would take for a success."""
        while not task.done():
            await asyncio.wait({task}, timeout=KEEPALIVE_EVERY)
            if not task.done():
                yield b" "
        try:
            yield sample_response(task.result(), shape)
        except (ServiceError, DiskFull) as e:
            log.warning("sample %s: %s after its 200 began; response broken off", req.request_id, e.code)
            if abort is None:  # not under trine's protocol class: an error body is all there is
                message = public_message(service_of(request), e.message)
                yield json.dumps({"code": e.code, "message": message, "sequences": []}).encode()
            else:
                abort()

    return StreamingResponse(keepalive(), media_type="application/json")

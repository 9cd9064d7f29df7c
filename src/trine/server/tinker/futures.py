"""Tinker futures: every mutating call answers `{request_id}` at once; `retrieve_future` long-polls.

A future is a task on the event loop that waits for the service (an event to settle, a sample to
finish) and shapes the answer. Request ids are deterministic (training: the event id built from
the run and the SDK's seq_id; sampling: the sampling session and its seq_id), so a retried submit
finds the future already running and never starts the work twice.

Answers of `retrieve_future`, as SDK 0.38 reads them:
- pending after `LONG_POLL_SECONDS`: HTTP 408 `{"type": "try_again", "queue_state": "active"}` (the
  SDK polls again at once; the same body with 200 works too but makes the SDK log a warning);
- failed: `{"error": message, "category": "user" | "server"}` (the SDK raises RequestFailedError);
- done: the result, protobuf for ForwardBackwardOutput and SampleResponse, JSON otherwise;
- unknown id (never submitted by this key, or forgotten `KEEP_SECONDS` after it finished, or lost
  in a restart): HTTP 410, on which the SDK resubmits a sample;
- a sample a shutdown stopped (`ShuttingDown`): HTTP 410 as well, so the SDK resubmits it, with
  backoff, until the restarted server runs it (a failed body would end the SDK's call for good).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...diskspace import DiskFull
from ...service.errors import Conflict, ServiceError, ShuttingDown
from ..http.refusals import public_message as without_server_paths
from .errors import public_message, tinker_paths

LONG_POLL_SECONDS = 25.0  # the SDK's read timeout is 45 s
KEEP_SECONDS = 3600.0


@dataclass
class Reply:
    body: bytes
    media_type: str = "application/json"

    @classmethod
    def json(cls, obj) -> "Reply":
        return cls(json.dumps(obj).encode())


class Failure(Exception):
    """A request that ran and failed: reported to the SDK as `{"error", "category"}`."""

    def __init__(self, message: str, category: str = "user"):
        super().__init__(message)
        self.message, self.category = message, category


@dataclass
class _Entry:
    api_key_id: str
    task: asyncio.Task
    fingerprint: str = ""
    done_at: float | None = None


@dataclass
class FutureTable:
    entries: dict[str, _Entry] = field(default_factory=dict)

    def start(
        self, api_key_id: str, request_id: str, make: Callable[[], Awaitable[Reply]], fingerprint: str = ""
    ) -> None:
        """Start `make()` as the future `request_id`, unless that future exists already: then the
        request must be the one it was started for (`fingerprint`, "" = not checked), else 409."""
        self._purge()
        known = self.entries.get(request_id)
        if known is not None:
            if known.fingerprint and fingerprint and known.fingerprint != fingerprint:
                raise Conflict("seq_id: already submitted with a different body", code="request_id_reused")
            return
        entry = _Entry(api_key_id, asyncio.get_running_loop().create_task(make()), fingerprint)

        def finished(task: asyncio.Task) -> None:
            entry.done_at = time.monotonic()
            if not task.cancelled():
                task.exception()  # retrieved: a future nobody polls must not log "never retrieved"

        entry.task.add_done_callback(finished)
        self.entries[request_id] = entry

    def get(self, api_key_id: str, request_id: str) -> asyncio.Task | None:
        entry = self.entries.get(request_id)
        return entry.task if entry is not None and entry.api_key_id == api_key_id else None

    def _purge(self) -> None:
        old = time.monotonic() - KEEP_SECONDS
        for rid in [rid for rid, e in self.entries.items() if e.done_at is not None and e.done_at < old]:
            del self.entries[rid]


def failure_body(e: BaseException, service=None) -> dict:
    """A failed future's body; no server path in its message (server/http/refusals.py)."""
    if isinstance(e, Failure):
        message, category = tinker_paths(e.message), e.category
    elif isinstance(e, ServiceError):
        message, category = public_message(e.code, e.message), "user" if e.status < 500 else "server"
    elif isinstance(e, DiskFull):
        message, category = f"{e.code}: {e.message}", "server"
    else:
        message, category = f"{type(e).__name__}: {e}", "server"
    return {"error": without_server_paths(service, message), "category": category}


def make_router(state_of, api_key) -> APIRouter:
    router = APIRouter(prefix="/api/v1")

    @router.post("/retrieve_future")
    async def retrieve_future(request: Request):
        key = api_key(request)
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
            return JSONResponse(
                {"code": "invalid_request_body", "message": 'body: send {"request_id": "..."}'},
                status_code=400,
            )
        rid = body["request_id"]
        task = state_of(request).futures.get(key.id, rid)
        if task is None:
            return JSONResponse(
                {
                    "code": "future_not_found",  # the id is not echoed: it may be another key's
                    "message": "request_id: unknown to this API key here, or expired; submit "
                    "the request again",
                },
                status_code=410,
            )
        await asyncio.wait({task}, timeout=LONG_POLL_SECONDS)
        if not task.done():  # 408 + try_again body: the SDK polls again (a 200 try_again would log a warning)
            return JSONResponse(
                {"type": "try_again", "request_id": rid, "queue_state": "active"}, status_code=408
            )
        if task.cancelled():
            return {
                "error": "the request was cancelled (cancel_future, or a server shutdown)",
                "category": "server",
            }
        if isinstance(task.exception(), ShuttingDown):
            e = task.exception()
            return JSONResponse(
                {"code": e.code, "message": public_message(e.code, e.message)}, status_code=410
            )
        if task.exception() is not None:
            return failure_body(task.exception(), request.app.state.service)
        reply: Reply = task.result()
        return Response(reply.body, media_type=reply.media_type)

    return router

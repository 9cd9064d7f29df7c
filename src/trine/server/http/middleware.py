"""ASGI middleware around the whole app: body limits on the bytes actually read, and unexpected
errors answered without dropping the connection.

Invariants
- No request body larger than its path's limit reaches a route, whether or not it declared a
  Content-Length (a chunked body is counted as it arrives): it gets 413 `request_too_large`.
- A body that sends nothing for `BODY_IDLE_SECONDS` gets 408 `request_timeout` and its connection
  closes (the header timeout, connections.py, covers only the headers).
- A body with a Content-Encoding (gzip, ...) reaches only a route that decodes it itself (Tinker's
  zstd forward_backward); elsewhere it gets 415 `unsupported_content_encoding`, not a parse error.
- An exception no handler knows becomes a 500 `internal_error` whose message names no server
  detail (no file paths); it is logged once per (route, exception type) with its traceback, and the
  keep-alive connection stays open for the client's next request. A RecursionError can only come
  from input nested too deeply to parse: it is a 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

from ...limits import BODY_IDLE_SECONDS
from .conditions import ConditionLog

log = logging.getLogger("trine.server")
conditions = ConditionLog(log)


def error_body(path: str, status: int, code: str, message: str) -> dict:
    """trine's error shape, `{"code", "message"}`; `BodyLimit.shaped` may answer in another
    (the OpenAI routes' own) for the paths it serves."""
    return {"code": code, "message": message}


async def send_error(send, body: dict, status: int, close: bool = False) -> None:
    body = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Reads the request body (up to `limit_for(path)` bytes) before the app runs, then replays it."""

    def __init__(
        self,
        app,
        limit_for: Callable[[str], int],
        shaped: Callable[..., dict] = error_body,
        decodes: Callable[[str], bool] = lambda path: False,
    ):
        self.app = app
        self.limit_for = limit_for
        self.shaped = shaped  # (path, status, code, message) -> the error body for that path
        self.decodes = decodes  # whether the route at a path reads a Content-Encoding itself

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["path"])
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if encoding not in ("", "identity") and not self.decodes(scope["path"]):
            message = f"Content-Encoding {encoding!r} is not supported here: send the body uncompressed"
            body = self.shaped(scope["path"], 415, "unsupported_content_encoding", message)
            return await send_error(send, body, 415, close=True)
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            message = f"body: {int(declared)} bytes exceeds the limit of {limit} bytes for {scope['path']}"
            body = self.shaped(scope["path"], 413, "request_too_large", message)
            return await send_error(send, body, 413, close=True)
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), BODY_IDLE_SECONDS)
            except asyncio.TimeoutError:
                message = f"body: nothing arrived for {BODY_IDLE_SECONDS:.0f} s; send the whole body at once"
                body = self.shaped(scope["path"], 408, "request_timeout", message)
                return await send_error(send, body, 408, close=True)
            if message["type"] == "http.disconnect":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                message = f"body: more than {limit} bytes (the limit for {scope['path']})"
                body = self.shaped(scope["path"], 413, "request_too_large", message)
                return await send_error(send, body, 413, close=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: disconnect notices
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class InternalErrors:
    """The innermost guard: what the app's exception handlers do not handle ends here."""

    def __init__(self, app, shaped: Callable[..., dict] = error_body):
        self.app = app
        self.shaped = shaped  # as BodyLimit's

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False
        path = scope.get("path", "")

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except RecursionError:
            if not started:
                message = "body: nested too deeply to parse; send a flatter JSON or MessagePack document"
                await send_error(send, self.shaped(path, 400, "invalid_request_body", message), 400)
        except Exception as e:
            template = getattr(scope.get("route"), "path", scope.get("path", ""))  # ids do not split it
            route = f"{scope.get('method', '')} {template}"
            conditions.report(
                f"500 {route} {type(e).__name__}",
                "unhandled error on %s",
                route,
                level=logging.ERROR,
                exc_info=e,
            )
            if not started:
                message = (
                    f"an internal error in trine ({type(e).__name__}) "
                    "answered this request; the server logged it and keeps serving"
                )
                await send_error(send, self.shaped(path, 500, "internal_error", message), 500)

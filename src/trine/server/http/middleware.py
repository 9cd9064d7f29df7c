"""ASGI middleware around the whole app: body limits on the bytes actually read, and unexpected
errors answered without dropping the connection.

Invariants
- No request body larger than its path's limit reaches a route, whether or not it declared a
  Content-Length (a chunked body is counted as it arrives): it gets 413 `request_too_large`.
- An exception no handler knows becomes a 500 `internal_error` whose message names no server
  detail (no file paths); it is logged once per (route, exception type) with its traceback, and the
  keep-alive connection stays open for the client's next request. A RecursionError can only come
  from input nested too deeply to parse: it is a 400.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from .conditions import ConditionLog

log = logging.getLogger("trine.server")
conditions = ConditionLog(log)


async def send_error(send, status: int, code: str, message: str, close: bool = False) -> None:
    body = json.dumps({"code": code, "message": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Reads the request body (up to `limit_for(path)` bytes) before the app runs, then replays it."""

    def __init__(self, app, limit_for: Callable[[str], int]):
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await send_error(
                send,
                413,
                "request_too_large",
                f"body: {int(declared)} bytes exceeds the limit of {limit} bytes for {scope['path']}",
                close=True,
            )
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await send_error(
                    send,
                    413,
                    "request_too_large",
                    f"body: more than {limit} bytes (the limit for {scope['path']})",
                    close=True,
                )
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

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except RecursionError:
            if not started:
                await send_error(
                    send,
                    400,
                    "invalid_request_body",
                    "body: nested too deeply to parse; send a flatter JSON or MessagePack document",
                )
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
                await send_error(
                    send,
                    500,
                    "internal_error",
                    f"an internal error in trine ({type(e).__name__}) "
                    "answered this request; the server logged it and keeps serving",
                )

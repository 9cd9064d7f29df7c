"""Connection limits for the HTTP server (uvicorn's h11 protocol, with guards uvicorn lacks).

uvicorn 0.54 offers `limit_concurrency` (a 503 once a request's headers are in) and
`timeout_keep_alive` (idle time between requests), but nothing bounds a connection that never
finishes its headers, and such connections count against nothing until they do. So:
- a connection that has not sent complete request headers `header_timeout` seconds after it
  opened (or after its first byte of a new request) is closed;
- at most `max_connections` connections are open, counted when accepted (`Connections`): one
  more is accepted by closing, at once, the oldest connection that never got as far as a request
  (still waiting for its first headers), else the one idle longest between keep-alive requests,
  else the new one. A closed connection stops counting when it is closed, so each new one closes
  a different one: the process's file descriptors stay bounded during a burst of connections that
  never finish their headers, and a valid client, whose headers follow its connect at once, is
  served;
- a request uvicorn cannot parse (bad syntax, `Content-Length: -1`, headers over h11's 16 KiB
  buffer) gets a JSON `{code, message}` 400 (431 for headers too large), and its connection reads
  and discards what the client is still sending for up to `DRAIN_SECONDS` before closing, so the
  client sees the answer and not a connection reset;
- each of these, and asyncio's own accept errors, is logged once per condition (`ConditionLog`).

Shutdown is bounded (`GuardedServer`, `shutdown_timeout`): on SIGTERM the server keeps listening
while the app drains (new work 503, results still readable), then closes its connections, then
stops the app; with `hard_exit` (the `trine serve` process) the process exits 0 at the deadline
whatever is still running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Awaitable, Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from .conditions import ConditionLog

log = logging.getLogger("trine.server.connections")
conditions = ConditionLog(log)
HEADER_TIMEOUT = 10.0
MAX_CONNECTIONS = 1024
KEEP_ALIVE_SECONDS = 75
DRAIN_SECONDS = 2.0
SHUTDOWN_TIMEOUT = 30.0
# scope["extensions"][ABORT_RESPONSE](): for a response whose status line has gone out (a 200
# streaming keep-alive whitespace) but whose work then failed: its status cannot change any more,
# and a complete body would read as a success, so the response is broken off instead
ABORT_RESPONSE = "trine.abort_response"
LISTEN_QUEUE = 2048  # connections the kernel holds until accepted (uvicorn's default backlog)


class Connections:
    """The open connections of one server, in the order they may be closed to make room.

    Invariant: `open` counts the connections accepted and not yet closed (by either side); every
    one of them is in `fresh` (no request yet), in `kept` (idle between requests) or in a request."""

    def __init__(self, cap: int):
        self.cap = cap
        self.open = 0
        self.fresh: dict["GuardedH11Protocol", None] = {}  # by time accepted
        self.kept: dict["GuardedH11Protocol", None] = {}  # by time its last response ended

    def victim(self, new: "GuardedH11Protocol") -> "GuardedH11Protocol":
        """Who is closed to admit `new` when over the cap."""
        for group in (self.fresh, self.kept):
            for c in group:
                if c is not new:
                    return c
        return new

    def forget(self, c: "GuardedH11Protocol") -> None:
        self.fresh.pop(c, None)
        self.kept.pop(c, None)


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = HEADER_TIMEOUT
    registry: Connections = Connections(MAX_CONNECTIONS)

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._headers_of = None  # the request cycle whose headers arrived last
        self._counted = True
        reg = self.registry
        reg.open += 1
        reg.fresh[self] = None
        super().connection_made(transport)
        if reg.open > reg.cap:
            conditions.report(
                "connection cap",
                "more than %d open connections: closing the oldest ones without a request",
                reg.cap,
            )
            victim = reg.victim(self)
            victim._close()
            if victim is self:
                return
        self._arm()

    def _close(self) -> None:
        """Close now, descriptor included (asyncio would close it a loop turn later, while a
        burst keeps accepting); stop counting at once."""
        self._uncount()
        self._disarm()
        self.transport.abort()  # unregisters the socket from the selector
        sock = getattr(self.transport, "_sock", None)  # asyncio's own close of it is then a no-op
        if sock is not None:
            sock.close()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.registry.open -= 1
            self.registry.forget(self)

    @property
    def idle(self) -> bool:
        """Not inside a request: waiting for headers, or between keep-alive requests."""
        return self.cycle is None or self.cycle.response_complete

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        self._disarm()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._drain_timer is not None:
            return  # answered and closing: what the client still sends is discarded
        if self._header_timer is None and self.idle:
            self._arm()  # the first bytes of a new request: its headers must follow in time
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._headers_of:
            self._headers_of = self.cycle  # uvicorn built a request cycle: the headers are complete
            self.registry.forget(self)
            self._disarm()
            # read by the app before it runs (uvicorn starts it as a task of the next loop turn)
            self.cycle.scope.setdefault("extensions", {})[ABORT_RESPONSE] = self._aborter(self.cycle)

    def _aborter(self, cycle) -> Callable[[], None]:
        """End `cycle`'s response unfinished: what was sent is flushed, then the connection closes
        without the body's end, so every HTTP client reads a broken response (httpx:
        RemoteProtocolError, retryable) and never a complete one (see ABORT_RESPONSE)."""

        def abort() -> None:
            if self.cycle is cycle and not cycle.response_complete:
                cycle.disconnected = True  # uvicorn drops what the app still sends, and logs nothing
                self._uncount()
                self.transport.close()

        return abort

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._counted and not self.transport.is_closing():
            self.registry.kept[self] = None  # idle from now: the newest of the kept ones

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, as JSON `{code, message}`; then the
        connection drains the client's input before closing (see the module docstring)."""
        if len(self.conn.trailing_data[0]) > DEFAULT_MAX_INCOMPLETE_EVENT_SIZE:
            status, code, message = (
                431,
                "request_header_fields_too_large",
                (
                    "headers: the request line and headers exceed "
                    f"{DEFAULT_MAX_INCOMPLETE_EVENT_SIZE} bytes; "
                    "send shorter headers (an API key is a few dozen characters)"
                ),
            )
        else:
            status, code, message = (
                400,
                "invalid_http_request",
                (
                    "request line or headers: not valid HTTP/1.1 (check the request line, the header syntax, "
                    "and that Content-Length is a non-negative integer)"
                ),
            )
        body = json.dumps({"code": code, "message": message}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        self._disarm()
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self._uncount()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._drain_timer = self.loop.call_later(DRAIN_SECONDS, self.transport.close)
        self.flow.resume_reading()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        conditions.report(
            "header timeout",
            "closing connections that send no complete request headers within %.0f s",
            self.header_timeout,
        )
        self._close()


def guarded_protocol(max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT) -> type:
    """The protocol class of one server: its own connection registry and limits."""
    return type(
        "GuardedH11",
        (GuardedH11Protocol,),
        {"registry": Connections(max_connections), "header_timeout": header_timeout},
    )


def uvicorn_config(
    app,
    *,
    log_level: str = "warning",
    max_connections: int = MAX_CONNECTIONS,
    header_timeout: float = HEADER_TIMEOUT,
    **kw,
) -> uvicorn.Config:
    """The server's uvicorn settings (one worker, no access log, the guarded protocol).

    uvicorn's `backlog` is also how many connections asyncio accepts in one loop turn before any of
    them reaches the protocol; it is a quarter of the cap (`accept_batch`), so a connection accepted
    in one turn has its headers read before a burst accepts enough newer ones to make it the oldest
    without a request, and the descriptors stay near the cap. `GuardedServer` then widens the
    kernel's queue of connections waiting to be accepted back to `LISTEN_QUEUE`."""
    kw.setdefault("backlog", accept_batch(max_connections))
    return uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        access_log=False,
        http=guarded_protocol(max_connections, header_timeout),
        **kw,
    )


class GuardedServer(uvicorn.Server):
    """uvicorn's server, whose listening sockets queue up to `LISTEN_QUEUE` connections in the
    kernel however few asyncio accepts per loop turn (`config.backlog`): a burst then waits in
    that queue instead of having its SYNs dropped, and so do the valid clients behind it.

    Its shutdown takes at most `shutdown_timeout` seconds: `drain(seconds)` (the app's: refuse new
    work, let accepted work finish, end what is left) gets the first 70 %, still listening;
    uvicorn's own graceful close and the app's lifespan shutdown get the rest. With `hard_exit`,
    a watchdog ends the process (exit 0) at the deadline if a thread still holds it."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        drain: Callable[[float], Awaitable[None]] | None = None,
        shutdown_timeout: float = SHUTDOWN_TIMEOUT,
        hard_exit: bool = False,
    ):
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout
        self.hard_exit = hard_exit

    async def shutdown(self, sockets=None) -> None:
        begun = time.monotonic()
        budget = self.shutdown_timeout
        if self.hard_exit:
            _exit_at(begun + budget)
        if self.drain is not None and not self.force_exit:
            log.info("shutting down: draining for up to %.0f s", 0.7 * budget)
            try:
                await asyncio.wait_for(self.drain(0.7 * budget), 0.8 * budget)
            except Exception:  # the drain is best effort: the deadline is not
                log.exception("draining failed")
        left = budget - (time.monotonic() - begun)
        self.config.timeout_graceful_shutdown = max(0.1, 0.5 * left)
        await super().shutdown(sockets)
        # uvicorn re-raises a captured SIGTERM once it has stopped, and the default action kills the
        # process (status -15): a shutdown SIGTERM asked for, finished, exits 0 instead
        self._captured_signals = [sig for sig in self._captured_signals if sig != signal.SIGTERM]

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for server in getattr(self, "servers", []):
            for listener in server.sockets:
                with socket.socket(fileno=os.dup(listener.fileno())) as s:  # the same socket, another fd
                    s.listen(max(LISTEN_QUEUE, self.config.backlog))


def _exit_at(deadline: float) -> None:
    """Exit the process (status 0) at `deadline` (time.monotonic()) unless it has ended by then:
    a shutdown that systemd or Kubernetes would otherwise SIGKILL ends on its own terms."""

    def watchdog():
        time.sleep(max(0.0, deadline - time.monotonic()))
        log.warning("shutdown took its whole --shutdown-timeout; exiting now")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    threading.Thread(target=watchdog, name="trine-shutdown-watchdog", daemon=True).start()


def accept_batch(max_connections: int) -> int:
    """The listen backlog for a connection cap: a quarter of it, between 4 and `LISTEN_QUEUE`."""
    return max(4, min(LISTEN_QUEUE, max_connections // 4))


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Route asyncio's loop errors (e.g. `accept()` failing with EMFILE, once per attempt) through
    the condition log, so a flood writes one line, not one per occurrence."""

    def handler(loop, context):
        message = context.get("message", "asyncio error")
        exc = context.get("exception")
        conditions.report(
            f"loop {message} {type(exc).__name__ if exc else ''}",
            "%s: %s",
            message,
            exc or "",
            level=logging.ERROR,
            exc_info=exc,
        )

    loop.set_exception_handler(handler)

"""Connection limits for the HTTP server (uvicorn's h11 protocol, with two guards uvicorn lacks).

uvicorn 0.54 offers `limit_concurrency` (a 503 once a request's headers are in) and
`timeout_keep_alive` (idle time between requests), but nothing bounds a connection that never
finishes its headers, and such connections count against nothing until they do. So:
- a connection that has not sent complete request headers `header_timeout` seconds after it
  opened (or after its first byte of a new request) is closed;
- beyond `max_connections` open connections, the oldest one that is not in a request (still
  waiting for headers, or idle between keep-alive requests) is closed to make room, or else the
  new one: idle clients cannot exhaust the process's file descriptors, and a valid request gets in
  even while thousands of idle connections arrive;
- each of these, and asyncio's own accept errors, is logged once per condition (`ConditionLog`).
"""
from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .conditions import ConditionLog

log = logging.getLogger("trine.server.connections")
conditions = ConditionLog(log)
HEADER_TIMEOUT = 10.0
MAX_CONNECTIONS = 1024
KEEP_ALIVE_SECONDS = 75


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = HEADER_TIMEOUT
    max_connections: int = MAX_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        self._headers_of = None  # the request cycle whose headers arrived last
        self._opened = self.loop.time()
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            conditions.report("connection cap", "more than %d open connections: closing the oldest idle "
                              "ones", self.max_connections)
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                    and c.idle]
            victim = min(idle, key=lambda c: c._opened) if idle else self
            victim.transport.abort()
            if victim is self:
                return
        self._arm()

    @property
    def idle(self) -> bool:
        """Not inside a request: waiting for headers, or between keep-alive requests."""
        return self.cycle is None or self.cycle.response_complete

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.idle:
            self._arm()  # the first bytes of a new request: its headers must follow in time
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._headers_of:
            self._headers_of = self.cycle  # uvicorn built a request cycle: the headers are complete
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        conditions.report("header timeout", "closing connections that send no complete request "
                          "headers within %.0f s", self.header_timeout)
        self.transport.abort()


def guarded_protocol(max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT) -> type:
    return type("GuardedH11", (GuardedH11Protocol,), {"max_connections": max_connections,
                                                        "header_timeout": header_timeout})


def uvicorn_config(app, *, log_level: str = "warning", max_connections: int = MAX_CONNECTIONS,
                   header_timeout: float = HEADER_TIMEOUT, **kw) -> uvicorn.Config:
    """The server's uvicorn settings (one worker, no access log, the guarded protocol)."""
    return uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_keep_alive=KEEP_ALIVE_SECONDS,
                          access_log=False, http=guarded_protocol(max_connections, header_timeout), **kw)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Route asyncio's loop errors (e.g. `accept()` failing with EMFILE, once per attempt) through
    the condition log, so a flood writes one line, not one per occurrence."""
    def handler(loop, context):
        message = context.get("message", "asyncio error")
        exc = context.get("exception")
        conditions.report(f"loop {message} {type(exc).__name__ if exc else ''}", "%s: %s", message,
                          exc or "", level=logging.ERROR, exc_info=exc)
    loop.set_exception_handler(handler)

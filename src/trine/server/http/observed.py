"""One ASGI middleware times every HTTP request until its response's last byte and tells its
observers `(scope, status, seconds)`: the access log (access_log.py) and the Prometheus request
metrics (prometheus.py). A request whose app raised before answering is reported as status 500;
the route template is in `scope["route"]` once routing has matched one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

Observer = Callable[[dict, int, float], None]


class Observed:
    """ASGI middleware: after each HTTP response, every observer gets (scope, status, seconds)."""

    def __init__(self, app, observers: Sequence[Observer]):
        self.app = app
        self.observers = tuple(observers)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500  # if the app raises before answering, the error handler's status is not seen here

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            seconds = time.perf_counter() - start
            for observe in self.observers:
                observe(scope, status, seconds)

"""The access log: one INFO line per HTTP request on the `trine.access` logger.

    GET /api/models 200 key=alice 3.1 ms

Fields: method, route (the path, without the query string, so no secret in a query reaches the
log), status, the API key's name (`-` when the request carried no valid key) and latency until the
response's last byte. Authentication records the key's name with `note_key` (the API-key
dependency and the actor plane's token check both do). `trine serve --quiet` turns the log off by
raising the logger's level; with no handler configured (tests, embedded servers) nothing prints.
"""

from __future__ import annotations

import logging

log = logging.getLogger("trine.access")
KEY_NAME = "trine.key_name"  # the ASGI scope entry authentication fills in


def note_key(request, name: str) -> None:
    """Record the authenticated key's name for this request's access-log line."""
    request.scope[KEY_NAME] = name


def log_request(scope: dict, status: int, seconds: float) -> None:
    """The access-log line of one answered request (an `Observed` observer)."""
    if log.isEnabledFor(logging.INFO):
        log.info(
            "%s %s %d key=%s %.1f ms",
            scope["method"],
            scope["path"],
            status,
            scope.get(KEY_NAME, "-"),
            seconds * 1e3,
        )


def configure(quiet: bool) -> None:
    """`trine serve`'s logging: access lines on stderr in uvicorn's style, or none with `quiet`."""
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.propagate = False

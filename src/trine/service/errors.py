"""Errors a user can cause, each with a stable `code`, an HTTP status and a message naming the fix.

They subclass ValueError (bad input is a ValueError throughout trine). The server turns them into
`{"code", "message"}` bodies; a failed event carries the same pair.
"""

from __future__ import annotations

# a request id (event or sample) reused with another body: the 409 Conflicts of SingleFlight checks
REUSED_CODES = ("event_id_reused", "request_id_reused")


class ServiceError(ValueError):
    status = 400
    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class InvalidRequest(ServiceError):
    status, code = 400, "validation_failed"


class Unauthorized(ServiceError):
    status, code = 401, "unauthorized"


class NotFound(ServiceError):
    status, code = 404, "not_found"


class Conflict(ServiceError):
    status, code = 409, "conflict"


class TooLarge(ServiceError):
    status, code = 413, "request_too_large"


class TooManyRequests(ServiceError):
    status, code = 429, "too_many_requests"


class ShuttingDown(ServiceError):
    """New work while the server drains for shutdown; answered with Retry-After (seconds)."""

    status, code = 503, "server_shutting_down"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after

"""Errors the SDK raises. Every one is a `TrineError`; input errors are also `ValueError`.

- ValidationError: bad input caught before anything is sent (field named in the message).
- AuthError: no API key, or the server refused it.
- ControlAPIError: a control-plane request (`/api/...`) failed with a `{code, message}` body.
- ActorAPIError: an actor-plane request (events, sampling) failed.
- EventFailedError: the server ran a training event and it failed (the run may go on).
- RunBrokenError: a training run can take no more events (a chunk of a split batch failed).
"""

from __future__ import annotations


class TrineError(Exception):
    def __init__(self, message: str, code: str = "", status_code: int = 0, details: dict | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status_code = status_code
        self.details = details or {}

    def __str__(self) -> str:
        prefix = f"[{self.code}] " if self.code else ""
        status = f" (HTTP {self.status_code})" if self.status_code else ""
        return f"{prefix}{self.message}{status}"


class ValidationError(TrineError, ValueError):
    pass


class AuthError(TrineError):
    pass


class ControlAPIError(TrineError):
    pass


class ActorAPIError(TrineError):
    pass


class EventFailedError(TrineError):
    def __init__(self, event_id: str, code: str, message: str):
        super().__init__(message, code=code)
        self.event_id = event_id


class RunBrokenError(TrineError):
    pass

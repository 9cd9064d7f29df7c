"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with the matching status.

Every failure on the OpenAI routes leaves in this shape (the rest of the server answers
`{"code", "message"}`); the `openai` client turns it into BadRequestError, NotFoundError, ...
"""

from __future__ import annotations

import re
from collections.abc import Collection

from fastapi.responses import JSONResponse

from ...diskspace import DiskFull
from ...service.errors import ServiceError
from ..http.refusals import public_message, retry_headers

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
# engine and service messages start with the field they name ("max_tokens: ...")
_FIELD = re.compile(r"^([a-z_]+)\b")


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Retry-After on a draining server's 503
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_param(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code=code)


def from_service(e: ServiceError, params: Collection[str] = (), service=None) -> OpenAIError:
    """A service error in OpenAI's shape; `param` is set when the message names one of `params`;
    a draining server's 503 keeps its Retry-After (server/http/refusals.py)."""
    m = _FIELD.match(e.message)
    param = m.group(1) if m and m.group(1) in params else None
    message = public_message(service, e.message)
    return OpenAIError(e.status, message, param=param, code=e.code, headers=retry_headers(e))


def from_disk_full(e: DiskFull, service=None) -> OpenAIError:
    """No room to write what the request needs: 507 `disk_full`, as on the other planes."""
    return OpenAIError(e.status, public_message(service, e.message), code=e.code, type="server_error")

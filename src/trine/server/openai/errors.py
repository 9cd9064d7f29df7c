"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with the matching status.

Every failure on the OpenAI routes leaves in this shape (the rest of the server answers
`{"code", "message"}`); the `openai` client turns it into BadRequestError, NotFoundError, ...
"""

from __future__ import annotations

import re
from collections.abc import Collection

from fastapi.responses import JSONResponse

from ...service.errors import ServiceError

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
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_param(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, code=code)


def from_service(e: ServiceError, params: Collection[str] = ()) -> OpenAIError:
    """A service error in OpenAI's shape; `param` is set when the message names one of `params`."""
    m = _FIELD.match(e.message)
    param = m.group(1) if m and m.group(1) in params else None
    return OpenAIError(e.status, e.message, param=param, code=e.code)

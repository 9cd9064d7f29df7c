"""How errors leave the Tinker plane: one place shapes every `{code, message}` body and every failed
future's message.

Invariants
- Messages name `tinker://<run>/<weights|sampler_weights>/<name>` paths, never trine's `trio://`
  form (the service speaks `trio://`; this is the one translation).
- A lookup of an object the key does not own (or that does not exist: the two are one answer)
  names the field and how to get a valid value, never the id that was sent: another key's ids
  are not echoed, so an error never confirms or repeats them.
- A conflict leaves as 400, because the SDK retries every 409 for minutes and trine's conflicts (a
  closed session, a checkpoint name taken) do not go away by retrying; the one exception is a
  reused `seq_id` (or sample `seq_id`) with a different body, a 409 with `x-should-retry: false`
  (the SDK never sends that itself; a client that does must not be answered the first call's result).
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from ...service import ServiceError
from ...service.errors import REUSED_CODES
from ...uris import to_tinker_path
from ..http.refusals import public_message as without_server_paths
from ..http.refusals import retry_headers

_TRIO_PATH = re.compile(r"trio://[^/\s'\"]+/(?:state|weights|external)/[^\s'\",;)]+")
_NOT_OWNED = {
    "training_run_not_found": "training_run_id not found: use a training run id (or model_id) this API "
    "key created",
    "checkpoint_not_found": "tinker_path not found: use a tinker://<run>/<weights|sampler_weights>/<name> "
    "path that a save by this API key returned",
    "service_session_not_found": "session_id not found: use a session_id that create_session returned to "
    "this API key",
    "sampling_run_not_found": "sampling_session_id not found: use a sampler this API key created "
    "(create_sampling_client or save_weights_and_get_sampling_client)",
    "event_not_found": "request not found: use a request_id this API key submitted",
}
REUSED = REUSED_CODES
_REUSED_MESSAGE = (
    "seq_id: already used by this client for a different request; a retry must resend the "
    "same body, and a new call takes the next seq_id"
)


def tinker_paths(message: str) -> str:
    """`message` with every `trio://` checkpoint path in its `tinker://` form."""
    return _TRIO_PATH.sub(lambda m: to_tinker_path(m[0]), message)


def public_message(code: str, message: str) -> str:
    """The message a Tinker client gets for an error `code` with the service's `message`."""
    if code in _NOT_OWNED:
        return _NOT_OWNED[code]
    if code in REUSED:
        return _REUSED_MESSAGE
    return tinker_paths(message)


def error_response(e: ServiceError, service=None) -> JSONResponse:
    """The answer to a refused Tinker call; a draining server's 503 says when to come back
    (Retry-After), and no message names a server path (server/http/refusals.py)."""
    body = {"code": e.code, "message": without_server_paths(service, public_message(e.code, e.message))}
    if e.code in REUSED:
        return JSONResponse(body, status_code=409, headers={"x-should-retry": "false"})
    return JSONResponse(body, status_code=400 if e.status == 409 else e.status, headers=retry_headers(e))

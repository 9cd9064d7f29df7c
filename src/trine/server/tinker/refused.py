"""Routes of the official `tinker` 0.38 client that trine does not implement: each answers 400
`not_supported` naming the feature and what to use instead (never a bare 404/405), so a client
fails with a message it can act on. `save_weights_external` is refused in `routes_training.py` (it takes a
seq_id), image/audio chunks where prompts are decoded.

Routes the client only calls when the client config turns a feature on (`auth/token`,
`retrieve_futures`, `join_sampling_session`) are refused too,
for clients that ignore the config.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...service import InvalidRequest
from .state import caller

router = APIRouter(prefix="/api/v1")

# (method, path, the feature, what to use instead)
REFUSED = (
    (
        "POST",
        "/copy_weights",
        "copy_weights (projects)",
        "trine has no projects; share a checkpoint with other API keys by publishing it "
        "(publish_checkpoint_from_tinker_path) and train from it with create_training_client_from_state",
    ),
    (
        "PUT",
        "/sessions/{session_id}/project",
        "assign_session_project (projects)",
        "trine has no projects; everything is scoped by API key",
    ),
    ("GET", "/audit", "get_audit_log", "the server's access log (logger trine.access)"),
    ("GET", "/auth/apikey/me", "the API key endpoint", "`trine keys list` on the server"),
    ("DELETE", "/auth/apikey/me", "the API key endpoint", "`trine keys revoke` on the server"),
    (
        "POST",
        "/auth/token",
        "JWT authentication",
        "send the API key as X-API-Key (the client config has pjwt_auth_enabled false)",
    ),
    (
        "POST",
        "/retrieve_futures",
        "retrieve_futures",
        "retrieve_future for each request (the client config has sample_use_retrieve_futures false)",
    ),
    (
        "POST",
        "/join_sampling_session",
        "join_sampling_session",
        "create_sampling_session (the client config has sample_join_sampling_session false)",
    ),
)


def _refusal(feature: str, instead: str):
    async def refuse(request: Request):
        caller(request)  # like every Tinker route: the key first
        raise InvalidRequest(f"{feature} is not supported by trine; use {instead}", code="not_supported")

    return refuse


for _method, _path, _feature, _instead in REFUSED:
    router.add_api_route(_path, _refusal(_feature, _instead), methods=[_method])

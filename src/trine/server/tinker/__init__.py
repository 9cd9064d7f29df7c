"""The Tinker front end (`/api/v1/...`): the official `tinker` SDK, unmodified, against trine.

Same server, port, keys (in their `tml-` form) and service as the PyTRIO planes: runs, events,
ordering, the prefix cache and metering are the service's; this package only translates. See
docs/architecture.md ("Front ends") for the protocol and docs/protocols/tinker.md for the user's view.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.routing import APIRoute

from ...service import ServiceError
from ..http.context import caller_key
from . import (
    custom_losses,
    futures,
    refused,
    routes_checkpoints,
    routes_sampling,
    routes_sessions,
    routes_training,
)
from .errors import error_response
from .state import state_of

LARGE_BODY_PATHS = ("/api/v1/forward_backward", "/api/v1/asample")  # each route checks its own limit
ENCODED_BODY_PATHS = ("/api/v1/forward_backward",)  # the route decodes its Content-Encoding (zstd)


class TinkerRoute(APIRoute):
    """Errors as `{code, message}` like the other planes, shaped for Tinker clients by `errors`."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request):
            try:
                return await handler(request)
            except ServiceError as e:
                return error_response(e, request.app.state.service)

        return route


def make_router() -> APIRouter:
    router = APIRouter(route_class=TinkerRoute)
    for r in (
        routes_sessions.router,
        routes_checkpoints.router,
        routes_training.router,
        custom_losses.router,
        routes_sampling.router,
        futures.make_router(state_of, caller_key),
        refused.router,
    ):
        for route in r.routes:
            router.add_api_route(route.path, route.endpoint, methods=list(route.methods), response_model=None)
    return router


__all__ = ["make_router", "LARGE_BODY_PATHS", "ENCODED_BODY_PATHS"]

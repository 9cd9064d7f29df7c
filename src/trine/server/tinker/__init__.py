"""The Tinker front end (`/api/v1/...`): the official `tinker` SDK, unmodified, against trine.

Same server, port, keys (in their `tml-` form) and service as the PyTRIO planes: runs, events,
ordering, the prefix cache and metering are the service's; this package only translates. See
`reference/tinker-notes.md` for the protocol and README "Tinker users" for the user's view.
"""
from __future__ import annotations

from fastapi import APIRouter

from ..control import api_key
from . import futures, rest, sampling, training
from .state import state_of

LARGE_BODY_PATHS = ("/api/v1/forward_backward", "/api/v1/asample")  # each route checks its own limit


def make_router() -> APIRouter:
    router = APIRouter()
    for r in (rest.router, training.router, sampling.router, futures.make_router(state_of, api_key)):
        router.include_router(r)
    return router


__all__ = ["make_router", "LARGE_BODY_PATHS"]

"""The usage endpoints of a trine server, as a FastAPI router the server mounts.

    GET /api/trine/v1/usage?session_id=&run_id=&since=&by=   -> Report.to_dict() (tokens, cost, diagnostics)
    GET /api/trine/v1/usage/events?session_id=&run_id=&since= -> {"events": [...], "diagnostics": [...]}
    GET /api/trine/v1/rates                                   -> {"currency", "models":
    rate_card.as_models_list()}

Invariant: a key only ever sees its own usage: every query is filtered by the api key id that
`authenticate` returns, whatever the query parameters say.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from .money import dumps
from .rates import RateCard
from .report import GROUPINGS, build_report, describe_runs
from .since import parse_since

PREFIX = "/api/trine/v1"


class MoneyJSONResponse(JSONResponse):
    """Starlette's JSONResponse, writing every `Money` amount fixed-point (the server's default)."""

    def render(self, content) -> bytes:
        return dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def make_usage_router(
    get_store: Callable[..., Any],
    authenticate: Callable[..., Any],
    rate_card: RateCard | Callable[[], RateCard] | None = None,
) -> APIRouter:
    """get_store: a FastAPI dependency returning the store (`usage_events`, `diagnostics`), e.g.
    `def get_store(request: Request): return request.app.state.service.store` (annotate `request`,
    at module level, or FastAPI reads it as a query parameter);
    authenticate: a FastAPI dependency that rejects a bad key and returns the caller's api key id
    (a str) or a record with an `.id`; rate_card: the server's card, or a callable returning it
    (default: `RateCard.load()`, i.e. shipped + $TRINE_HOME/rates.toml)."""
    router = APIRouter(prefix=PREFIX, tags=["usage"])
    card = rate_card if rate_card is not None else RateCard.load

    def current_card() -> RateCard:
        return card() if callable(card) else card

    def query(store, key, session_id, run_id, since):
        key_id = key if isinstance(key, str) else key.id
        t = parse_since(since) if since else None
        kw = dict(session_id=session_id or None, run_id=run_id or None, since=t)
        return store.usage_events(key_id, **kw), store.diagnostics(key_id, **kw)

    @router.get("/usage")
    def usage(
        session_id: str | None = None,
        run_id: str | None = None,
        since: str | None = None,
        by: str | None = None,
        store=Depends(get_store),
        key=Depends(authenticate),
    ):
        if by is not None and by not in GROUPINGS:
            return _bad(f"by: {by!r} is not a grouping; use one of {', '.join(GROUPINGS)}")
        try:
            events, diags = query(store, key, session_id, run_id, since)
        except ValueError as e:
            return _bad(str(e))
        filters = {k: v for k, v in (("session", session_id), ("run", run_id), ("since", since)) if v}
        runs = describe_runs(store, {e.run_id for e in events}) if by == "run" else None
        return build_report(events, by, current_card(), diags, filters, runs).to_dict()

    @router.get("/usage/events")
    def usage_events(
        session_id: str | None = None,
        run_id: str | None = None,
        since: str | None = None,
        store=Depends(get_store),
        key=Depends(authenticate),
    ):
        try:
            events, diags = query(store, key, session_id, run_id, since)
        except ValueError as e:
            return _bad(str(e))
        return {"events": [e.to_dict() for e in events], "diagnostics": [d.to_dict() for d in diags]}

    @router.get("/rates")
    def rates(key=Depends(authenticate)):
        c = current_card()
        return {"currency": c.currency, "models": c.as_models_list()}

    return router


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"code": "validation_failed", "message": message}, status_code=400)

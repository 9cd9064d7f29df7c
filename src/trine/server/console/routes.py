"""The console's HTTP routes: the page shell, its static assets, and a small JSON API for the pages.

    GET /console, /console/<page>...        the single page app (index.html); the browser renders
                                            every page, so an unknown or foreign URL shows its own
                                            not-found page once the API answers 404
    GET /console/static/<file>              the shipped assets (no CDN, no external font)
    GET /console/api/runs                   the key's training runs
    GET /console/api/runs/{run_id}          one run: steps (loss, grad norm, seconds, tokens, cycles),
                                            logged metrics, checkpoints
    GET /console/api/checkpoints            the key's checkpoints and samplers (each with the training
                                            run it is attributed to)
    GET /console/api/server                 models with prices; per engine replica: KV pool, cache
                                            counters, queue depths, recent clock cycles
    GET /console/api/sessions               the key's latest sessions with their runs counted (a
                                            session's timeline is /api/trine/v1/sessions/{id}/timeline)

The pages also call the API the SDK and `trine usage` use: api-key/verify (sign-in), the usage
report (`/api/trine/v1/usage`), checkpoint delete and download-url. Every JSON route takes the
key as `X-API-Key` (the SDK's header) through `context.api_key`, and reads only that key's data.
"""

from __future__ import annotations

import json
from collections import Counter
from importlib.resources import files

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from ...service import ApiKey, NotFound
from ..http.context import api_key, service_of
from .runs import checkpoint_row, list_runs, run_detail
from .server_stats import server_stats

STATIC = files("trine.server.console") / "static"
ASSETS = {
    "console.js": "text/javascript",
    "pages-runs.js": "text/javascript",
    "pages-compare.js": "text/javascript",
    "pages-checkpoints.js": "text/javascript",
    "pages-usage.js": "text/javascript",
    "pages-timeline.js": "text/javascript",
    "console.css": "text/css",
    "chart.umd.min.js": "text/javascript",
    "chart.js.LICENSE.md": "text/plain",
    "favicon.svg": "image/svg+xml",
}

router = APIRouter()
MAX_SESSIONS = 200  # the newest, on the Sessions page


# ---------------------------------------------------------------------------- JSON for the pages
api = APIRouter(prefix="/console/api")


@api.get("/runs")
async def runs(request: Request, key: ApiKey = Depends(api_key)):
    return {"runs": list_runs(service_of(request), key)}


@api.get("/runs/{run_id}")
async def run(run_id: str, request: Request, key: ApiKey = Depends(api_key)):
    return run_detail(service_of(request), key, run_id)


@api.get("/checkpoints")
async def checkpoints(request: Request, key: ApiKey = Depends(api_key)):
    svc = service_of(request)
    cks, _ = svc.queries.checkpoints(key)
    samplers = svc.queries.sampling_runs(key)
    return {
        "checkpoints": [checkpoint_row(c) for c in reversed(cks)],
        "samplers": [
            {
                "id": s.id,
                "training_run_id": s.training_run_id or None,
                "model": s.base_model,
                "state": s.status,
                "session_id": s.session_id,
                "checkpoint_id": s.checkpoint_id or None,
                "source_checkpoint_uri": s.source_checkpoint_uri or None,
                "created_at": s.created_at,
                "last_active": s.updated_at,
            }
            for s in sorted(samplers, key=lambda s: -s.created_at)
        ],
    }


@api.get("/sessions")
async def sessions(request: Request, key: ApiKey = Depends(api_key)):
    svc = service_of(request)
    _, total = svc.queries.sessions(key, 1, 0)
    rows, _ = svc.queries.sessions(key, MAX_SESSIONS, max(0, total - MAX_SESSIONS))
    trains = Counter(r.session_id for r in svc.queries.training_runs(key)[0])
    samplers = Counter(r.session_id for r in svc.queries.sampling_runs(key))
    return {
        "total": total,
        "sessions": [
            {
                "id": s.id,
                "name": s.name or None,
                "tags": json.loads(s.tags) if s.tags else [],
                "state": s.status,
                "training_runs": trains[s.id],
                "samplers": samplers[s.id],
                "created_at": s.created_at,
                "last_active": s.updated_at,
            }
            for s in reversed(rows)
        ],
    }


@api.get("/server")
async def server(request: Request, key: ApiKey = Depends(api_key)):
    return await server_stats(service_of(request), key)


router.include_router(api)


# ---------------------------------------------------------------------------- pages
@router.get("/console/static/{name}", include_in_schema=False)
def asset(name: str) -> Response:
    if name not in ASSETS:
        return Response(f"no console asset {name!r}", status_code=404, media_type="text/plain")
    return FileResponse(str(STATIC / name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.get("/console", include_in_schema=False)
@router.get("/console/{page:path}", include_in_schema=False)
def page(page: str = "") -> HTMLResponse:
    """Every console URL answers the same shell; console.js renders the page the path names."""
    if page.startswith("api/"):
        raise NotFound(f"GET /console/{page}: no such console API route", code="not_found")
    return HTMLResponse((STATIC / "index.html").read_text(), headers={"Cache-Control": "no-cache"})

"""Session traces over HTTP (service/traces.py builds them): for the SDK, the console and, through a
signed URL, the official Tinker client's `export_session_trace`.

    GET /api/trine/v1/sessions/{session_id}/trace       the trace file (Chrome trace-event JSON,
                                                        which ui.perfetto.dev opens), for the key
    GET /api/trine/v1/sessions/{session_id}/trace-url   {"url", "expires"}: a signed URL of it
    GET /api/trine/v1/sessions/{session_id}/timeline    the spans as the console's timeline draws them
                                                        (?limit=: its latest requests, 2000 by default)
    GET /api/trine/v1/session-traces/{session_id}?token=...   the trace file, without a key: the token
                                                        (signed, naming the key and the session,
                                                        expiring after TRACE_URL_SECONDS) is the
                                                        credential
    GET /api/v1/sessions/{session_id}/trace_export      (Tinker) {"status": "ready", "url", "expires"}

Invariants
- A signed URL serves only the session it was issued for, only while its key may read it (a
  revoked key's URLs stop working), and only until it expires (401 `token_expired`).
- The trace is built when it is downloaded, from what is stored then: a URL fetched later shows
  the requests that settled since. It holds the session's latest `MAX_REQUESTS` requests and
  events (its metadata counts those left out).
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from ..service import ApiKey, NotFound, Service
from ..service.traces import MAX_REQUESTS, Timeline
from .http.context import api_key, service_of, signer_of

router = APIRouter()
TRACE_URL_SECONDS = 3600.0  # the official client says its URL is "valid for about an hour"
TOKEN_KIND = "trace"
TIMELINE_REQUESTS = 2000  # the console draws a session's latest requests and events (SVG stays fast)


def signed_trace_url(request: Request, key: ApiKey, session_id: str) -> dict:
    """A URL on this server that serves the key's session trace without the key, and its expiry."""
    service_of(request).ownership.session(key, session_id)  # another key's session: 404 here
    token, exp = signer_of(request).issue(
        key_id=key.id, subject=session_id, kind=TOKEN_KIND, ttl=TRACE_URL_SECONDS
    )
    return {
        "url": f"{request.base_url}api/trine/v1/session-traces/{session_id}?token={token}",
        "expires": datetime.fromtimestamp(exp, timezone.utc).isoformat(),
    }


async def _trace_file(svc: Service, key: ApiKey, session_id: str) -> Response:
    trace = await asyncio.to_thread(svc.traces.chrome_trace, key, session_id)
    return Response(
        json.dumps(trace, separators=(",", ":")).encode(),
        media_type="application/json",
        headers={"Content-Disposition": f'attachment; filename="trace-{session_id}.json"'},
    )


@router.get("/api/trine/v1/sessions/{session_id}/trace")
async def trace(session_id: str, request: Request, key: ApiKey = Depends(api_key)):
    return await _trace_file(service_of(request), key, session_id)


@router.get("/api/trine/v1/sessions/{session_id}/trace-url")
async def trace_url(session_id: str, request: Request, key: ApiKey = Depends(api_key)):
    return signed_trace_url(request, key, session_id)


@router.get("/api/trine/v1/session-traces/{session_id}")
async def signed_trace(session_id: str, request: Request, token: str = Query("")):
    claims = signer_of(request).verify(token, TOKEN_KIND, url="trace URL")
    if claims["sub"] != session_id:
        raise NotFound(f"session {session_id} not found", code="session_not_found")
    svc = service_of(request)
    key = svc.ownership.key(claims["key"])
    return await _trace_file(svc, key, session_id)


@router.get("/api/trine/v1/sessions/{session_id}/timeline")
async def timeline(
    session_id: str,
    request: Request,
    limit: int = Query(TIMELINE_REQUESTS, ge=1, le=MAX_REQUESTS),
    key: ApiKey = Depends(api_key),
):
    tl = await asyncio.to_thread(service_of(request).traces.timeline, key, session_id, limit)
    return timeline_json(tl)


def timeline_json(tl: Timeline) -> dict:
    """The console's timeline: spans with times in seconds from the session's first one."""
    t0 = tl.start
    return {
        "session_id": tl.session_id,
        "currency": tl.currency,
        "start": t0 or None,
        "seconds": tl.end - t0,
        "requests": tl.requests,
        "left_out": tl.left_out,
        "spans": [
            {
                "lane": s.lane,
                "row": s.row,
                "model": s.model,
                "replica": s.replica,
                "name": s.name,
                "start": s.start - t0,
                "end": s.end - t0,
                "run_id": s.run_id or None,
                "request_id": s.request_id.split("~", 1)[0] or None,
                "tokens": s.tokens,
                "cost": s.cost,
                "args": s.args,
            }
            for s in tl.spans
        ],
    }

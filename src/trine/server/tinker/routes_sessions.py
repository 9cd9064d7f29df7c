"""Tinker handshake, sessions and REST routes: client config, sessions and heartbeats, capabilities,
telemetry (accepted and dropped) and billing usage (answered from trine's metering, in Tinker's
hourly-bucket shape). Training runs and checkpoints are in `routes_checkpoints.py`.

The client config turns off what a self-hosted server does not need: no JWT exchange
(`pjwt_auth_enabled`), no
retrieve_futures poller, plain httpx transport, uncompressed forward_backward bodies. It turns on
server-side custom losses (`custom_loss_server_side`, custom_losses.py).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from ...limits import INT64_MAX, MAX_PAGE_SIZE
from ...metering.money import money
from ...service import InvalidRequest, RunLabels, SessionSearch
from ...service.labels import as_metadata
from ..http.context import json_model
from ..traces import signed_trace_url
from .bodies import CreateSessionBody, FinishBody, SessionBody, SessionSearchBody, StatusQuery
from .shapes import iso
from .state import caller

router = APIRouter(prefix="/api/v1")
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "fwdbwd_max_chunk_len": 1024,
    "fwdbwd_max_chunk_bytes_count": 5_000_000,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": True,
    "sample_no_retries": False,
}
FINISH_STATUS = {"success": "ENDED", "errored": "CANCELLED", "interrupted": "CANCELLED"}


# ---------------------------------------------------------------------------- handshake
@router.post("/client/config")
async def client_config(request: Request):
    caller(request)
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def dynamic_config(request: Request):
    caller(request)
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}  # cancel_future: routes_sampling.py


@router.get("/healthz")
async def healthz(request: Request):
    caller(request)
    return {"status": "ok"}


@router.post("/telemetry")
async def telemetry(request: Request):
    """Accepted and dropped: trine keeps no client telemetry."""
    caller(request)
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request):
    svc, _, _ = caller(request)
    return {
        "supported_models": [
            {"model_name": m.name, "max_context_length": m.max_seq_len, "trainable": True, "sampleable": True}
            for m in svc.queries.models()
        ]
    }


# ---------------------------------------------------------------------------- sessions
@router.post("/create_session")
async def create_session(request: Request):
    svc, _, key = caller(request)
    b = await json_model(request, CreateSessionBody)
    s = svc.runs.create_session(key, b.sdk_version, RunLabels(b.display_name, tuple(b.tags), b.user_metadata))
    return {"type": "create_session", "session_id": s.id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request):
    svc, st, key = caller(request)
    b = await json_model(request, SessionBody)
    s = svc.ownership.session(key, b.session_id)
    if s.status != "ACTIVE":
        return JSONResponse(
            {"code": "session_finished", "message": f"session {s.id} is {s.status}"}, status_code=410
        )
    for m in st.models.values():  # keeps the session's training runs from being collected as idle
        if m.session_id == s.id and m.api_key_id == key.id:
            svc.runs.heartbeat(key, m.run_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request):
    svc, _, key = caller(request)
    b = await json_model(request, FinishBody)
    await svc.runs.close_session(key, session_id, FINISH_STATUS[b.reason.type], b.reason.type)
    return {}


@router.get("/sessions")
async def list_sessions(
    request: Request,
    limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
    offset: int = Query(0, ge=0, le=INT64_MAX),
):
    svc, _, key = caller(request)
    rows, _ = svc.queries.sessions(key, limit, offset)
    return {"sessions": [s.id for s in rows]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request):
    svc, st, key = caller(request)
    v = svc.queries.session(key, session_id)
    models = [mid for mid, m in st.models.items() if m.session_id == v.session.id and m.api_key_id == key.id]
    return {"training_run_ids": models, "sampler_ids": v.sampling_run_ids}


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(session_id: str, request: Request):
    """export_session_trace: the client polls until "ready", then GETs the signed URL without auth;
    trine builds the trace when it is downloaded, so it is always ready (server/traces.py)."""
    _, _, key = caller(request)
    return {"status": "ready", **signed_trace_url(request, key, session_id)}


# A Tinker status query -> trine (session status, finish reason) pairs; `failed` never matches (trine
# fails requests and runs, never a whole session).
_STATUS_PAIRS = {
    "active": (("ACTIVE", None),),
    "cancelled": (("CANCELLED", ""),),  # closed by the server or the console, not by its client
    "failed": (),
}


def _status_pairs(q: StatusQuery) -> tuple:
    if q.type != "client_finished":
        return _STATUS_PAIRS[q.type]
    return tuple((FINISH_STATUS[r], r) for r in (q.reasons or list(FINISH_STATUS)))


def _status_json(s) -> dict | None:
    if s.status == "ACTIVE":
        return {"type": "active"}
    if s.finish_reason in FINISH_STATUS:
        return {"type": "client_finished", "reason": {"type": s.finish_reason}}
    if s.status == "ENDED":
        return {"type": "client_finished", "reason": {"type": "success"}}
    return {"type": "cancelled", "detail": None}


@router.post("/sessions/search")
async def search_sessions(request: Request):
    """Sessions by id, name (display_name), metadata and status, newest first, a page at a time.
    trine scopes everything by API key: every owner is the key itself, and there are no projects.
    user_metadata `tags` (comma-separated) matches sessions holding each of those tags."""
    svc, _, key = caller(request)
    b = await json_model(request, SessionSearchBody)
    if b.project_ids:
        raise InvalidRequest(
            "project_ids: trine has no projects; leave project_ids out", code="not_supported"
        )
    meta = dict(b.user_metadata)
    tags = tuple(t.strip() for t in meta.pop("tags", "").split(",") if t.strip())
    search = SessionSearch(
        session_id=b.session_id,
        name=b.display_name,
        tags=tags,
        metadata=meta,
        statuses=None if b.statuses is None else tuple(p for q in b.statuses for p in _status_pairs(q)),
    )
    if b.owner.type == "user" and key.name not in (b.owner.owner_urns or []):
        return {"sessions": [], "next_cursor": None}
    rows, more = svc.queries.search_sessions(
        key, search, b.limit, b.cursor.last_session_id if b.cursor else None
    )
    sessions = []
    for s in rows:
        count, size = svc.queries.session_checkpoints(key, s.id)
        sessions.append(
            {
                "session_id": s.id,
                "created_at": iso(s.created_at),
                "owner": key.name,
                "project_id": "",
                "status": _status_json(s),
                "checkpoints_count": count,
                "display_name": s.name or None,
                "user_metadata": as_metadata(s),
                "checkpoint_storage_bytes": size,
            }
        )
    cursor = (
        {"last_created_at": iso(rows[-1].created_at), "last_session_id": rows[-1].id}
        if more and rows
        else None
    )
    return {"sessions": sessions, "next_cursor": cursor}


# ---------------------------------------------------------------------------- billing
def _parse_time(value: str | None, field: str) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise InvalidRequest(f"{field} {value!r}: use an ISO-8601 time") from None


@router.get("/billing/usage/events")
async def billing_usage(request: Request, starting_on: str | None = None, ending_before: str | None = None):
    """trine's usage events in hourly UTC buckets by model, session and Tinker event kind."""
    svc, _, key = caller(request)
    start, end = _parse_time(starting_on, "starting_on"), _parse_time(ending_before, "ending_before")
    buckets: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in svc.queries.usage_events(key, since=start):
        if end is not None and e.time >= end:
            continue
        hour = int(e.time // 3600) * 3600
        cost = svc.rate_card.cost(e)
        for kind, cached, count, phase in (
            ("training", None, e.train, "train"),
            ("sampling_prefill", False, e.prefill, "prefill"),
            ("sampling_prefill", True, e.prefill_cached, "prefill_cached"),
            ("sampling_sample", None, e.sample, "sample"),
        ):
            if count:
                b = buckets[(hour, e.base_model, e.session_id, kind, cached)]
                b[0] += count
                b[1] += cost.get(phase, 0.0)
    data = []
    for (hour, model, session, kind, cached), (count, cost) in sorted(
        buckets.items(), key=lambda kv: kv[0][:4]
    ):
        info = {"type": kind, "token_count": int(count)}
        if cached is not None:
            info["cached"] = cached
        data.append(
            {
                "bucket_start": iso(hour),
                "bucket_end": iso(hour + 3600),
                "base_model": model,
                "user_id": key.id,
                "user_name": key.name,
                "session_id": session,
                "estimated_cost_usd": money(cost),
                "effective_rate_usd_per_million_tokens": money(cost * 1e6 / count) if count else None,
                "event_info": info,
            }
        )
    return {"data": data, "sessions": {}}

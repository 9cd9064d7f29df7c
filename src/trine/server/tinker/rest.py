"""Tinker handshake, sessions and REST routes: client config, sessions and heartbeats, training runs,
checkpoints (`tinker://` paths), capabilities, telemetry (accepted and dropped) and billing usage
(answered from trine's metering, in Tinker's hourly-bucket shape).

The client config turns off what a self-hosted server does not need: no JWT exchange
(`pjwt_auth_enabled`), custom losses run on the client (`custom_loss_server_side`), no
retrieve_futures poller, plain httpx transport, uncompressed forward_backward bodies.
"""
from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timezone

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from ...limits import MAX_PAGE_SIZE
from ...service import Checkpoint, InvalidRequest, RunLabels
from ...service.labels import as_metadata
from ..context import json_object
from .state import caller, to_tinker_path, to_trio_uri

router = APIRouter(prefix="/api/v1")
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key",
                 "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                 "parallel_fwdbwd_chunks": True, "fwdbwd_max_chunk_len": 1024,
                 "fwdbwd_max_chunk_bytes_count": 5_000_000, "sample_use_retrieve_futures": False,
                 "sample_join_sampling_session": False, "custom_loss_server_side": False,
                 "sample_no_retries": False}
FINISH_STATUS = {"success": "ENDED", "errored": "CANCELLED", "interrupted": "CANCELLED"}


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat()


# ---------------------------------------------------------------------------- handshake
@router.post("/client/config")
async def client_config(request: Request):
    caller(request)
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def dynamic_config(request: Request):
    caller(request)
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


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
    return {"supported_models": [{"model_name": m.name, "max_context_length": m.max_seq_len,
                                  "trainable": True, "sampleable": True} for m in svc.queries.models()]}


# ---------------------------------------------------------------------------- sessions
@router.post("/create_session")
async def create_session(request: Request):
    svc, _, key = caller(request)
    b = await json_object(request)
    tags, meta, name = b.get("tags") or [], b.get("user_metadata") or {}, b.get("display_name") or ""
    if not isinstance(tags, list) or not isinstance(meta, dict) or not isinstance(name, str):
        raise InvalidRequest("create_session: tags is a list of strings, user_metadata an object, "
                             "display_name a string")
    s = svc.runs.create_session(key, str(b.get("sdk_version") or ""), RunLabels(name, tuple(tags), meta))
    return {"type": "create_session", "session_id": s.id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request):
    svc, st, key = caller(request)
    b = await json_object(request)
    s = svc.ownership.session(key, str(b.get("session_id") or ""))
    if s.status != "ACTIVE":
        return JSONResponse({"code": "session_finished", "message": f"session {s.id} is {s.status}"},
                            status_code=410)
    for m in st.models.values():  # keeps the session's training runs from being collected as idle
        if m.session_id == s.id and m.api_key_id == key.id:
            svc.runs.heartbeat(key, m.run_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request):
    svc, _, key = caller(request)
    b = await json_object(request)
    reason = (b.get("reason") or {}).get("type", "success")
    await svc.runs.close_session(key, session_id, FINISH_STATUS.get(reason, "ENDED"))
    return {}


@router.get("/sessions")
async def list_sessions(request: Request, limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
                        offset: int = Query(0, ge=0)):
    svc, _, key = caller(request)
    rows, _ = svc.queries.sessions(key, limit, offset)
    return {"sessions": [s.id for s in rows]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request):
    svc, st, key = caller(request)
    v = svc.queries.session(key, session_id)
    models = [mid for mid, m in st.models.items() if m.session_id == v.session.id and m.api_key_id == key.id]
    return {"training_run_ids": models, "sampler_ids": v.sampling_run_ids}


# ---------------------------------------------------------------------------- runs and checkpoints
def checkpoint_json(c: Checkpoint) -> dict:
    return {"checkpoint_id": to_tinker_path(c.uri).split("/", 3)[3], "tinker_path": to_tinker_path(c.uri),
            "checkpoint_type": "training" if c.kind == "TRAINING" else "sampler",
            "time": _iso(c.created_at), "size_bytes": c.size_bytes, "public": False,
            "expires_at": _iso(c.expires_at)}


def training_run_json(svc, key, r) -> dict:
    cks, _ = svc.queries.checkpoints(key, training_run_id=r.id)
    last = {kind: max((c for c in cks if c.kind == kind), key=lambda c: c.created_at, default=None)
            for kind in ("TRAINING", "SAMPLER")}
    return {"training_run_id": r.id, "base_model": r.base_model, "model_owner": key.name, "is_lora": True,
            "corrupted": r.status == "INTERRUPTED", "lora_rank": r.lora_rank,
            "last_request_time": _iso(r.updated_at),
            "last_checkpoint": checkpoint_json(last["TRAINING"]) if last["TRAINING"] else None,
            "last_sampler_checkpoint": checkpoint_json(last["SAMPLER"]) if last["SAMPLER"] else None,
            "user_metadata": as_metadata(r) or None}


def _run_id(st, key, id_: str) -> str:
    """Training routes take a trine run id or a Tinker model id."""
    m = st.models.get(id_)
    return m.run_id if m is not None and m.api_key_id == key.id else id_


@router.get("/training_runs")
async def list_training_runs(request: Request, limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
                             offset: int = Query(0, ge=0)):
    svc, _, key = caller(request)
    rows, total = svc.queries.training_runs(key, limit, offset)
    return {"training_runs": [training_run_json(svc, key, r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, request: Request):
    svc, st, key = caller(request)
    return training_run_json(svc, key, svc.ownership.training_run(key, _run_id(st, key, run_id)))


@router.get("/training_runs/{run_id}/checkpoints")
async def run_checkpoints(run_id: str, request: Request):
    svc, st, key = caller(request)
    rows, _ = svc.queries.checkpoints(key, training_run_id=_run_id(st, key, run_id))
    return {"checkpoints": [checkpoint_json(c) for c in rows if c.path]}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
    svc, st, key = caller(request)
    ck = svc.ownership.checkpoint_by_uri(key, to_trio_uri(f"tinker://{_run_id(st, key, run_id)}/{checkpoint_id}"))
    svc.checkpoints.delete(key, ck.id)
    return JSONResponse(None)


@router.get("/checkpoints")
async def list_checkpoints(request: Request, limit: int = Query(100, ge=1, le=MAX_PAGE_SIZE),
                           offset: int = Query(0, ge=0)):
    svc, _, key = caller(request)
    rows, total = svc.queries.checkpoints(key, limit=limit, offset=offset)
    return {"checkpoints": [checkpoint_json(c) for c in rows if c.path],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.post("/weights_info")
async def weights_info(request: Request):
    svc, _, key = caller(request)
    b = await json_object(request)
    c = svc.ownership.checkpoint_by_uri(key, to_trio_uri(b.get("tinker_path")))
    return {"base_model": c.base_model, "is_lora": True, "lora_rank": c.lora_rank,
            "train_unembed": c.train_unembed, "train_mlp": c.train_mlp, "train_attn": c.train_attn}


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
        for kind, cached, count, phase in (("training", None, e.train, "train"),
                                           ("sampling_prefill", False, e.prefill, "prefill"),
                                           ("sampling_prefill", True, e.prefill_cached, "prefill_cached"),
                                           ("sampling_sample", None, e.sample, "sample")):
            if count:
                b = buckets[(hour, e.base_model, e.session_id, kind, cached)]
                b[0] += count
                b[1] += cost.get(phase, 0.0)
    data = []
    for (hour, model, session, kind, cached), (count, cost) in sorted(buckets.items(), key=lambda kv: kv[0][:4]):
        info = {"type": kind, "token_count": int(count)}
        if cached is not None:
            info["cached"] = cached
        data.append({"bucket_start": _iso(hour), "bucket_end": _iso(hour + 3600), "base_model": model,
                     "user_id": key.id, "user_name": key.name, "session_id": session,
                     "estimated_cost_usd": cost,
                     "effective_rate_usd_per_million_tokens": cost * 1e6 / count if count else None,
                     "event_info": info})
    return {"data": data, "sessions": {}}


"""The control plane (`/api/...`, JSON, API key): identity, sessions, runs, checkpoints, models.

Response shapes follow the official `pytrio` 0.2.9 client (docs/architecture.md, "Front ends");
PyTRIO ignores extra keys here, so trine adds a few of its own (e.g. `last_cycle` on training runs).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from ...engine.api import token_indices
from ...limits import MAX_PAGE_SIZE
from ...service import (
    ApiKey,
    NotFound,
)
from ...service.checkpoints import downloadable
from ..http.auth import iso
from ..http.bounds import INT64_MAX
from ..http.context import api_key, parse_json, parse_model, service_of, signer_of
from .bodies import (
    SamplingRunCreate,
    SessionClose,
    SessionCreate,
    TrainingRunCreate,
    TrainingRunUpdate,
)
from .shapes import (
    actor_binding,
    capability,
    checkpoint_json,
    cursor,
    sampling_run_json,
    served_model_id,
    session_json,
    training_run_json,
)
from .to_api import run_labels, sampling_run_spec, training_run_spec

SDK_VERSION = "0.2.9"


router = APIRouter(prefix="/api")


# ---------------------------------------------------------------------------- identity, platform
@router.get("/openapi/v1/api-key/verify")
async def verify(key: ApiKey = Depends(api_key)):
    return {
        "api_key_tid": key.id,
        "api_key_name": key.name,
        "user_cuid": key.id,
        "username": key.name,
        "display_name": key.name,
        "workspace_cuid": key.id,
        "workspace_name": key.name,
        "workspace_type": "PERSONAL",
        "expires_at": None,
    }


@router.get("/sdk/bootstrap")
async def bootstrap(sdk_version: str = SDK_VERSION):
    return {"compatibility": {"status": "compatible", "sdk_version": sdk_version}, "notices": []}


@router.post("/telemetry/event", status_code=204)
async def telemetry(request: Request):
    """Accepted and dropped: trine keeps no client telemetry."""
    return Response(status_code=204)


@router.get("/models")
async def models(
    request: Request,
    limit: int = Query(100, ge=1, le=MAX_PAGE_SIZE),
    offset: int = Query(0, ge=0, le=INT64_MAX),
    key: ApiKey = Depends(api_key),
):
    svc = service_of(request)
    items = []
    for m in svc.queries.models():
        cap = capability(svc, m.name)
        items.append(
            {
                "cuid": m.name,
                "alias": m.name,
                "model_id": m.model_id,
                "display_name": m.name,
                "model_type": "llm",
                "architecture": m.architecture,
                "context_length": m.max_seq_len,
                "train_available": True,
                "sample_available": True,
                "trainer": cap,
                "sampler": cap,
                "created_at": iso(svc.started_at),
                "updated_at": iso(svc.started_at),
                "name": m.name,
                "pricing": svc.rate_card.pricing(m.name),
            }
        )
    return {"items": items[offset : offset + limit], "total": len(items), "limit": limit, "offset": offset}


# ---------------------------------------------------------------------------- sessions
@router.post("/openapi/v1/service-sessions")
async def create_session(body: SessionCreate, request: Request, key: ApiKey = Depends(api_key)):
    return session_json(service_of(request).runs.create_session(key, body.sdk_version, run_labels(body)))


@router.get("/openapi/v1/service-sessions")
async def list_sessions(
    request: Request,
    limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
    offset: int = Query(0, ge=0, le=INT64_MAX),
    key: ApiKey = Depends(api_key),
):
    rows, total = service_of(request).queries.sessions(key, limit, offset)
    return {"service_sessions": [session_json(s) for s in rows], "cursor": cursor(offset, limit, total)}


@router.get("/openapi/v1/service-sessions/{session_id}")
async def get_session(session_id: str, request: Request, key: ApiKey = Depends(api_key)):
    v = service_of(request).queries.session(key, session_id)
    return {
        **session_json(v.session),
        "training_run_cuids": v.training_run_ids,
        "sampling_run_cuids": v.sampling_run_ids,
    }


@router.post("/openapi/v1/service-sessions/{session_id}/close")
async def close_session(session_id: str, request: Request, key: ApiKey = Depends(api_key)):
    raw = parse_json(await request.body())  # a body that is not a map closes with ENDED
    body = parse_model(SessionClose, raw if isinstance(raw, dict) else {})
    s = await service_of(request).runs.close_session(key, session_id, body.status)
    return session_json(s)


@router.post("/openapi/v1/service-sessions/{session_id}/renew")
async def renew_session(session_id: str, request: Request, key: ApiKey = Depends(api_key)):
    s = service_of(request).ownership.session(key, session_id)
    return {
        "service_session_cuid": s.id,
        "workspace_cuid": s.api_key_id,
        "status": s.status,
        "updated_at": iso(time.time()),
    }


# ---------------------------------------------------------------------------- training runs
@router.post("/openapi/v1/service-sessions/{session_id}/training-runs")
async def create_training_run(
    session_id: str, body: TrainingRunCreate, request: Request, key: ApiKey = Depends(api_key)
):
    svc = service_of(request)
    r = svc.runs.create_training_run(key, session_id, training_run_spec(body))
    m = svc.queries.model(r.base_model)
    return {
        **training_run_json(svc, r),
        "model_alias": m.name,
        "model_id": m.model_id,
        "trainer": capability(svc, m.name),
        **actor_binding(request, key, r.id, "training"),
    }


@router.patch("/openapi/v1/service-sessions/{session_id}/training-runs/{run_id}")
async def update_training_run(
    session_id: str, run_id: str, body: TrainingRunUpdate, request: Request, key: ApiKey = Depends(api_key)
):
    svc = service_of(request)
    r = svc.runs.update_training_run(
        key,
        session_id,
        run_id,
        source_checkpoint_uri=body.source_checkpoint_uri,
        restore_optimizer=body.restore_optimizer,
    )
    return {
        "source_checkpoint_uri": r.source_checkpoint_uri,
        "restore_optimizer": r.restore_optimizer,
        "trainer": capability(svc, r.base_model),
        **actor_binding(request, key, r.id, "training"),
    }


@router.get("/openapi/v1/training-runs/by-checkpoint-uri")
async def by_checkpoint_uri(
    request: Request, checkpoint_uri: str = Query(min_length=1), key: ApiKey = Depends(api_key)
):
    svc = service_of(request)
    c = svc.ownership.checkpoint_by_uri(key, checkpoint_uri)
    return {
        "base_model": served_model_id(svc, c.base_model),
        "lora_rank": c.lora_rank,
        "seed": c.seed,
        "train_mlp": c.train_mlp,
        "train_attn": c.train_attn,
        "train_unembed": c.train_unembed,
        "trainable_token_indices": token_indices(c.trainable_token_indices) or None,  # trine's own
        "checkpoint_type": c.kind,
        "training_run_cuid": c.training_run_id,
    }


@router.get("/openapi/v1/training-runs")
async def list_training_runs(
    request: Request,
    limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
    offset: int = Query(0, ge=0, le=INT64_MAX),
    key: ApiKey = Depends(api_key),
):
    svc = service_of(request)
    rows, total = svc.queries.training_runs(key, limit, offset)
    return {
        "training_runs": [training_run_json(svc, r) for r in rows],
        "cursor": cursor(offset, limit, total),
    }


@router.get("/openapi/v1/training-runs/{run_id}")
async def get_training_run(run_id: str, request: Request, key: ApiKey = Depends(api_key)):
    svc = service_of(request)
    return training_run_json(svc, svc.ownership.training_run(key, run_id))


@router.post("/openapi/v1/training-runs/{run_id}/renew")
async def renew_training_run(run_id: str, request: Request, key: ApiKey = Depends(api_key)):
    return _renewal(request, key, service_of(request).ownership.training_run(key, run_id), "training")


@router.get("/openapi/v1/training-runs/{run_id}/checkpoints")
async def run_checkpoints(
    run_id: str,
    request: Request,
    limit: int = Query(200, ge=1, le=MAX_PAGE_SIZE),
    offset: int = Query(0, ge=0, le=INT64_MAX),
    key: ApiKey = Depends(api_key),
):
    svc = service_of(request)
    rows, total = svc.queries.checkpoints(key, training_run_id=run_id, limit=limit, offset=offset)
    return {"checkpoints": [checkpoint_json(svc, c) for c in rows], "cursor": cursor(offset, limit, total)}


# ---------------------------------------------------------------------------- sampling runs
@router.post("/openapi/v1/service-sessions/{session_id}/sampling-runs")
async def create_sampling_run(
    session_id: str, body: SamplingRunCreate, request: Request, key: ApiKey = Depends(api_key)
):
    svc = service_of(request)
    r = svc.runs.create_sampling_run(key, session_id, sampling_run_spec(body))
    return {
        **sampling_run_json(svc, r),
        "sampler": capability(svc, r.base_model),
        **actor_binding(request, key, r.id, "sampling"),
    }


@router.get("/openapi/v1/sampling-runs/{run_id}")
async def get_sampling_run(run_id: str, request: Request, key: ApiKey = Depends(api_key)):
    svc = service_of(request)
    return sampling_run_json(svc, svc.ownership.sampling_run(key, run_id))


@router.post("/openapi/v1/sampling-runs/{run_id}/renew")
async def renew_sampling_run(run_id: str, request: Request, key: ApiKey = Depends(api_key)):
    return _renewal(request, key, service_of(request).ownership.sampling_run(key, run_id), "sampling")


def _renewal(request: Request, key: ApiKey, run, kind: str) -> dict:
    """Fresh actor credentials for a training or sampling run the key owns."""
    return {
        f"{kind}_run_cuid": run.id,
        "service_session_cuid": run.session_id,
        "workspace_cuid": run.api_key_id,
        **actor_binding(request, key, run.id, kind),
    }


# ---------------------------------------------------------------------------- checkpoints
@router.get("/openapi/v1/checkpoints")
async def list_checkpoints(
    request: Request,
    limit: int = Query(100, ge=1, le=MAX_PAGE_SIZE),
    offset: int = Query(0, ge=0, le=INT64_MAX),
    key: ApiKey = Depends(api_key),
):
    svc = service_of(request)
    rows, total = svc.queries.checkpoints(key, limit=limit, offset=offset)
    return {"checkpoints": [checkpoint_json(svc, c) for c in rows], "cursor": cursor(offset, limit, total)}


@router.delete("/openapi/v1/checkpoints/{checkpoint_id}")
async def delete_checkpoint(checkpoint_id: str, request: Request, key: ApiKey = Depends(api_key)):
    service_of(request).checkpoints.delete(key, checkpoint_id)
    return {"checkpoint_cuid": checkpoint_id, "deleted": True}


@router.get("/openapi/v1/checkpoints/{checkpoint_id}/download-url")
async def download_url(checkpoint_id: str, request: Request, key: ApiKey = Depends(api_key)):
    c = downloadable(service_of(request).ownership.checkpoint(key, checkpoint_id))
    token, exp = signer_of(request).issue(key_id=key.id, subject=c.id, kind="download")
    return {
        "url": f"{request.base_url}files/{c.id}?token={token}",
        "expires_at": iso(exp),
        "source": "actor",
        "checkpoint_status": "READY",
        "tls_cert_pem": None,
        "tls_not_after": None,
    }


files_router = APIRouter()


@files_router.get("/files/{checkpoint_id}")
async def download(checkpoint_id: str, request: Request, token: str = Query("")):
    """The checkpoint directory as a tar file. The URL carries its own short-lived token (clients
    fetch it without auth headers); Range requests resume a partial download."""
    claims = signer_of(request).verify(token, "download", url="download URL")
    svc = service_of(request)
    if claims["sub"] != checkpoint_id:
        raise NotFound(f"checkpoint {checkpoint_id} not found", code="checkpoint_not_found")
    c = svc.ownership.checkpoint(svc.ownership.key(claims["key"]), checkpoint_id)
    tar = await svc.checkpoints.archive(c)
    return FileResponse(tar, media_type="application/x-tar", filename=f"{c.name}.tar")


# ---------------------------------------------------------------------------- trine extras
@router.get("/trine/v1/models/{name}/tokenizer")
async def tokenizer_files(name: str, request: Request, key: ApiKey = Depends(api_key)):
    """The tokenizer files of a served model, for clients that build the tokenizer locally."""
    m = service_of(request).queries.model(name)
    return {"model": m.name, "files": [f.name for f in service_of(request).queries.tokenizer(name).files()]}


@router.get("/trine/v1/models/{name}/tokenizer/{filename}")
async def tokenizer_file(name: str, filename: str, request: Request, key: ApiKey = Depends(api_key)):
    for f in service_of(request).queries.tokenizer(name).files():
        if f.name == filename:
            return FileResponse(f)
    raise NotFound(f"{name} has no tokenizer file {filename!r}", code="not_found")


@router.get("/trine/v1/events/{event_id}")
async def event_info(event_id: str, request: Request, key: ApiKey = Depends(api_key)):
    """An event's status and the clock cycle it ran in."""
    rec = service_of(request).queries.event(key, event_id)
    return JSONResponse(
        {
            "event_id": rec.event_id,
            "run_id": rec.run_id,
            "index": rec.idx,
            "type": rec.type,
            "status": rec.status,
            "cycle": rec.cycle,
        }
    )

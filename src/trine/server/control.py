"""The control plane (`/api/...`, JSON, API key): identity, sessions, runs, checkpoints, models.

Response shapes follow the official `pytrio` 0.2.9 client (docs/architecture.md, "Front ends");
PyTRIO ignores extra keys here, so trine adds a few of its own (e.g. `last_cycle` on training runs).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..engine.api import LoRAConfig
from ..limits import MAX_PAGE_SIZE
from ..service import (
    ApiKey,
    Checkpoint,
    NotFound,
    RunLabels,
    SamplingRun,
    SamplingRunSpec,
    Service,
    Session,
    TrainingRun,
    TrainingRunSpec,
)
from ..service.labels import as_metadata
from .auth import iso
from .bounds import INT64_MAX, Int64, Seed
from .context import api_key, parse_json, parse_model, service_of, signer_of

SDK_VERSION = "0.2.9"


router = APIRouter(prefix="/api")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SessionCreate(_Body):
    sdk_version: str = ""
    user_metadata: dict[str, Any] | None = None
    name: str = ""  # trine's own: runs made in the session take these labels (see service/labels.py)
    tags: list[str] = []

    def labels(self) -> RunLabels:
        return RunLabels(self.name, tuple(self.tags), self.user_metadata or {})


class SessionClose(_Body):
    status: str = Field(default="ENDED", pattern="^(ENDED|CANCELLED)$")


class TrainingRunCreate(_Body):
    base_model: str = ""
    lora_rank: Int64 = 32
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    source_checkpoint_uri: str = ""
    restore_optimizer: bool = False
    seed: Seed | None = None
    name: str = ""  # trine's own (the trine SDK sends them; PyTRIO never does)
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None


class TrainingRunUpdate(_Body):
    source_checkpoint_uri: str = Field(min_length=1)
    restore_optimizer: bool = False


class SamplingRunCreate(_Body):
    base_model: str = ""
    source_checkpoint_uri: str = ""


# ---------------------------------------------------------------------------- shapes
def _capability(svc: Service, model_name: str) -> dict:
    m = svc.queries.model(model_name)
    return {"max_batch_size": None, "max_tokens_per_request": None, "max_seq_len": m.max_seq_len}


def _model_id(svc: Service, name: str) -> str:
    """The model_id PyTRIO clients see for a record's base model (its name if no longer served)."""
    m = svc.queries.find_model(name)
    return m.model_id if m else name


def actor_binding(request: Request, key: ApiKey, subject: str, kind: str) -> dict:
    token, exp = signer_of(request).issue(key_id=key.id, subject=subject, kind=kind)
    return {
        "actor": {
            "actor_cuid": "trine",
            "endpoint": str(request.base_url) + "actor",
            "connect_mode": "direct",
            "tls_enabled": False,
            "tls_cert_pem": None,
            "tls_not_after": None,
        },
        "actor_jwt": {"token": token, "expires_at": iso(exp)},
    }


def session_json(s: Session) -> dict:
    return {
        "service_session_cuid": s.id,
        "workspace_cuid": s.api_key_id,
        "status": s.status,
        "sdk_version": s.sdk_version,
        "created_at": iso(s.created_at),
        "updated_at": iso(s.updated_at),
    }


def training_run_json(svc: Service, r: TrainingRun) -> dict:
    params = {
        "restore_optimizer": r.restore_optimizer,
        "lora_rank": r.lora_rank,
        "seed": r.seed,
        "train_mlp": r.train_mlp,
        "train_attn": r.train_attn,
        "train_unembed": r.train_unembed,
    }
    return {
        "training_run_cuid": r.id,
        "base_model": _model_id(svc, r.base_model),
        "model_alias": r.base_model,
        "service_session_cuid": r.session_id,
        "workspace_cuid": r.api_key_id,
        "status": r.status,
        "run_index": r.run_index,
        "model_spec_cuid": r.base_model,
        "is_lora": True,
        "source_checkpoint_uri": r.source_checkpoint_uri or None,
        **params,
        "corrupted": r.status == "INTERRUPTED",
        "corrupted_reason": (
            "its weights were lost (a server restart or a lost engine replica)"
            if r.status == "INTERRUPTED"
            else None
        ),
        "training_params": params,
        "created_at": iso(r.created_at),
        "updated_at": iso(r.updated_at),
        "last_cycle": r.last_cycle,
        "name": r.name or None,
        "tags": r.tag_list,
        "user_metadata": as_metadata(r) or None,
    }


def checkpoint_json(svc: Service, c: Checkpoint) -> dict:
    model_id = _model_id(svc, c.base_model)
    return {
        "cuid": c.id,
        "checkpoint_cuid": c.id,
        "training_run_cuid": c.training_run_id,
        "workspace_cuid": c.api_key_id,
        "name": c.name,
        "checkpoint_type": c.kind,
        "status": "READY",
        "checkpoint_uri": c.uri,
        "model": model_id,
        "base_model": model_id,
        "model_spec_cuid": c.base_model,
        "task_id": c.training_run_id,
        "task_name": None,
        "task_created_at": iso(c.created_at),
        "task_status": "SUCCEEDED",
        "step": c.step,
        "path": c.uri,
        "created_at": iso(c.created_at),
        "uploaded_at": None,
        "size_bytes": c.size_bytes,
        "lora_rank": c.lora_rank,
        "is_uploaded": bool(c.path),
        "expired_at": iso(c.expires_at),
        "visibility": c.visibility,
    }


def sampling_run_json(svc: Service, r: SamplingRun) -> dict:
    m = svc.queries.model(r.base_model)
    return {
        "sampling_run_cuid": r.id,
        "service_session_cuid": r.session_id,
        "workspace_cuid": r.api_key_id,
        "status": r.status,
        "base_model": m.model_id,
        "model_id": m.model_id,
        "alias": m.name,
        "run_index": r.run_index,
        "model_spec_cuid": m.name,
        "model_alias": m.name,
        "source_checkpoint_uri": r.source_checkpoint_uri or None,
        "created_at": iso(r.created_at),
        "updated_at": iso(r.updated_at),
    }


def cursor(offset: int, limit: int, total: int) -> dict:
    return {"offset": offset, "limit": limit, "total": total}


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
        cap = _capability(svc, m.name)
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
    return session_json(service_of(request).runs.create_session(key, body.sdk_version, body.labels()))


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
    lora = LoRAConfig(
        rank=body.lora_rank,
        seed=body.seed,
        train_mlp=body.train_mlp,
        train_attn=body.train_attn,
        train_unembed=body.train_unembed,
    )
    labels = RunLabels(body.name, tuple(body.tags), body.user_metadata or {})
    r = svc.runs.create_training_run(
        key,
        session_id,
        TrainingRunSpec(body.base_model, lora, body.source_checkpoint_uri, body.restore_optimizer, labels),
    )
    m = svc.queries.model(r.base_model)
    return {
        **training_run_json(svc, r),
        "model_alias": m.name,
        "model_id": m.model_id,
        "trainer": _capability(svc, m.name),
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
        "trainer": _capability(svc, r.base_model),
        **actor_binding(request, key, r.id, "training"),
    }


@router.get("/openapi/v1/training-runs/by-checkpoint-uri")
async def by_checkpoint_uri(
    request: Request, checkpoint_uri: str = Query(min_length=1), key: ApiKey = Depends(api_key)
):
    svc = service_of(request)
    c = svc.ownership.checkpoint_by_uri(key, checkpoint_uri)
    return {
        "base_model": _model_id(svc, c.base_model),
        "lora_rank": c.lora_rank,
        "seed": c.seed,
        "train_mlp": c.train_mlp,
        "train_attn": c.train_attn,
        "train_unembed": c.train_unembed,
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
    r = svc.runs.create_sampling_run(
        key, session_id, SamplingRunSpec(body.base_model, body.source_checkpoint_uri)
    )
    return {
        **sampling_run_json(svc, r),
        "sampler": _capability(svc, r.base_model),
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
    c = service_of(request).ownership.checkpoint(key, checkpoint_id)
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
    claims = signer_of(request).verify(token, "download")
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

"""Tinker training runs and checkpoints (`tinker://<run>/<weights|sampler_weights>/<name>` paths):
listing, deleting, time to live, publishing, weights info, storage usage, and downloads.

Downloads need no API key: the routes that answer them hand out URLs on this server that carry
their own signed, expiring token (`/api/v1/checkpoint_archives/<id>` for a tar of the checkpoint's
files at the top of the archive, as Tinker's archives are; `/api/v1/checkpoint_files/<id>/<file>`
for one file). `GET .../archive` answers with a 302 to the archive (its `Location` and `Expires`
are what Tinker SDKs read; `?redirect=false` gets `{url, expires}` as JSON instead);
`GET .../external_weights_urls` answers `{urls: {file: url}, expires}` for a checkpoint's files (an
`external_weights` checkpoint, which `save_weights_external` writes, is a Hugging Face model
directory).

A published checkpoint stays its owner's (only the owner may change its TTL, unpublish or delete
it); every key may sample it, train from it, read its weights info and download it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from email.utils import format_datetime
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse

from ...engine.api import FULL_RANK
from ...limits import INT64_MAX, MAX_PAGE_SIZE
from ...service import ApiKey, Checkpoint, InvalidRequest, NotFound, Service
from ...service.checkpoints import downloadable
from ..http.context import json_model, json_object, parse_model, service_of, signer_of
from .bodies import TtlBody, WeightsInfoBody
from .shapes import checkpoint_json, training_run_json
from .state import TinkerState, caller, optimizer_config, to_trio_uri

router = APIRouter(prefix="/api/v1")
CHECKPOINT = "/training_runs/{run_id}/checkpoints/{kind}/{name}"  # kind: weights | sampler_weights
GB = 1e9


def _run_id(st: TinkerState, key: ApiKey, id_: str) -> str:
    """Training routes take a trine run id or a Tinker model id."""
    m = st.models.get(id_)
    return m.run_id if m is not None and m.api_key_id == key.id else id_


def _path(st: TinkerState, key: ApiKey, run_id: str, kind: str, name: str) -> str:
    """The checkpoint's trio:// uri (kind: weights, sampler_weights or external_weights)."""
    return to_trio_uri(f"tinker://{_run_id(st, key, run_id)}/{kind}/{name}")


def _owned(request: Request, run_id: str, kind: str, name: str) -> tuple[Service, ApiKey, Checkpoint]:
    svc, st, key = caller(request)
    return svc, key, svc.ownership.checkpoint_by_uri(key, _path(st, key, run_id, kind, name))


def _readable(request: Request, run_id: str, kind: str, name: str) -> tuple[ApiKey, Checkpoint]:
    svc, st, key = caller(request)
    return key, svc.ownership.readable_by_uri(key, _path(st, key, run_id, kind, name))


# ---------------------------------------------------------------------------- runs and listings
@router.get("/training_runs")
async def list_training_runs(
    request: Request,
    limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
    offset: int = Query(0, ge=0, le=INT64_MAX),
):
    svc, _, key = caller(request)
    rows, total = svc.queries.training_runs(key, limit, offset)
    return {
        "training_runs": [training_run_json(svc, key, r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, request: Request):
    svc, st, key = caller(request)
    return training_run_json(svc, key, svc.ownership.training_run(key, _run_id(st, key, run_id)))


@router.get("/training_runs/{run_id}/checkpoints")
async def run_checkpoints(run_id: str, request: Request):
    svc, st, key = caller(request)
    rows, _ = svc.queries.checkpoints(key, training_run_id=_run_id(st, key, run_id), on_disk=True)
    return {"checkpoints": [checkpoint_json(c) for c in rows]}


@router.get("/checkpoints")
async def list_checkpoints(
    request: Request,
    limit: int = Query(100, ge=1, le=MAX_PAGE_SIZE),
    offset: int = Query(0, ge=0, le=INT64_MAX),
):
    svc, _, key = caller(request)
    rows, total = svc.queries.checkpoints(key, on_disk=True, limit=limit, offset=offset)
    return {  # in-memory snapshots are neither listed nor counted: every page up to the total is full
        "checkpoints": [checkpoint_json(c) for c in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


@router.post("/weights_info")
async def weights_info(request: Request):
    svc, _, key = caller(request)
    b = await json_model(request, WeightsInfoBody)
    c = svc.ownership.readable_by_uri(key, to_trio_uri(b.tinker_path, "tinker_path"))
    return {
        "base_model": c.base_model,
        "optimizer_config": optimizer_config(svc.ownership.checkpoint_optimizer(c)),
        "is_lora": c.lora_rank != FULL_RANK,  # rank 0: full fine-tuning's own weights
        "lora_rank": c.lora_rank,
        "train_unembed": c.train_unembed,
        "train_mlp": c.train_mlp,
        "train_attn": c.train_attn,
    }


@router.get("/billing/usage/checkpoints/current")
async def storage_usage(request: Request, project_id: str | None = None):
    """The key's checkpoints on disk: count, bytes and the monthly cost at the rate card's storage price."""
    svc, _, key = caller(request)
    stored = svc.checkpoints.stored(key)
    size = sum(c.size_bytes for c in stored)
    rates = {svc.rate_card.price(c.base_model).storage_gb_month for c in stored} or {
        svc.rate_card.price(m.name).storage_gb_month for m in svc.queries.models()
    }
    cost = sum(svc.rate_card.storage_cost(c.base_model, c.size_bytes / GB) for c in stored)
    return {
        "effective_rate_usd_per_gigabyte_month": rates.pop() if len(rates) == 1 else None,
        "data": [
            {
                "project_id": None,
                "org_user_urn": None,
                "user_email": None,
                "user_name": key.name,
                "checkpoint_count": len(stored),
                "size_bytes": size,
                "size_gigabytes": size / GB,
                "estimated_monthly_cost_usd": cost,
            }
        ]
        if stored
        else [],
    }


# ---------------------------------------------------------------------------- one checkpoint
@router.delete(CHECKPOINT)
async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request):
    svc, key, ck = _owned(request, run_id, kind, name)
    svc.checkpoints.delete(key, ck.id)
    return JSONResponse(None)


@router.put(CHECKPOINT + "/ttl")
async def set_ttl(run_id: str, kind: str, name: str, request: Request):
    """`{"ttl_seconds": N}`: expire N seconds from now (then the garbage collector deletes it);
    `{"ttl_seconds": null}`: never."""
    svc, key, ck = _owned(request, run_id, kind, name)
    b = parse_model(
        TtlBody, await json_object(request, what='send {"ttl_seconds": <seconds or null>}', empty_ok=False)
    )
    return checkpoint_json(svc.checkpoints.set_ttl(key, ck.id, b.ttl_seconds))


@router.post(CHECKPOINT + "/publish")
async def publish(run_id: str, kind: str, name: str, request: Request):
    svc, key, ck = _owned(request, run_id, kind, name)
    return checkpoint_json(svc.checkpoints.set_public(key, ck.id, True))


@router.delete(CHECKPOINT + "/publish")
async def unpublish(run_id: str, kind: str, name: str, request: Request):
    svc, key, ck = _owned(request, run_id, kind, name)
    return checkpoint_json(svc.checkpoints.set_public(key, ck.id, False))


# ---------------------------------------------------------------------------- downloads
def _signed(request: Request, key: ApiKey, ck: Checkpoint, path: str) -> tuple[str, datetime]:
    """A URL on this server for `path` (under /api/v1) that carries its own download token."""
    downloadable(ck)
    token, exp = signer_of(request).issue(key_id=key.id, subject=ck.id, kind="download")
    return (f"{request.base_url}api/v1/{path}?token={token}", datetime.fromtimestamp(exp, timezone.utc))


@router.get(CHECKPOINT + "/archive")
async def archive_url(run_id: str, kind: str, name: str, request: Request, redirect: bool = True):
    key, ck = _readable(request, run_id, kind, name)
    url, expires = _signed(request, key, ck, f"checkpoint_archives/{ck.id}")
    body = {"url": url, "expires": expires.isoformat()}
    if not redirect:
        return body
    return JSONResponse(
        body, status_code=302, headers={"Location": url, "Expires": format_datetime(expires, usegmt=True)}
    )


@router.get(CHECKPOINT + "/external_weights_urls")
async def file_urls(run_id: str, kind: str, name: str, request: Request):
    key, ck = _readable(request, run_id, kind, name)
    urls = {}
    for f in _files(ck):
        urls[f.name], expires = _signed(request, key, ck, f"checkpoint_files/{ck.id}/{f.name}")
    if not urls:
        raise InvalidRequest(
            f"checkpoint {ck.uri} has no files to download", code="checkpoint_not_downloadable"
        )
    return {"urls": urls, "expires": expires.isoformat()}


def _files(ck: Checkpoint) -> list[Path]:
    d = Path(ck.path) if ck.path else None
    return sorted(f for f in d.iterdir() if f.is_file()) if d is not None and d.is_dir() else []


def _by_token(request: Request, checkpoint_id: str, token: str) -> tuple[Service, Checkpoint]:
    """The checkpoint a download token was issued for (to its key, which may still read it)."""
    claims = signer_of(request).verify(token, "download", url="download URL")
    svc = service_of(request)
    if claims["sub"] != checkpoint_id:
        raise NotFound("checkpoint not found", code="checkpoint_not_found")
    return svc, svc.ownership.readable(svc.ownership.key(claims["key"]), checkpoint_id)


@router.get("/checkpoint_archives/{checkpoint_id}")
async def download_archive(checkpoint_id: str, request: Request, token: str = Query("")):
    svc, ck = _by_token(request, checkpoint_id, token)
    tar = await svc.checkpoints.archive(ck, flat=True)
    return FileResponse(tar, media_type="application/x-tar", filename=f"{ck.name}.tar")


@router.get("/checkpoint_files/{checkpoint_id}/{filename}")
async def download_file(checkpoint_id: str, filename: str, request: Request, token: str = Query("")):
    _, ck = _by_token(request, checkpoint_id, token)
    for f in _files(ck):
        if f.name == filename:
            return FileResponse(f, filename=f.name)
    raise NotFound(f"checkpoint {ck.uri} has no file {filename!r}", code="file_not_found")

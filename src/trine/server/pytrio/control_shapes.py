"""Control-plane answers (JSON) in the shapes the official `pytrio` 0.2.9 client reads; PyTRIO
ignores extra keys, so trine adds a few of its own (e.g. `last_cycle` on training runs)."""

from __future__ import annotations

from fastapi import Request

from ...service import ApiKey, Checkpoint, SamplingRun, Service, Session, TrainingRun
from ...service.labels import as_metadata
from ..http.auth import iso
from ..http.context import signer_of


def _capability(svc: Service, model_name: str) -> dict:
    m = svc.queries.model(model_name)
    return {"max_batch_size": None, "max_tokens_per_request": None, "max_seq_len": m.max_seq_len}


def _model_id(svc: Service, name: str) -> str:
    """The model_id PyTRIO clients see for a record's base model (its name if no longer served).

    The one server path a response carries, on purpose: the official client loads its tokenizer
    from `model_id` (a local directory, ../shared/reference/pytrio-protocol.md section 9) and compares
    `by-checkpoint-uri`'s `base_model` with it. Every other `base_model` is the model's name."""
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
        "base_model": r.base_model,  # its name, never the server's directory (http/refusals.py)
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
    return {
        "cuid": c.id,
        "checkpoint_cuid": c.id,
        "training_run_cuid": c.training_run_id,
        "workspace_cuid": c.api_key_id,
        "name": c.name,
        "checkpoint_type": c.kind,
        "status": "READY",
        "checkpoint_uri": c.uri,
        "model": c.base_model,  # names: never the server's directories (server/http/refusals.py)
        "base_model": c.base_model,
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
        "base_model": m.name,
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

"""PyTRIO answers (docs/architecture.md, "Front ends"), in the shapes the official `pytrio` 0.2.9
client reads. The actor plane's are built from the service's protocol-neutral results: event
envelopes (MessagePack) and sample responses (JSON). The control plane's are JSON records; PyTRIO
ignores extra keys, so trine adds a few of its own (e.g. `last_cycle` on training runs).

The service stores neutral results; these functions run on every read, so a retry or long-poll
gets the same bytes as the first answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np
from fastapi import Request

from ...engine.api import FULL_RANK
from ...limits import OPTIMIZE_STEP
from ...metering.money import dumps, money
from ...service import (
    ApiKey,
    Checkpoint,
    EventRecord,
    EventResult,
    SampleOutcome,
    SamplingRun,
    Service,
    Session,
    TrainingRun,
)
from ...service.labels import as_metadata
from ..http.auth import iso
from ..http.context import signer_of


@dataclass(frozen=True)
class SampleShape:
    """What a PyTRIO sample request asked to get back."""

    return_text: bool = True
    return_token_logprobs: bool = True


def wire_tensor(values, dtype: str = "<f4") -> dict:
    """A PyTRIO WireTensor map: raw little-endian bytes, shape [N] (N >= 1)."""
    arr = np.ascontiguousarray(np.asarray(values, dtype=dtype))
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "encoding": "raw_le", "data": arr.tobytes()}


def event_envelope(rec: EventRecord, res: EventResult | None, model_id: Callable[[str], str]) -> bytes:
    """The msgpack event response a client gets for `rec` now. `model_id` maps a base model name
    to the model_id PyTRIO clients see."""
    env = {"version": 1, "event_id": rec.event_id, "type": rec.type, "status": rec.status}
    if res is None:
        return msgpack.packb(env, use_bin_type=True)
    env["status"] = res.status
    env["usage"] = {
        "input_tokens": res.train_tokens,
        "output_tokens": 0,
        "train_tokens": res.train_tokens,
        "loss_tokens": res.loss_tokens,
        "train_sequence_tokens": res.train_sequence_tokens or res.train_tokens,  # trine's; PyTRIO ignores it
        "cost": money(res.cost),
    }
    env["cycle"] = res.cycle
    if res.error:
        env["error"] = {"code": res.error["code"], "message": res.error["message"]}
    else:
        env["result"] = _event_result(rec.type, res, model_id)
    return msgpack.packb(env, use_bin_type=True)


def unshift(values: list[list[float]]) -> list[list[float]]:
    """Per-position results of an auto-shifted datum (to_api.py shifted its targets) back on the
    client's positions: target j was scored from position j - 1, and position 0 has no score."""
    return [[0.0] + list(v[:-1]) for v in values]


def _event_result(type_: str, res: EventResult, model_id: Callable[[str], str]) -> dict:
    if res.checkpoint is not None:
        ck = res.checkpoint
        return {
            "checkpoint": {
                "uri": ck["uri"],
                "model_id": model_id(ck["base_model"]),
                "size_bytes": ck["size_bytes"],
                "checkpoint_cuid": ck["checkpoint_id"],
                "cuid": ck["checkpoint_id"],
                "type": ck["kind"],
            }
        }
    if res.logprobs is not None:
        logprobs = unshift(res.logprobs) if res.notes.get("auto_shift") else res.logprobs
        return {"loss_fn_outputs": [{"logprobs": wire_tensor(lp)} for lp in logprobs], "metrics": res.metrics}
    return {"metrics": res.metrics} if type_ == OPTIMIZE_STEP else {}


def sample_response(out: SampleOutcome, shape: SampleShape) -> bytes:
    seqs = []
    for s in out.sequences:
        lps = s.logprobs if shape.return_token_logprobs else []
        seqs.append(
            {
                "tokens": s.tokens,
                "text": s.text if shape.return_text else None,
                "logprobs": [_json_float(x) for x in lps],
                "stop_reason": s.stop_reason,
            }
        )
        if s.weights_versions is not None:  # inflight samplers (an extension stock clients ignore)
            seqs[-1]["weights_versions"] = s.weights_versions
    u = out.usage
    body = {
        "request_id": out.request_id,
        "sampling_run": out.sampling_run,
        "sequences": seqs,
        "prompt_logprobs": _json_floats(out.prompt_logprobs),
        "topk_prompt_logprobs": (
            [
                None if pos is None else [[int(t), _json_float(lp)] for t, lp in pos]
                for pos in out.topk_prompt_logprobs
            ]
            if out.topk_prompt_logprobs is not None
            else None
        ),
        "usage": {
            "input_tokens": u["prompt_tokens"],
            "output_tokens": u["sample_tokens"],
            **u,
            "cost": money(out.cost),
        },
        "model": out.model,
    }
    return dumps(body).encode()


def _json_float(x: float) -> float:
    return x if math.isfinite(x) else -1e30


def _json_floats(xs):
    return None if xs is None else [None if x is None else _json_float(float(x)) for x in xs]


# ---------------------------------------------------------------------------- control plane
def capability(svc: Service, model_name: str) -> dict:
    m = svc.queries.model(model_name)
    return {"max_batch_size": None, "max_tokens_per_request": None, "max_seq_len": m.max_seq_len}


def served_model_id(svc: Service, name: str) -> str:
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
        "is_lora": r.lora_rank != FULL_RANK,  # rank 0: full fine-tuning (trine's SDK only)
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
        "source": c.source or None,  # trine's own: an imported adapter's origin
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

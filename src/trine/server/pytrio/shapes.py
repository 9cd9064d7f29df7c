"""PyTRIO actor-plane response shapes (docs/architecture.md, "Front ends") built from the service's
protocol-neutral results: event envelopes (MessagePack) and sample responses (JSON).

The service stores neutral results; these functions run on every read, so a retry or long-poll
gets the same bytes as the first answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np

from ...limits import OPTIMIZE_STEP
from ...metering.money import dumps, money
from ...service import EventRecord, EventResult, SampleOutcome


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

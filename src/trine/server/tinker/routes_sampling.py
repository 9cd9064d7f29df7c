"""Tinker sampling: sampling sessions (= trine sampling runs), `asample`, and the sampler lookup.

`asample` answers a future at once with one `sample_sequence_ids` entry per sample
(`<request_id>:<i>`); the future runs `Service.sample`, so Tinker traffic shares the prefix cache
and the metering of every other front end: `prompt_cache_hit_tokens` is trine's `cached_tokens`
(a group of n samples prefills its prompt once). With `record_stability_info`, each sampled
sequence is kept under its sequence id for `stable_reinforce` (see `tinker/stability.py`). A
sampling session made by an inflight save follows the model's later inflight saves; its sequences
carry each token's weights version (shapes.WEIGHTS_VERSIONS_FIELD).
`compute_logprobs` reaches here as a 1-token sample with prompt logprobs: it reads the prefix cache
only before `prompt_logprobs_last_n` (0 hit tokens without it). The fields beyond PyTRIO's sample
body (top-k per sampled token, alt-token draws, target ids) are parsed in `sample_extras`.

`cancel_future` (the client sends it when a sample's future is abandoned: the dynamic config has
`sample_cancel_enabled`) stops a sample in flight: the engine frees its KV blocks at once, what it
computed is metered, and its future fails as cancelled. Other requests cannot be cancelled.
"""

from __future__ import annotations

import asyncio

import numpy as np
from fastapi import APIRouter, Request

from ...engine.api import SampleCancelled
from ...limits import MAX_SAMPLE_BYTES
from ...service import ApiKey, Conflict, InvalidRequest, SamplingRunSpec, Service
from ...uris import to_tinker_path
from ..http.context import json_model, json_object, parse_model
from . import shapes, to_api
from .bodies import PROTOBUF, AsampleBody, CancelBody, SamplingSessionBody
from .futures import Failure, Reply
from .state import TinkerState, caller, to_trio_uri

router = APIRouter(prefix="/api/v1")


def sampling_session(
    svc: Service, st: TinkerState, key: ApiKey, session_id: str, seq: int, base_model: str, source_uri: str
) -> str:
    """The sampling run behind (session, sampling_session_seq_id), created once: a retry (the same
    model) gets it again, another model under the same seq is refused, as a reused seq_id is."""
    known = st.samplers.get((session_id, seq))
    if known is not None and svc.ownership.sampling_run(key, known[0]):
        if known[1:] != (base_model, source_uri):
            raise Conflict(
                f"sampling_session_seq_id {seq}: already used in session {session_id} for another model; "
                "each sampling client of a session takes the next seq",
                code="sampling_session_seq_id_reused",
            )
        return known[0]
    r = svc.runs.create_sampling_run(key, session_id, SamplingRunSpec(base_model, source_uri))
    st.samplers[(session_id, seq)] = (r.id, base_model, source_uri)
    return r.id


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request):
    svc, st, key = caller(request)
    b = await json_object(request)
    parse_model(SamplingSessionBody, b)
    if not isinstance(b.get("session_id"), str) or not isinstance(b.get("sampling_session_seq_id"), int):
        raise InvalidRequest("body: send session_id and sampling_session_seq_id")
    if b["sampling_session_seq_id"] < 0:
        raise InvalidRequest(f"sampling_session_seq_id {b['sampling_session_seq_id']}: must be 0 or more")
    uri = to_trio_uri(b["model_path"], "model_path") if b.get("model_path") else ""
    if not uri and not b.get("base_model"):
        raise InvalidRequest("create_sampling_session: send base_model or model_path")
    sid = sampling_session(
        svc, st, key, b["session_id"], b["sampling_session_seq_id"], b.get("base_model") or "", uri
    )
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request):
    svc, st, key = caller(request)
    r = svc.ownership.sampling_run(key, sampler_id)
    return {
        "sampler_id": r.id,
        "base_model": svc.queries.model(r.base_model).model_id,  # a tokenizer dir
        "model_path": to_tinker_path(r.source_checkpoint_uri) if r.source_checkpoint_uri else None,
    }


@router.post("/asample")
async def asample(request: Request):
    svc, st, key = caller(request)
    b = await json_object(
        request, MAX_SAMPLE_BYTES, "the sample request must be a JSON object", empty_ok=False
    )
    body = parse_model(AsampleBody, b)
    sid, seq = b.get("sampling_session_id"), b.get("seq_id")
    if not isinstance(sid, str) or not isinstance(seq, int):
        raise InvalidRequest("asample: send sampling_session_id and seq_id (create a sampling client first)")
    run = svc.ownership.sampling_run(key, sid)
    request_id = f"{sid}:{seq}"
    model = svc.queries.find_model(run.base_model)
    req, targets, fingerprint = await asyncio.get_running_loop().run_in_executor(
        None, to_api.sample_request, b, body, seq, model
    )
    record = bool(b.get("record_stability_info"))
    sequence_ids = [f"{request_id}:{i}" for i in range(req.num_samples)]

    async def finish() -> Reply:
        try:
            out = await svc.sampling.sample(key, run.id, req, fingerprint)
        except SampleCancelled:
            raise Failure(f"sample {request_id} was cancelled (cancel_future)") from None
        if record:
            for seq_id, s in zip(sequence_ids, out.sequences):
                st.stability.record(key.id, seq_id, s.tokens, s.logprobs)
        plp = out.prompt_logprobs if b.get("prompt_logprobs") else None
        rows, k = len(req.prompt) - 1, req.prompt_alt_tokens_k
        alt = (
            None
            if not k
            else (
                shapes.tensor(np.asarray(out.prompt_alt_tokens, np.int64), (rows, k)),
                shapes.tensor(np.asarray(out.prompt_alt_logprobs, np.float32), (rows, k)),
            )
        )
        target = (
            None
            if targets is None
            else shapes.tensor(targets.values(out.target_prompt_logprobs), targets.shape, targets.csr)
        )
        return Reply(
            shapes.sample_response(
                [(s.tokens, s.logprobs, s.stop_reason) for s in out.sequences],
                plp,
                out.topk_prompt_logprobs,
                req.topk_prompt_logprobs,
                out.usage["cached_tokens"],
                sequence_topk=[s.top_logprobs for s in out.sequences],
                sequence_topk_k=req.options.top_logprobs,
                target_prompt_logprobs=target,
                prompt_alt_tokens=alt,
                weights_versions=[s.weights_versions for s in out.sequences],
            ),
            PROTOBUF,
        )

    st.futures.start(key.id, request_id, finish, fingerprint)
    return {"request_id": request_id, "sample_sequence_ids": sequence_ids}


@router.post("/cancel_future")
async def cancel_future(request: Request):
    """Stop the sample `request_id` (`<sampling_session_id>:<seq_id>`, as asample answered it). A
    sample that already finished, or any other request, is left as it is; the answer is empty."""
    svc, st, key = caller(request)
    b = await json_model(request, CancelBody)
    task = st.futures.get(key.id, b.request_id)
    sid, _, seq = b.request_id.rpartition(":")
    if task is None or task.done() or not sid or not seq.isdigit():
        return {}
    if not await svc.sampling.cancel(key, sid, f"tk-{seq}"):
        task.cancel()  # not running yet (queued, or its weights loading): stop waiting for it
    return {}

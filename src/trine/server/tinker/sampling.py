"""Tinker sampling: sampling sessions (= trine sampling runs), `asample`, and the sampler lookup.

`asample` answers a future at once with one `sample_sequence_ids` entry per sample
(`<request_id>:<i>`); the future runs `Service.sample`, so Tinker traffic shares the prefix cache
and the metering of every other front end: `prompt_cache_hit_tokens` is trine's `cached_tokens`
(a group of n samples prefills its prompt once). With `record_stability_info`, each sampled
sequence is kept under its sequence id for `stable_reinforce` (see `service.stability`). A
sampling session made by an inflight save follows the model's later inflight saves; its sequences
carry each token's weights version (proto.WEIGHTS_VERSIONS_FIELD).
`compute_logprobs` reaches here as a 1-token sample with prompt logprobs; like every prompt-logprob
request it never reads the prefix cache (0 hit tokens).
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from ...limits import MAX_SAMPLE_BYTES
from ...service import ApiKey, InvalidRequest, SamplingRunSpec, Service
from ..context import json_object
from ..params import parse_sample
from . import proto
from .futures import Reply
from .state import TinkerState, caller, to_tinker_path, to_trio_uri

router = APIRouter(prefix="/api/v1")


def sampling_session(svc: Service, st: TinkerState, key: ApiKey, session_id: str, seq: int,
                     base_model: str, source_uri: str) -> str:
    """The sampling run behind (session, sampling_session_seq_id), created once (retries reuse it)."""
    known = st.samplers.get((session_id, seq))
    if known is not None and svc.ownership.sampling_run(key, known):
        return known
    r = svc.runs.create_sampling_run(key, session_id, SamplingRunSpec(base_model, source_uri))
    st.samplers[(session_id, seq)] = r.id
    return r.id


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request):
    svc, st, key = caller(request)
    b = await json_object(request)
    if not isinstance(b.get("session_id"), str) or not isinstance(b.get("sampling_session_seq_id"), int):
        raise InvalidRequest("body: send session_id and sampling_session_seq_id")
    uri = to_trio_uri(b["model_path"]) if b.get("model_path") else ""
    if not uri and not b.get("base_model"):
        raise InvalidRequest("create_sampling_session: send base_model or model_path")
    sid = sampling_session(svc, st, key, b["session_id"], b["sampling_session_seq_id"],
                           b.get("base_model") or "", uri)
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request):
    svc, st, key = caller(request)
    r = svc.ownership.sampling_run(key, sampler_id)
    return {"sampler_id": r.id, "base_model": svc.queries.model(r.base_model).model_id,  # a tokenizer dir
            "model_path": to_tinker_path(r.source_checkpoint_uri) if r.source_checkpoint_uri else None}


_UNSUPPORTED = {"topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0, "target_prompt_logprobs": None}


@router.post("/asample")
async def asample(request: Request):
    svc, st, key = caller(request)
    b = await json_object(request, MAX_SAMPLE_BYTES, "the sample request must be a JSON object", empty_ok=False)
    for name, off in _UNSUPPORTED.items():
        if b.get(name, off) not in (off, None):
            raise InvalidRequest(f"{name}: not supported by trine; leave it unset")
    sid, seq = b.get("sampling_session_id"), b.get("seq_id")
    if not isinstance(sid, str) or not isinstance(seq, int):
        raise InvalidRequest("asample: send sampling_session_id and seq_id (create a sampling client first)")
    run = svc.ownership.sampling_run(key, sid)
    request_id = f"{sid}:{seq}"
    n = b.get("num_samples", 1)
    p = dict(b.get("sampling_params") or {})
    stop = p.pop("stop", None)
    no_stop = isinstance(stop, list) and not stop
    if isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
        p["stop_token_ids"] = stop
    elif stop:
        p["stop"] = stop
    with_prompt_logprobs = bool(b.get("prompt_logprobs")) or bool(b.get("topk_prompt_logprobs"))
    spec, _ = parse_sample({"request_id": f"tk-{seq}", "prompt": b.get("prompt"), "sampling_params": p,
                            "num_samples": n, "return_prompt_logprobs": with_prompt_logprobs,
                            "topk_prompt_logprobs": b.get("topk_prompt_logprobs") or 0},
                           stop_at_eos=not no_stop)  # Tinker: [] disables every stop, EOS included
    last_n = b.get("prompt_logprobs_last_n")
    if last_n is not None and not (isinstance(last_n, int) and 1 <= last_n <= len(spec.prompt) - 1):
        raise InvalidRequest(f"prompt_logprobs_last_n {last_n!r}: use 1 to len(prompt) - 1")
    record = bool(b.get("record_stability_info"))
    sequence_ids = [f"{request_id}:{i}" for i in range(spec.num_samples)]

    async def finish() -> Reply:
        out = await svc.sampling.sample(key, run.id, spec)
        if record:
            for seq_id, s in zip(sequence_ids, out.sequences):
                st.stability.record(key.id, seq_id, s.tokens, s.logprobs)
        plp = out.prompt_logprobs if b.get("prompt_logprobs") else None
        if plp is not None and last_n is not None:
            plp = [None] * (len(plp) - last_n) + list(plp[-last_n:])
        return Reply(proto.sample_response(
            [(s.tokens, s.logprobs, s.stop_reason) for s in out.sequences], plp,
            out.topk_prompt_logprobs, spec.topk_prompt_logprobs, out.usage["cached_tokens"],
            [s.weights_versions for s in out.sequences]),
            proto.PROTOBUF)
    st.futures.start(key.id, request_id, finish)
    return {"request_id": request_id, "sample_sequence_ids": sequence_ids}


"""Tinker answers: those that leave as protobuf (SDK 0.38 refuses JSON for them),
`ForwardBackwardOutput` and `SampleResponse`, with the message classes the `tinker` package ships;
and the JSON of a checkpoint and a training run (times in ISO 8601, UTC).

trine's one extension: a sampled sequence of an inflight sampler carries, as field
`WEIGHTS_VERSIONS_FIELD` of `SampledSequence` (int32 little-endian bytes, one per token, like
`tokens`), the inflight weights version that produced each token. Stock clients ignore the
unknown field.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

import numpy as np

from ...engine.api import FULL_RANK
from ...service import Checkpoint
from ...service.labels import as_metadata
from ...uris import to_tinker_path
from .bodies import pb

WEIGHTS_VERSIONS_FIELD = 1000  # in SampledSequence: trine's per-token weights versions


def forward_backward_output(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord holding every datum's `logprobs` (float32)."""
    flat = (
        np.concatenate([np.asarray(lp, dtype=np.float32) for lp in logprobs])
        if logprobs
        else np.zeros(0, np.float32)
    )
    offsets = np.cumsum([0] + [4 * len(lp) for lp in logprobs]).astype(np.int64)
    record = pb.ArrayRecord(
        type_tag="LossFnOutput",
        num_datums=len(logprobs),
        fields={
            "logprobs": pb.BatchedTensor(
                data=flat.tobytes(), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
            )
        },
    )
    out = pb.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[record],
        metrics={k: float(v) for k, v in metrics.items()},
    )
    return out.SerializeToString()


def _topk(rows: list, k: int) -> "pb.TopkLogprobs":
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), -99999.0, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = int(tok), float(lp) if math.isfinite(lp) else -99999.0
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def tensor(
    values: np.ndarray, shape: tuple[int, ...], csr: tuple[list[int], list[int]] | None = None
) -> "pb.Tensor":
    """A proto Tensor of float32 or int64 `values`: dense in row-major order, or the values of a
    sparse CSR tensor with the (crow, col) indices `csr`."""
    dtype = pb.DTYPE_INT64 if values.dtype.kind in "iu" else pb.DTYPE_FLOAT32
    raw = values.astype(np.int64 if dtype == pb.DTYPE_INT64 else np.float32).tobytes()
    if csr is None:
        return pb.Tensor(dense=raw, dtype=dtype, shape=list(shape))
    crow, col = (np.asarray(x, dtype=np.int64).tobytes() for x in csr)
    return pb.Tensor(
        sparse_csr=pb.SparseCsr(values=raw, crow_indices=crow, col_indices=col),
        dtype=dtype,
        shape=list(shape),
    )


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int32_field(number: int, values: list[int]) -> bytes:
    """A length-delimited protobuf field holding int32 little-endian bytes."""
    data = np.asarray(values, dtype=np.int32).tobytes()
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def sample_response(
    sequences: list[tuple[list[int], list[float] | None, str]],
    prompt_logprobs: list[float | None] | None,
    topk_prompt: list | None,
    topk_k: int,
    cache_hit_tokens: int,
    *,
    sequence_topk: list[list | None] | None = None,
    sequence_topk_k: int = 0,
    target_prompt_logprobs: "pb.Tensor | None" = None,
    prompt_alt_tokens: "tuple[pb.Tensor, pb.Tensor] | None" = None,
    weights_versions: list[list[int] | None] | None = None,
) -> bytes:
    """A SampleResponse. `sequences`: (tokens, logprobs, stop_reason "stop" | "length");
    `sequence_topk`: each sequence's top logprobs per token, sent `sequence_topk_k` wide (dense,
    with the client's sentinels where a row is shorter); `weights_versions`: per sequence, its tokens'
    inflight weights versions (None: fixed weights)."""
    seqs = []
    for i, (tokens, lps, stop) in enumerate(sequences):
        s = pb.SampledSequence(
            stop_reason=pb.STOP_REASON_LENGTH if stop == "length" else pb.STOP_REASON_STOP,
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
        )
        if lps is not None:
            s.logprobs = np.asarray(lps, dtype=np.float32).tobytes()
        if sequence_topk is not None and sequence_topk_k > 0:
            s.topk_sampled_logprobs.CopyFrom(_topk(sequence_topk[i] or [], sequence_topk_k))
        if weights_versions and weights_versions[i] is not None:  # kept as an unknown field
            s.MergeFromString(_int32_field(WEIGHTS_VERSIONS_FIELD, weights_versions[i]))
        seqs.append(s)
    out = pb.SampleResponse(sequences=seqs, prompt_cache_hit_tokens=int(cache_hit_tokens))
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(
            [math.nan if x is None else x for x in prompt_logprobs], dtype=np.float32
        ).tobytes()
    if topk_prompt is not None and topk_k > 0:
        out.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt, topk_k))
    if target_prompt_logprobs is not None:
        out.target_prompt_logprobs.CopyFrom(target_prompt_logprobs)
    if prompt_alt_tokens is not None:
        out.prompt_alt_tokens.CopyFrom(
            pb.PromptAltTokens(tokens=prompt_alt_tokens[0], logprobs=prompt_alt_tokens[1])
        )
    return out.SerializeToString()


# ---------------------------------------------------------------------------- JSON
def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat()


def checkpoint_json(c: Checkpoint) -> dict:
    return {
        "checkpoint_id": to_tinker_path(c.uri).split("/", 3)[3],
        "tinker_path": to_tinker_path(c.uri),
        "checkpoint_type": {"TRAINING": "training", "SAMPLER": "sampler"}.get(c.kind, "external"),
        "time": iso(c.created_at),
        "size_bytes": c.size_bytes,
        "public": bool(c.public),
        "expires_at": iso(c.expires_at),
    }


def training_run_json(svc, key, r) -> dict:
    cks, _ = svc.queries.checkpoints(key, training_run_id=r.id)
    last = {
        kind: max((c for c in cks if c.kind == kind), key=lambda c: c.created_at, default=None)
        for kind in ("TRAINING", "SAMPLER")
    }
    return {
        "training_run_id": r.id,
        "base_model": r.base_model,
        "model_owner": key.name,
        "is_lora": r.lora_rank != FULL_RANK,  # rank 0: full fine-tuning
        "corrupted": r.status == "INTERRUPTED",
        "lora_rank": r.lora_rank,
        "last_request_time": iso(r.updated_at),
        "last_checkpoint": checkpoint_json(last["TRAINING"]) if last["TRAINING"] else None,
        "last_sampler_checkpoint": checkpoint_json(last["SAMPLER"]) if last["SAMPLER"] else None,
        "user_metadata": as_metadata(r) or None,
    }

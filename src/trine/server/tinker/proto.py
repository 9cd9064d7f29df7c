"""Tinker protobuf bodies <-> plain values, with the message classes the `tinker` package ships.

`forward_backward` requests arrive as `tinker_public_pb2.ForwardBackwardRequest` (optionally zstd);
`ForwardBackwardOutput` and `SampleResponse` results leave as protobuf because SDK 0.38 refuses
JSON for them. Every decoding error is an InvalidRequest whose message names the field.

trine's one extension: a sampled sequence of an inflight sampler carries, as field
`WEIGHTS_VERSIONS_FIELD` of `SampledSequence` (int32 little-endian bytes, one per token, like
`tokens`), the inflight weights version that produced each token. Stock clients ignore the
unknown field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...engine.api import MAX_INPUT_ELEMENTS, LossTensor, TrainDatum
from ...service import InvalidRequest

try:  # the message classes ship with the official client (a dependency of trine's server)
    from tinker.proto import tinker_public_pb2 as pb
except ImportError:  # pragma: no cover - the Tinker front end is then unavailable
    pb = None

PROTOBUF = "application/x-protobuf"
WEIGHTS_VERSIONS_FIELD = 1000  # in SampledSequence: trine's per-token weights versions
MAX_DECOMPRESSED_BYTES = 256 << 20
_NUMPY = {1: np.float32, 2: np.int64, 3: np.int32}  # proto DType -> numpy (bf16 handled apart)
FLOAT_INPUTS = ("weights", "advantages", "logprobs", "sequence_ratio_mask")
KNOWN_INPUTS = ("target_tokens",) + FLOAT_INPUTS  # anything else is refused, never dropped silently


@dataclass
class Span:
    """One provenance run over a datum's loss rows: `length` positions that are positions
    [offset, offset + length) of sequence `sequence_id`'s sampled tokens (sampled=True) or of its
    request's prompt (sampled=False)."""

    sequence_id: str
    offset: int
    length: int
    sampled: bool


@dataclass
class ForwardBackwardBody:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict
    forward_only: bool
    data: list[TrainDatum]
    spans: list[list[Span]] = field(default_factory=list)  # per datum; [] = none sent


def decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding.lower() == "identity":
        return body
    if encoding.lower() != "zstd":
        raise InvalidRequest(
            f"Content-Encoding {encoding!r} is not supported; send zstd or nothing",
            code="invalid_request_body",
        )
    import zstandard

    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_DECOMPRESSED_BYTES)
    except zstandard.ZstdError as e:
        raise InvalidRequest(f"body: not valid zstd data ({e})", code="invalid_request_body") from None


def _tensor(t, where: str, size: int) -> np.ndarray:
    """A proto Tensor of `size` values as a flat numpy array (sparse CSR densified with zeros). The
    shape is checked against `size` before anything is allocated."""
    shape = list(t.shape)
    if any(d < 0 for d in shape) or (shape and math.prod(shape) != size):
        raise InvalidRequest(f"{where}: shape {shape} does not hold {size} values (one per input token)")
    if t.dtype == 4:  # bfloat16: the upper half of a float32
        dtype = np.uint16
    elif t.dtype in _NUMPY:
        dtype = _NUMPY[t.dtype]
    else:
        raise InvalidRequest(
            f"{where}: dtype {t.dtype} is not a tensor dtype (float32, int64, int32, bfloat16)"
        )

    def read(raw: bytes, dt, what: str) -> np.ndarray:
        if len(raw) % np.dtype(dt).itemsize:
            raise InvalidRequest(f"{where}.{what}: {len(raw)} bytes is not a whole number of values")
        return np.frombuffer(raw, dtype=dt)

    if t.HasField("sparse_csr"):
        if len(shape) != 2:
            raise InvalidRequest(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
        values = read(t.sparse_csr.values, dtype, "sparse_csr.values")
        crow = read(t.sparse_csr.crow_indices, np.int64, "sparse_csr.crow_indices")
        col = read(t.sparse_csr.col_indices, np.int64, "sparse_csr.col_indices")
        rows, cols = shape
        if (
            len(crow) != rows + 1
            or len(col) != len(values)
            or (len(col) and (col.min() < 0 or col.max() >= cols))
            or crow[0] != 0
            or crow[-1] != len(values)
            or np.any(np.diff(crow) < 0)
        ):
            raise InvalidRequest(f"{where}: the sparse CSR indices do not describe a {rows}x{cols} tensor")
        dense = np.zeros((rows, cols), dtype=dtype)
        row_of = np.repeat(np.arange(rows), np.diff(crow))
        dense[row_of, col] = values
        arr = dense.reshape(-1)
    else:
        arr = read(t.dense, dtype, "dense")
    if t.dtype == 4:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def _tokens(chunks, where: str) -> list[int]:
    out: list[int] = []
    for k, c in enumerate(chunks):
        kind = c.WhichOneof("chunk")
        if kind == "encoded_text":
            raw = c.encoded_text.tokens
            if len(raw) % 4:
                raise InvalidRequest(f"{where}.model_input[{k}].tokens: not int32 values")
            out.extend(np.frombuffer(raw, dtype=np.int32).tolist())
        else:
            raise InvalidRequest(
                f"{where}.model_input[{k}]: {kind or 'image/audio'} chunks are not "
                "supported; the served models are text-only: send encoded_text chunks",
                code="not_supported",
            )
    return out


def _spans(spans, where: str) -> list[Span]:
    out = []
    for k, s in enumerate(spans):
        arm = s.WhichOneof("span")
        if arm not in ("prompt_tokens", "sampled_tokens"):
            raise InvalidRequest(f"{where}[{k}]: a provenance span must be prompt_tokens or sampled_tokens")
        run = getattr(s, arm)
        if run.offset < 0 or run.length < 0:
            raise InvalidRequest(f"{where}[{k}]: offset {run.offset} and length {run.length} must be >= 0")
        out.append(Span(run.sequence_id, int(run.offset), int(run.length), arm == "sampled_tokens"))
    return out


def _loss_tensor(t, where: str, rank: int) -> LossTensor:
    """A custom loss input at its own shape (an empty shape: a scalar for a rank-0 input, else a
    vector), bounded before anything is allocated."""
    shape = list(t.shape)
    if len(shape) > 2 or any(d < 0 for d in shape) or math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise InvalidRequest(
            f"{where}: shape {shape[:4]}: at most 2 dimensions and {MAX_INPUT_ELEMENTS} values"
        )
    arr = _tensor(t, where, math.prod(shape))
    if arr.size > MAX_INPUT_ELEMENTS:
        raise InvalidRequest(
            f"{where}: {arr.size} values; a custom loss input holds at most {MAX_INPUT_ELEMENTS}"
        )
    if not shape:
        shape = [] if rank == 0 and arr.size == 1 else [arr.size]
    if arr.dtype.kind in "iu":
        return LossTensor(tuple(shape), arr.astype(np.int64).tolist(), "int64")
    return LossTensor(tuple(shape), arr.astype(np.float64).tolist(), "float32")


def loss_config(msg) -> dict:
    config: dict = {}
    for k, v in msg.loss_fn_config.items():
        config[k] = float(v)
    for k, v in msg.loss_fn_config_v2.items():  # preferred when set
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return config


def decode_forward_backward(body: bytes):
    """The ForwardBackwardRequest message (its model_id and seq_id are then known)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # DecodeError and friends
        raise InvalidRequest(
            f"body: not a ForwardBackwardRequest protobuf ({type(e).__name__})", code="invalid_request_body"
        ) from None
    if not msg.model_id:
        raise InvalidRequest("model_id: empty; send the id create_model returned")
    return msg


def forward_backward_body(msg, custom: dict[str, int] | None = None) -> ForwardBackwardBody:
    """The request's content as plain values; validates shapes (one value per input token) and dtypes.

    `custom`: the inputs (name -> rank) of the custom loss the request names. Those inputs keep
    their own shapes; the others, apart from target_tokens, are the client's and are not read."""
    if not msg.data:
        raise InvalidRequest("data: the batch is empty; send at least one Datum")
    data, spans = [], []
    for i, d in enumerate(msg.data):
        where = f"data[{i}]"
        tokens = _tokens(d.model_input, where)
        n = len(tokens)
        if n == 0:
            raise InvalidRequest(f"{where}.model_input is empty")
        inputs, custom_inputs = {}, {}
        for name, t in d.loss_fn_inputs.items():
            if custom is not None and name in custom:  # target_tokens too, if the loss reads it
                custom_inputs[name] = _loss_tensor(t, f"{where}.loss_fn_inputs[{name!r}]", custom[name])
            if custom is not None and name != "target_tokens":
                continue
            if name not in KNOWN_INPUTS:
                hint = "; give clip thresholds in loss_fn_config" if "threshold" in name else ""
                raise InvalidRequest(
                    f"{where}.loss_fn_inputs[{name!r}] is not a loss input trine uses "
                    f"({', '.join(KNOWN_INPUTS)}){hint}"
                )
            arr = _tensor(t, f"{where}.loss_fn_inputs[{name!r}]", n)
            if arr.size != n:
                raise InvalidRequest(
                    f"{where}.loss_fn_inputs[{name!r}] has {arr.size} values; it needs one "
                    f"per input token ({n})"
                )
            inputs[name] = arr
        if "target_tokens" not in inputs:
            raise InvalidRequest(f"{where}.loss_fn_inputs['target_tokens'] is required")
        targets = inputs["target_tokens"]
        if targets.dtype.kind == "f":
            if (
                not np.all(np.isfinite(targets))
                or np.any(targets != np.round(targets))
                or np.any(np.abs(targets) >= 2.0**62)
            ):
                raise InvalidRequest(f"{where}.loss_fn_inputs['target_tokens'] must hold integers")
        floats = {k: [float(x) for x in inputs[k].astype(np.float64)] for k in FLOAT_INPUTS if k in inputs}
        for k, vs in floats.items():
            if not all(math.isfinite(x) for x in vs):
                raise InvalidRequest(f"{where}.loss_fn_inputs[{k!r}] holds NaN or infinite values")
        data.append(
            TrainDatum(
                tokens=tokens,
                target_tokens=[int(x) for x in targets.astype(np.int64)],
                weights=floats.get("weights"),
                logprobs=floats.get("logprobs"),
                advantages=floats.get("advantages"),
                sequence_ratio_mask=floats.get("sequence_ratio_mask"),
                custom_inputs=custom_inputs if custom is not None else None,
            )
        )
        runs = _spans(d.loss_fn_input_spans, f"{where}.loss_fn_input_spans")
        if runs and sum(s.length for s in runs) != n:
            raise InvalidRequest(
                f"{where}.loss_fn_input_spans cover {sum(s.length for s in runs)} "
                f"positions; they must tile all {n} loss rows"
            )
        spans.append(runs)
    return ForwardBackwardBody(
        msg.model_id,
        int(msg.seq_id),
        msg.loss_fn or "cross_entropy",
        loss_config(msg),
        bool(msg.forward_only),
        data,
        spans,
    )


# ---------------------------------------------------------------------------- results
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

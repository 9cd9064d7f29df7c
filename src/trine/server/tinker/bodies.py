"""Tinker request bodies, as the official `tinker` 0.38 client sends them: the JSON bodies of every
call (pydantic models whose errors name the field; server/http/context.py turns them into 400s),
and the `forward_backward` protobuf (`tinker_public_pb2.ForwardBackwardRequest`, optionally zstd),
with the message classes the `tinker` package ships. to_api.py turns them into the engine's
vocabulary; shapes.py writes the answers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ...engine.api import DIMUON
from ...limits import MAX_SAMPLES_PER_REQUEST, MAX_TOPK_PROMPT_LOGPROBS
from ...service import InvalidRequest
from ..http.bounds import Count, Int64, Seed, SeqId, TtlSeconds

try:  # the message classes ship with the official client (a dependency of trine's server)
    from tinker.proto import tinker_public_pb2 as pb
except ImportError:  # pragma: no cover - the Tinker front end is then unavailable
    pb = None

PROTOBUF = "application/x-protobuf"

MAX_DECOMPRESSED_BYTES = 256 << 20


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


# ---------------------------------------------------------------------------- JSON bodies
class Body(BaseModel):
    """A JSON body: the official client sends JSON types (no coercion: no "0" for 0, no "yes" for
    true); unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class StrictBody(BaseModel):
    """A JSON body whose unknown keys are refused, naming them."""

    model_config = ConfigDict(extra="forbid", strict=True)


class CreateSessionBody(Body):
    sdk_version: str = ""
    tags: list[str] = []
    user_metadata: dict = {}
    display_name: str = ""


class SessionBody(Body):
    session_id: str


class FinishReason(Body):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishBody(Body):
    reason: FinishReason = FinishReason()


class StatusQuery(StrictBody):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(default=None, min_length=1)


class SearchOwner(StrictBody):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = None


class SearchCursor(BaseModel):
    model_config = ConfigDict(extra="ignore")
    last_created_at: str
    last_session_id: str


class SessionSearchBody(StrictBody):
    """Tinker's SessionSearchRequest."""

    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = Field(default=None, min_length=1)
    owner: SearchOwner = SearchOwner()
    statuses: list[StatusQuery] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SearchCursor | None = None


class WeightsInfoBody(Body):
    tinker_path: str


class TtlBody(Body):
    ttl_seconds: int | None  # null: never expires (range checked by the service)


class LoraBody(Body):
    rank: int = 32
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelBody(Body):
    session_id: str
    model_seq_id: Count
    base_model: str
    lora_config: LoraBody | None = None
    optimizer_config: dict | None = None
    user_metadata: dict | None = None  # `name` and comma-separated `tags` label the run


class ModelCall(Body):
    model_id: str
    seq_id: SeqId | None = None


class OptimStepBody(ModelCall):
    adam_params: dict | None = None  # validated as trine.types.AdamParams (same fields and defaults)
    optimizer_params: dict | None = None  # another family's settings, by `type`: DimuonParams


class DimuonBody(BaseModel):
    """Tinker's DimuonParams; `damping` and `rank_lr_correction_exponent` are the later clients'
    (their defaults apply when a 0.38 client leaves them out)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no "0.1" for 0.1
    type: str = DIMUON
    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9
    damping: float = 1e-4
    rank_lr_correction_exponent: float = 0.175


class SaveBody(ModelCall):
    path: str | None = None
    ttl_seconds: TtlSeconds | None = None
    overwrite: bool = False
    sampling_session_seq_id: Count | None = None
    kind: str = "snapshot"  # save_weights_for_sampler: SamplingClientKind


class LoadBody(Body):
    model_id: str | None = None
    seq_id: SeqId | None = None
    session_id: str | None = None
    model_seq_id: Count | None = None
    base_model: str | None = None
    path: str
    optimizer: bool = False
    optimizer_config: dict | None = None


class SaveExternalBody(ModelCall):
    path: str | None = None
    ttl_seconds: TtlSeconds | None = None
    age_encryption_recipients: list[str] | None = None


class SamplingSessionBody(BaseModel):
    """The types of a `create_sampling_session` body."""

    model_config = ConfigDict(extra="allow", strict=True)  # no "0" for 0, no "yes" for true
    session_id: str | None = None
    sampling_session_seq_id: Int64 | None = None
    base_model: str | None = None
    model_path: str | None = None


class AsampleBody(BaseModel):
    """The types of an `asample` body's top-level fields, and the ranges of its counts (the other
    values are checked where used)."""

    model_config = ConfigDict(extra="allow", strict=True)  # no "0" for 0, no "yes" for true
    sampling_session_id: str | None = None
    seq_id: Int64 | None = None
    num_samples: int = Field(default=1, ge=1, le=MAX_SAMPLES_PER_REQUEST)
    prompt: dict | None = None
    sampling_params: dict | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)
    prompt_logprobs_last_n: Int64 | None = None
    record_stability_info: bool | None = None


class CancelBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    request_id: str


class CreateCustomLossBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    session_id: str
    custom_loss_seq_id: Count
    name: str
    inputs: list
    graph: dict
    type: str = "create_custom_loss"

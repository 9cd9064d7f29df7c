"""PyTRIO request bodies, as the official `pytrio` 0.2.9 client sends them (docs/architecture.md,
"Front ends"): the control plane's JSON bodies, the actor plane's sample body (JSON) and event
envelope and payloads (MessagePack), with trine's extensions. Tinker's front end shares the model
input, sampling params and Adam params bodies.

Pydantic models only: unknown keys are ignored (the client never sends any) and every error names
the field (server/http/context.py turns them into 400s); to_api.py turns them into the engine's
vocabulary.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...engine.api import PromptImage
from ...limits import MAX_REQUEST_ID_CHARS, MAX_SAMPLES_PER_REQUEST, MAX_TOPK_PROMPT_LOGPROBS
from ...service import InvalidRequest
from ...types import AdamParams, ImageChunk  # an image: standard base64 in JSON, bytes in MessagePack
from ..http.bounds import Count, FiniteFloat, Int64, Positive, Seed, TtlSeconds, sampling_field


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextChunk(Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[Int64]


class PointerChunk(Body):
    """An image by location (Tinker's `image_asset_pointer`) or audio (`dmel`): refused by name."""

    type: Literal["image_asset_pointer", "dmel"]


class ModelInputBody(Body):
    chunks: list[Annotated[TextChunk | ImageChunk | PointerChunk, Field(discriminator="type")]] = Field(
        min_length=1
    )

    def pieces(self, field: str) -> list[list[int] | PromptImage]:
        """The chunks in order as `read_model_input` takes them (to_api.py reads them for a model)."""
        out: list[list[int] | PromptImage] = []
        for k, c in enumerate(self.chunks):
            where = f"{field}.chunks.{k}"
            if isinstance(c, PointerChunk):
                what = "audio (dmel) chunks are" if c.type == "dmel" else "images by location are"
                raise InvalidRequest(
                    f"{where}: {what} not supported; send token ids (encoded_text) and images by "
                    "their bytes (image chunks): trine fetches nothing",
                    code="not_supported",
                )
            out.append(
                c.tokens
                if isinstance(c, TextChunk)
                else PromptImage(c.data, c.format, c.expected_tokens, where)
            )
        return out


class SamplingParamsBody(Body):
    max_tokens: Positive
    temperature: FiniteFloat = sampling_field("temperature", 1.0)
    top_k: Int64 = -1
    top_p: float = sampling_field("top_p", 1.0)
    seed: Seed | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[Int64] | None = None


class TrioSamplingParamsBody(SamplingParamsBody):
    """PyTRIO's sampling params with trine's extensions (vLLM's semantics, off by default; Tinker's
    plane keeps Tinker's fields). logit_bias: token id (a string, as JSON keys are) -> bias."""

    presence_penalty: float = sampling_field("presence_penalty", 0.0)
    frequency_penalty: float = sampling_field("frequency_penalty", 0.0)
    repetition_penalty: FiniteFloat = sampling_field("repetition_penalty", 1.0)
    min_p: float = sampling_field("min_p", 0.0)
    logit_bias: dict[int, FiniteFloat] | None = None


class SampleBody(Body):
    request_id: str = Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    prompt: ModelInputBody
    sampling_params: TrioSamplingParamsBody
    num_samples: int = Field(default=1, ge=1, le=MAX_SAMPLES_PER_REQUEST)
    return_text: bool = True
    return_token_logprobs: bool = True
    return_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)


class OptimStepPayload(Body):
    adam_params: AdamParams


# ---------------------------------------------------------------------------- events (actor plane)
class Metadata(Body):
    index: Positive
    step: Count = 0
    run_id: str = ""


class Envelope(Body):
    version: Int64 = 1
    event_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    type: str
    metadata: Metadata
    payload: dict[str, Any] = Field(default_factory=dict)


class Lora(Body):
    rank: Count  # 0 only for a full fine-tuning run (made so when it was created)
    seed: Seed | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class InitRunPayload(Body):
    base_model: str = ""
    lora_config: Lora
    checkpoint_uri: str | None = None
    load_optimizer: bool = False


class CustomInput(Body):
    """One custom loss input of a datum (trine extension): row-major values of `shape`."""

    shape: list[Count] = Field(max_length=2)
    values: list[float] | list[Int64]
    dtype: Literal["float32", "int64"] = "float32"


class Datum(Body):
    model_input: ModelInputBody
    target_ids: list[Int64] = Field(min_length=1)
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    sequence_ratio_mask: list[float] | None = None  # gspo (trine extension; pytrio never sends it)
    custom_inputs: dict[str, CustomInput] | None = None  # a custom loss's (trine extension)


class LossSpec(Body):
    type: str
    config: dict[str, Any] = Field(default_factory=dict)


class GradientAccumulation(Body):
    total_samples: Positive
    total_active_tokens: Count
    total_advantage_tokens: Count


class ForwardPayload(Body):
    data: list[Datum] = Field(min_length=1)
    auto_shift: bool = False
    loss: LossSpec
    gradient_accumulation: GradientAccumulation | None = None


class SavePayload(Body):
    name: str
    ttl_seconds: TtlSeconds | None = None
    overwrite: bool = False
    visibility: str = "WORKSPACE"
    kind: Literal["snapshot", "inflight"] = (
        "snapshot"  # trine's extension (save_weights); stock clients omit it
    )


class EndRunPayload(Body):
    reason: str = ""


# ---------------------------------------------------------------------------- control plane
class SessionCreate(Body):
    sdk_version: str = ""
    user_metadata: dict[str, Any] | None = None
    name: str = ""  # trine's own: runs made in the session take these labels (see service/labels.py)
    tags: list[str] = []


class SessionClose(Body):
    status: str = Field(default="ENDED", pattern="^(ENDED|CANCELLED)$")


class TrainingRunCreate(Body):
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
    # trine's own (the SDK's full=True): full-parameter fine-tuning, which PyTRIO's client never asks
    full_fine_tuning: bool = False
    trainable_token_indices: list[Int64] | None = None


class TrainingRunUpdate(Body):
    source_checkpoint_uri: str = Field(min_length=1)
    restore_optimizer: bool = False


class SamplingRunCreate(Body):
    base_model: str = ""
    source_checkpoint_uri: str = ""

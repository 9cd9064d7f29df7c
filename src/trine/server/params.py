"""PyTRIO request bodies parsed into the engine's vocabulary: a sample request (JSON) and Adam
parameters (which Tinker's front end shares).

Unknown keys are ignored; every error is an InvalidRequest whose message names the field
(`sampling_params.top_k: ...`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.api import AdamConfig, OptimStep, SampleRequest, SamplingOptions
from ..limits import MAX_REQUEST_ID_CHARS, MAX_SAMPLES_PER_REQUEST, MAX_TOPK_PROMPT_LOGPROBS
from ..service import InvalidRequest
from ..types import AdamParams
from .bounds import FiniteFloat, Int64, Positive, Seed
from .context import parse_model
from .shapes import SampleShape


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextChunk(Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[Int64]


class ImageChunk(Body):
    """An image or audio (`dmel`) chunk: parsed only to be refused by name."""

    type: Literal["image", "image_asset_pointer", "dmel"]
    format: str = ""


class ModelInputBody(Body):
    chunks: list[Annotated[TextChunk | ImageChunk, Field(discriminator="type")]] = Field(min_length=1)

    def tokens(self, field: str) -> list[int]:
        if any(isinstance(c, ImageChunk) for c in self.chunks):
            raise InvalidRequest(
                f"{field}: image and audio chunks are not supported; the served models are "
                "text-only: send encoded_text chunks (token ids)",
                code="not_supported",
            )
        return [t for c in self.chunks for t in c.tokens]


class SamplingParamsBody(Body):
    max_tokens: Positive
    temperature: FiniteFloat = Field(default=1.0, ge=0)
    top_k: Int64 = -1
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: Seed | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[Int64] | None = None


class TrioSamplingParamsBody(SamplingParamsBody):
    """PyTRIO's sampling params with trine's extensions (vLLM's semantics, off by default; Tinker's
    plane keeps Tinker's fields). logit_bias: token id (a string, as JSON keys are) -> bias."""

    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: FiniteFloat = Field(default=1.0, gt=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
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


def parse_sample(body: dict, *, stop_at_eos: bool = True) -> tuple[SampleRequest, SampleShape, str]:
    """The sample request of a sample body (the engine checks it against the model), the shape its
    answer takes, and the body's fingerprint (a retry must repeat it)."""
    b = parse_model(SampleBody, body)
    options = sampling_options(b.sampling_params, stop_at_eos=stop_at_eos)
    compute_logprobs = b.return_prompt_logprobs and not b.return_token_logprobs
    req = SampleRequest(
        request_id=b.request_id,
        prompt=b.prompt.tokens("prompt"),
        options=options,
        num_samples=b.num_samples,
        prompt_logprobs=b.return_prompt_logprobs,
        topk_prompt_logprobs=b.topk_prompt_logprobs,
        generate=not compute_logprobs,
    )
    fingerprint = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return req, SampleShape(b.return_text, b.return_token_logprobs), fingerprint


def sampling_options(
    p: SamplingParamsBody, *, stop_at_eos: bool = True, top_logprobs: int = 0
) -> SamplingOptions:
    """The engine's sampling options of a `sampling_params` body (Tinker's, or PyTRIO's with trine's
    extensions)."""
    if p.top_k != -1 and p.top_k < 1:
        raise InvalidRequest(f"sampling_params.top_k {p.top_k}: use -1 (off) or a positive integer")
    stop = tuple([p.stop] if isinstance(p.stop, str) else p.stop or ())
    return SamplingOptions(
        max_tokens=p.max_tokens,
        temperature=float(p.temperature),
        top_p=float(p.top_p),
        top_k=p.top_k,
        seed=p.seed,
        stop_strings=stop,
        stop_token_ids=tuple(p.stop_token_ids or ()),
        stop_at_eos=stop_at_eos,
        top_logprobs=top_logprobs,
        presence_penalty=float(getattr(p, "presence_penalty", 0.0)),
        frequency_penalty=float(getattr(p, "frequency_penalty", 0.0)),
        repetition_penalty=float(getattr(p, "repetition_penalty", 1.0)),
        min_p=float(getattr(p, "min_p", 0.0)),
        logit_bias=tuple(sorted((getattr(p, "logit_bias", None) or {}).items())),
    )


class _Optim(Body):
    adam_params: AdamParams


def optim_step(body: dict, prefix: str = "") -> OptimStep:
    """The optim step of `{"adam_params": {...}}` (trine.types.AdamParams: its fields, defaults and
    bounds)."""
    a = parse_model(_Optim, body, prefix).adam_params
    return OptimStep(
        AdamConfig(
            learning_rate=a.learning_rate,
            beta1=a.beta1,
            beta2=a.beta2,
            eps=a.eps,
            weight_decay=a.weight_decay,
            grad_clip_norm=a.grad_clip_norm,
        )
    )

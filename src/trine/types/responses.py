"""What the clients' futures resolve to. Same names and fields as PyTRIO, plus trine's `usage`
(tokens by phase, see `Usage`) and, for training events, the clock `cycle` that ran them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import BaseModel
from .params import LoraConfig
from .tensor import TensorData
from .usage import Usage

LossFnOutput = dict[str, TensorData]


class ForwardBackwardOutput(BaseModel):
    """One logical forward / forward_backward call: per-datum outputs in input order
    (`{"logprobs": TensorData[N]}`), and metrics `loss_sum`, `loss_mean`, `token_count`."""

    loss_fn_outputs: list[LossFnOutput]
    metrics: dict[str, float]
    debug: dict[str, object] = Field(default_factory=dict)
    usage: Usage = Field(default_factory=Usage)
    cycle: int | None = None  # the last clock cycle among this call's chunks


class OptimStepResponse(BaseModel):
    metrics: dict[str, float]
    cycle: int | None = None


class SaveWeightsResponse(BaseModel):
    path: str
    model: str
    size: int
    type: Literal["save-checkpoint"] = "save-checkpoint"


class SaveWeightsForSamplerResponse(BaseModel):
    path: str
    model: str
    size: int
    type: Literal["save-weights"] = "save-weights"


class SampleSequence(BaseModel):
    stop_reason: str
    tokens: list[int]
    text: str | None = None
    logprobs: list[float]  # one per token
    # inflight samplers: per token, the version of the run's inflight weights that produced it
    # (1 = its first inflight save, ...); None for fixed weights
    weights_versions: list[int] | None = None


SampledSequence = SampleSequence


class SampleResponse(BaseModel):
    sequences: list[SampleSequence]
    prompt_logprobs: list[float | None] = Field(default_factory=list)  # entry 0 is None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] = Field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    type: Literal["sample"] = "sample"
    usage: Usage = Field(default_factory=Usage)


class PromptLogprobs(list):
    """What compute_logprobs returns: a list of len(prompt) logprobs (entry 0 is None),
    carrying the request's `usage` as an attribute."""

    def __init__(self, values=(), usage: Usage | None = None):
        super().__init__(values)
        self.usage = usage or Usage()


class GetInfoResponse(BaseModel):
    """A training client's run: ids, base model and LoRA configuration."""

    training_run_id: str
    model_id: str  # the server's model id (tokenizer id)
    base_model: str  # the model alias, as sampling runs name it
    lora_config: LoraConfig
    is_lora: bool = True


class ModelOperationCapabilities(BaseModel):
    available: bool
    max_batch_size: int | None
    max_tokens_per_request: int | None
    max_seq_len: int | None


class SupportedModel(BaseModel):
    model_name: str
    max_context_length: int | None
    training: ModelOperationCapabilities
    sampling: ModelOperationCapabilities
    alias: str | None = None  # trine: the short name accepted as base_model
    pricing: dict | None = None  # trine: price per million tokens by phase (the server's rate card)


class GetServerCapabilitiesResponse(BaseModel):
    supported_models: list[SupportedModel]

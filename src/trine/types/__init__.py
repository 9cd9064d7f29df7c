"""trine's public data types (no HTTP, no torch): the same names and fields as PyTRIO's."""

from .datum import Datum
from .model_input import EncodedTextChunk, ImageChunk, ModelInput, ModelInputChunk
from .params import AdamParams, LoraConfig, SamplingParams
from .responses import (
    ForwardBackwardOutput,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    LossFnOutput,
    ModelOperationCapabilities,
    OptimStepResponse,
    PromptLogprobs,
    SampledSequence,
    SampleResponse,
    SampleSequence,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    SupportedModel,
)
from .rest import (
    Checkpoint,
    CheckpointArchiveUrlResponse,
    CheckpointDownloadResult,
    CheckpointDownloadSource,
    CheckpointsListResponse,
    Cursor,
    GetSamplerResponse,
    GetSessionResponse,
    ListSessionsResponse,
    TrainingRun,
    TrainingRunsResponse,
)
from .tensor import TensorData
from .usage import Usage

__all__ = [
    "AdamParams",
    "Checkpoint",
    "CheckpointArchiveUrlResponse",
    "CheckpointDownloadResult",
    "CheckpointDownloadSource",
    "CheckpointsListResponse",
    "Cursor",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "GetSamplerResponse",
    "GetServerCapabilitiesResponse",
    "GetSessionResponse",
    "ImageChunk",
    "ListSessionsResponse",
    "LoraConfig",
    "LossFnOutput",
    "ModelInput",
    "ModelInputChunk",
    "ModelOperationCapabilities",
    "OptimStepResponse",
    "PromptLogprobs",
    "SampleResponse",
    "SampleSequence",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "SupportedModel",
    "TensorData",
    "TrainingRun",
    "TrainingRunsResponse",
    "Usage",
]

"""trine: a self-hosted engine for LLM post-training (the PyTRIO API).

`import trine as trio` ports PyTRIO code by its import line: the clients, futures and types
have PyTRIO's names, signatures and defaults. Importing trine loads neither torch nor the engine.
"""

__version__ = "0.1.0"

from . import types  # noqa: E402
from .client import (  # noqa: E402
    ActorAPIError,
    APIFuture,
    AuthError,
    ControlAPIError,
    EventFailedError,
    RestClient,
    RunBrokenError,
    SamplingClient,
    ServiceClient,
    Settings,
    TracedLoss,
    TrainingClient,
    TrineError,
    ValidationError,
    configure,
    custom_loss,
)
from .types import (  # noqa: E402
    AdamParams,
    Checkpoint,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    GetInfoResponse,
    GetServerCapabilitiesResponse,
    ImageChunk,
    LoraConfig,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SampleSequence,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
    Usage,
)

PyTrioError = TrineError  # the name PyTRIO code catches

__all__ = [
    "APIFuture",
    "ActorAPIError",
    "AdamParams",
    "AuthError",
    "Checkpoint",
    "ControlAPIError",
    "Datum",
    "EncodedTextChunk",
    "EventFailedError",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "GetServerCapabilitiesResponse",
    "ImageChunk",
    "LoraConfig",
    "ModelInput",
    "OptimStepResponse",
    "PyTrioError",
    "RestClient",
    "RunBrokenError",
    "SampleResponse",
    "SampleSequence",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "ServiceClient",
    "Settings",
    "TensorData",
    "TracedLoss",
    "TrainingClient",
    "TrineError",
    "Usage",
    "ValidationError",
    "configure",
    "custom_loss",
    "types",
]

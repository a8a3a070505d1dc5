"""All types that users build or receive (``pytrio_compat.types.X``)."""

from .datum import Datum, LossFnOutput
from .future import APIFuture
from .model_input import EncodedTextChunk, ImageChunk, ModelInput
from .params import AdamParams, SamplingParams
from .responses import (
    Checkpoint,
    CheckpointArchiveUrlResponse,
    CheckpointDownloadResult,
    CheckpointDownloadSource,
    CheckpointsListResponse,
    Cursor,
    ForwardBackwardOutput,
    GetSamplerResponse,
    GetServerCapabilitiesResponse,
    GetSessionResponse,
    ListSessionsResponse,
    ModelOperationCapabilities,
    OptimStepResponse,
    SampleResponse,
    SampleSequence,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    SupportedModel,
    TrainingRun,
    TrainingRunsResponse,
)
from .tensor import TensorData

__all__ = [
    "APIFuture", "AdamParams", "Checkpoint", "CheckpointArchiveUrlResponse", "CheckpointDownloadResult",
    "CheckpointDownloadSource", "CheckpointsListResponse", "Cursor", "Datum", "EncodedTextChunk",
    "ForwardBackwardOutput", "GetSamplerResponse", "GetServerCapabilitiesResponse", "GetSessionResponse",
    "ImageChunk", "ListSessionsResponse", "LossFnOutput", "ModelInput", "ModelOperationCapabilities",
    "OptimStepResponse", "SampleResponse", "SampleSequence", "SamplingParams", "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse", "SupportedModel", "TensorData", "TrainingRun", "TrainingRunsResponse",
]

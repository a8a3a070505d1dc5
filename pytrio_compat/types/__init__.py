"""All types that users build or receive (``pytrio_compat.types.X``). They load on first use (PEP 562)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULES = {
    "Datum": ".datum",
    "LossFnOutput": ".datum",
    "APIFuture": ".future",
    "EncodedTextChunk": ".model_input",
    "ImageChunk": ".model_input",
    "ModelInput": ".model_input",
    "AdamParams": ".params",
    "SamplingParams": ".params",
    "Checkpoint": ".responses",
    "CheckpointArchiveUrlResponse": ".responses",
    "CheckpointDownloadResult": ".responses",
    "CheckpointDownloadSource": ".responses",
    "CheckpointsListResponse": ".responses",
    "Cursor": ".responses",
    "ForwardBackwardOutput": ".responses",
    "GetSamplerResponse": ".responses",
    "GetServerCapabilitiesResponse": ".responses",
    "GetSessionResponse": ".responses",
    "ListSessionsResponse": ".responses",
    "ModelOperationCapabilities": ".responses",
    "OptimStepResponse": ".responses",
    "SampleResponse": ".responses",
    "SampleSequence": ".responses",
    "SaveWeightsForSamplerResponse": ".responses",
    "SaveWeightsResponse": ".responses",
    "SupportedModel": ".responses",
    "TrainingRun": ".responses",
    "TrainingRunsResponse": ".responses",
    "TensorData": ".tensor",
}

__all__ = [
    "APIFuture", "AdamParams", "Checkpoint", "CheckpointArchiveUrlResponse", "CheckpointDownloadResult",
    "CheckpointDownloadSource", "CheckpointsListResponse", "Cursor", "Datum", "EncodedTextChunk",
    "ForwardBackwardOutput", "GetSamplerResponse", "GetServerCapabilitiesResponse", "GetSessionResponse",
    "ImageChunk", "ListSessionsResponse", "LossFnOutput", "ModelInput", "ModelOperationCapabilities",
    "OptimStepResponse", "SampleResponse", "SampleSequence", "SamplingParams", "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse", "SupportedModel", "TensorData", "TrainingRun", "TrainingRunsResponse",
]

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""pytrio_compat: a PyTRIO-compatible client for a self-hosted LoRA training and sampling service.

``import pytrio_compat as trio`` runs scripts written for ``import pytrio as trio``.
"""

from . import types
from .config import configure
from .errors import PyTrioError
from .rest_client import RestClient
from .sampling_client import SamplingClient
from .service_client import ServiceClient
from .training_client import TrainingClient
from .types import AdamParams, APIFuture, Datum, ImageChunk, ModelInput, SamplingParams, TensorData


def configure_observability(*, enabled: bool = True) -> None:
    """Telemetry switch kept for compatibility: this SDK sends no telemetry."""


def shutdown_observability() -> None:
    """Telemetry switch kept for compatibility: this SDK sends no telemetry."""


__version__ = "0.1.0"
__all__ = [
    "types", "ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "configure", "PyTrioError",
    "configure_observability", "shutdown_observability", "AdamParams", "Datum", "ImageChunk", "ModelInput",
    "SamplingParams", "TensorData", "APIFuture",
]

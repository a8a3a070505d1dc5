"""pytrio_compat: a PyTRIO-compatible client for a self-hosted LoRA training and sampling service.

``import pytrio_compat as trio`` runs scripts written for ``import pytrio as trio``.

The public names load on first use (PEP 562), so ``import pytrio_compat.wire`` (the protocol module the worker
shares) loads the protocol and its value types only, not the clients or httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "configure": ".config", "PyTrioError": ".errors", "RestClient": ".rest_client",
    "SamplingClient": ".sampling_client", "ServiceClient": ".service_client", "TrainingClient": ".training_client",
    "AdamParams": ".types", "APIFuture": ".types", "Datum": ".types", "ImageChunk": ".types", "ModelInput": ".types",
    "SamplingParams": ".types", "TensorData": ".types",
}

__all__ = [
    "types", "ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "configure", "PyTrioError",
    "configure_observability", "shutdown_observability", "AdamParams", "Datum", "ImageChunk", "ModelInput",
    "SamplingParams", "TensorData", "APIFuture",
]

if TYPE_CHECKING:
    from . import types
    from .config import configure
    from .errors import PyTrioError
    from .rest_client import RestClient
    from .sampling_client import SamplingClient
    from .service_client import ServiceClient
    from .training_client import TrainingClient
    from .types import AdamParams, APIFuture, Datum, ImageChunk, ModelInput, SamplingParams, TensorData


def __getattr__(name: str) -> Any:
    if name == "types":
        return importlib.import_module(".types", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def configure_observability(*, enabled: bool = True) -> None:
    """Telemetry switch kept for compatibility: this SDK sends no telemetry."""


def shutdown_observability() -> None:
    """Telemetry switch kept for compatibility: this SDK sends no telemetry."""

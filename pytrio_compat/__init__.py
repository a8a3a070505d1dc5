"""pytrio_compat: a PyTRIO-compatible client for a self-hosted LoRA training and sampling service."""

from . import types
from .types import AdamParams, Datum, ImageChunk, ModelInput, SamplingParams, TensorData

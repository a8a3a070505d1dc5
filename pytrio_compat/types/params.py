"""User-facing parameter objects: sampling and optimizer settings (defaults as in PyTRIO and Tinker)."""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel, ConfigDict


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1
    top_k: int = -1
    top_p: float = 1


class AdamParams(BaseModel):
    """AdamW with decoupled weight decay; ``grad_clip_norm`` 0 disables global-norm clipping."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = 0.0001
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

"""What the service answers: training, sampling, checkpoint, capability and REST results."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

from .tensor import TensorData


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ForwardBackwardOutput(_Model):
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]
    debug: dict[str, object] = {}


class OptimStepResponse(_Model):
    metrics: dict[str, float] = {}


class SaveWeightsResponse(_Model):
    path: str
    model: str
    size: int
    type: Literal["save-checkpoint"] = "save-checkpoint"


class SaveWeightsForSamplerResponse(_Model):
    path: str
    model: str
    size: int
    type: Literal["save-weights"] = "save-weights"


class SampleSequence(_Model):
    stop_reason: str
    tokens: list[int]
    text: str | None = None
    logprobs: list[float] = []


class SampleResponse(_Model):
    sequences: list[SampleSequence]
    prompt_logprobs: list[float | None] = []
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] = []
    input_tokens: int = 0
    output_tokens: int = 0
    type: Literal["sample"] = "sample"
    # Worker timings, e.g. how many requests decoded together and how long generation took.
    metrics: dict[str, float] = {}


class ModelOperationCapabilities(_Model):
    available: bool = True
    max_batch_size: int | None = None
    max_tokens_per_request: int | None = None
    max_seq_len: int | None = None


class SupportedModel(_Model):
    model_name: str
    max_context_length: int | None = None
    training: ModelOperationCapabilities = ModelOperationCapabilities()
    sampling: ModelOperationCapabilities = ModelOperationCapabilities()


class GetServerCapabilitiesResponse(_Model):
    supported_models: list[SupportedModel]


# --- REST types ---------------------------------------------------------------------------------------


class Cursor(_Model):
    offset: int
    limit: int
    total_count: int


class Checkpoint(_Model):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler"]
    time: datetime
    path: str
    size_bytes: int | None = None
    public: bool = False
    expires_at: datetime | None = None


class CheckpointsListResponse(_Model):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(_Model):
    training_run_id: str
    base_model: str
    model_owner: str = ""
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict | None = None


class TrainingRunsResponse(_Model):
    training_runs: list[TrainingRun]
    cursor: Cursor


class GetSessionResponse(_Model):
    training_run_ids: list[str]
    sampler_ids: list[str]


class ListSessionsResponse(_Model):
    sessions: list[str]


class GetSamplerResponse(_Model):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class CheckpointArchiveUrlResponse(_Model):
    url: str
    expires: datetime


class CheckpointDownloadSource(_Model):
    checkpoint_id: str
    url: str
    expires: datetime
    source: Literal["object_storage", "actor"] = "actor"
    checkpoint_status: Literal["LOCAL", "SYNCING", "READY"] = "READY"
    tls_cert_pem: str | None = None
    tls_not_after: datetime | None = None


class CheckpointDownloadResult(_Model):
    checkpoint_id: str
    path: str
    bytes_written: int
    file_size_bytes: int
    status_code: int
    resumed: bool

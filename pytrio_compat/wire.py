"""The HTTP protocol between the SDK and the worker: request and response bodies, defined once.

The worker imports these models too, so the two sides cannot drift apart. Tensors travel as
``WireTensor`` (base64 of little-endian bytes); everything else is plain JSON.

Endpoints (all under ``/v1``):
  GET  /health                                   liveness
  GET  /capabilities                             GetServerCapabilitiesResponse
  GET  /tokenizer?model=NAME                     TokenizerFiles
  POST /training_runs                            CreateTrainingRun -> TrainingRunInfo
  GET  /training_runs/{id}                       TrainingRunInfo
  POST /training_runs/{id}/ops                   TrainingOp -> Accepted   (ordered by seq_id)
  GET  /checkpoint_config?path=trio://...        CheckpointConfig
  GET  /checkpoints?training_run_id=ID           CheckpointList
  DELETE /checkpoints?path=trio://...            deletes one checkpoint
  GET  /checkpoints/archive_url?path=trio://...  CheckpointArchiveUrl: a signed URL of the checkpoint's
                                                 archive (a tar of its PEFT folder), fetched without credentials
  POST /samplers                                 CreateSampler -> SamplerInfo
  POST /samplers/{id}/sample                     SampleRequest -> Accepted
  GET  /requests/{request_id}?wait=SECONDS       RequestStatus (long poll)
Errors: status 4xx/5xx with ErrorResponse.

Every list and map of a request body has a structural bound (``types/bounds.py``), checked while it is parsed,
and its validation stops at the first bad item; the worker's own limits are checked after parsing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

# Models that are on the wire as they are in the public API: the worker takes them from here, so this
# module is the whole of what it shares with the client.
from .types.bounds import MAX_ITEMS, MAX_KEYS, MAX_TOKENS, bounded_dict, bounded_list  # noqa: F401
from .types.model_input import ImageChunk
from .types.params import AdamParams
from .types.responses import GetServerCapabilitiesResponse, ModelOperationCapabilities, SupportedModel  # noqa: F401
from .types.tensor import WireTensor

PROTOCOL_VERSION = 1


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(WireModel):
    code: str
    message: str
    field: str | None = None
    details: dict[str, Any] = {}


class ErrorResponse(WireModel):
    error: ErrorBody


class Accepted(WireModel):
    request_id: str
    duplicate: bool = False


class RequestStatus(WireModel):
    request_id: str
    status: Literal["queued", "running", "succeeded", "failed"]
    result: dict[str, Any] | None = None
    error: ErrorBody | None = None
    queue_position: int | None = None
    kind: str | None = None  # the operation, e.g. "forward_backward" or "sample"
    queue_seconds: float | None = None  # time spent waiting in the model's queue (so far)
    run_seconds: float | None = None  # time spent running (so far); None while queued


# --- training ---------------------------------------------------------------------------------------


class LoraSpec(WireModel):
    rank: int = 32
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # torch.manual_seed's range
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateTrainingRun(WireModel):
    base_model: str | None = None
    lora: LoraSpec = LoraSpec()
    from_checkpoint: str | None = None
    load_optimizer: bool = False


class TrainingRunInfo(WireModel):
    training_run_id: str
    base_model: str
    lora: LoraSpec
    vocab_size: int
    limits: ModelOperationCapabilities
    last_seq_id: int = 0


class TrainingRunList(WireModel):
    """One page of the caller's training runs, oldest first, and how many there are in all."""

    training_runs: list[TrainingRunInfo]
    total_count: int


MAX_LIST_LIMIT = 1000  # runs on one page of GET /v1/training_runs


class WireImage(WireModel):
    """An image chunk of a prompt or datum: the image goes before text token ``position`` of the sequence's text
    tokens (``len(tokens)``: after the last one); images at one position keep their order. The worker replaces it
    with the tokens its processor makes for the image (``chunk.expected_tokens`` of them, filled in when left out)."""

    position: StrictInt = Field(ge=0)
    chunk: ImageChunk


class WireDatum(WireModel):
    tokens: WireTensor  # the text tokens; with ``images`` the loss inputs cover text and image tokens together
    loss_fn_inputs: bounded_dict(WireTensor, MAX_KEYS)
    images: bounded_list(WireImage, MAX_ITEMS) | None = None


class ForwardOp(WireModel):
    op: Literal["forward", "forward_backward"]
    loss_fn: str = "cross_entropy"
    loss_fn_config: bounded_dict(Any, MAX_KEYS) = {}
    data: bounded_list(WireDatum, MAX_ITEMS)


class OptimStepOp(WireModel):
    op: Literal["optim_step"] = "optim_step"
    adam_params: AdamParams


class SaveOp(WireModel):
    op: Literal["save_state", "save_weights_for_sampler"]
    name: str
    ttl_seconds: int | None = None
    overwrite: bool = False
    # A sampler snapshot kept only in memory (no file) for save_weights_and_get_sampling_client.
    ephemeral: bool = False
    # Labels kept with the checkpoint (Tinker's save_state / save_weights_for_sampler user_metadata).
    user_metadata: bounded_dict(str, MAX_KEYS) | None = None


class LoadOp(WireModel):
    op: Literal["load_state"] = "load_state"
    path: str
    load_optimizer: bool = False


Op = Annotated[Union[ForwardOp, OptimStepOp, SaveOp, LoadOp], Field(discriminator="op")]


class TrainingOp(WireModel):
    seq_id: int = Field(ge=1)
    payload: Op


class ForwardResult(WireModel):
    loss_fn_outputs: list[dict[str, WireTensor]]
    metrics: dict[str, float]


class SaveResult(WireModel):
    path: str
    size: int
    model: str


class CheckpointConfig(WireModel):
    path: str
    kind: Literal["state", "sampler"]
    base_model: str
    lora: LoraSpec
    has_optimizer: bool


class CheckpointEntry(WireModel):
    checkpoint_id: str
    kind: Literal["state", "sampler"]
    path: str
    created_at: float
    size_bytes: int


class CheckpointList(WireModel):
    checkpoints: list[CheckpointEntry]


class CheckpointArchiveUrl(WireModel):
    url: str  # absolute; carries its own signature, so no API key is sent with it
    expires_at: float  # unix seconds


# --- sampling ---------------------------------------------------------------------------------------


class CreateSampler(WireModel):
    base_model: str | None = None
    model_path: str | None = None


class SamplerInfo(WireModel):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class WireSamplingParams(WireModel):
    """Sampling parameters. The worker bounds what drives work per decoding step: by default at most 16
    ``stop`` strings of at most 256 UTF-8 bytes each and 1024 ``stop_token_ids`` (413 naming the limit)."""

    # integers strict: JSON true is not a token id or a count
    max_tokens: StrictInt
    temperature: float = 1.0
    top_k: StrictInt = -1
    top_p: float = 1.0
    seed: StrictInt | None = None
    stop: bounded_list(str, MAX_ITEMS) | None = None
    stop_token_ids: bounded_list(StrictInt, MAX_ITEMS) | None = None


class SampleRequest(WireModel):
    prompt_tokens: bounded_list(StrictInt, MAX_TOKENS)  # the text tokens; images between them in ``prompt_images``
    prompt_images: bounded_list(WireImage, MAX_ITEMS) | None = None
    num_samples: StrictInt = 1
    sampling_params: WireSamplingParams
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: StrictInt = 0
    return_text: bool = True


class TokenizerFiles(WireModel):
    model: str
    files: dict[str, str]  # file name -> base64 content

"""The Actor plane's training events: what the SDK submits (msgpack, ``POST v1/events``) and what it accepts back.

Inbound: the envelope and its metadata ignore unknown keys; each event type's payload forbids them (a key we do
not know could change what training means, so the event fails naming it). Every list and string is bounded, long
numeric lists stop at their first bad element. Outbound answers are exactly what the SDK validates: the
forward/forward_backward result and the optimize_step result are strict there (an extra key is a
``pydantic.ValidationError`` in the user's ``.result()``), tensors are msgpack ``bin`` of the exact byte length, and
``usage`` is present in every finished answer.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

MAX_ID = 128
MAX_SHORT = 64
MAX_MODEL = 4096
MAX_URI = 4096
MAX_TEXT = 8192
MAX_SEQ_TOKENS = 262_144  # positions of one datum or one prompt (the worker's limits apply after parsing)
MAX_CHUNKS = 1024  # model_input chunks of one datum
MAX_DATA = MAX_SEQ_TOKENS  # datums of one event (each has a token: the token limits bound them)
MAX_CONFIG_KEYS = 32
MAX_IMAGE_BYTES = 32 * 1024 * 1024
IGNORE_INDEX = -100

EVENT_ID_RE = r"^event_[0-9a-hjkmnp-tv-z]{12}$"  # the SDK's generator alphabet
CHECKPOINT_NAME_RE = r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_-])?$"

EventType = Literal["trainer.init_run", "trainer.forward", "trainer.forward_backward", "trainer.optimize_step",
                    "trainer.save_state", "trainer.save_weights", "trainer.end_run"]
LossType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]

Short = Annotated[str, Field(max_length=MAX_SHORT)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
TargetId = Annotated[StrictInt, Field(ge=IGNORE_INDEX, le=2**31 - 1)]
ConfigValue = Union[StrictBool, StrictInt, FiniteFloat, Annotated[str, Field(max_length=MAX_TEXT)], None]
ConfigMap = Annotated[dict[Short, ConfigValue], Field(max_length=MAX_CONFIG_KEYS)]


class _Lenient(BaseModel):
    model_config: ClassVar[ConfigDict] = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid")


# --- model input (shared with the sample body) --------------------------------------------------------------------


class TextChunkIn(_Strict):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[TokenId] = Field(max_length=MAX_SEQ_TOKENS, fail_fast=True)


class ImageChunkIn(_Strict):
    """An image chunk: msgpack ``bin`` in events, standard base64 text in the JSON sample body. Parsed (bounded) so
    that the field is known; the worker serves text models and refuses it after parsing."""

    type: Literal["image"] = "image"
    data: bytes = Field(min_length=1, max_length=MAX_IMAGE_BYTES)
    format: Literal["png", "jpeg"]
    expected_tokens: Annotated[int, Field(gt=0, le=MAX_SEQ_TOKENS)] | None = None

    @field_validator("data", mode="before")
    @classmethod
    def _from_base64(cls, value: object) -> object:
        if isinstance(value, str):
            if len(value) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
                raise ValueError(f"image data over {MAX_IMAGE_BYTES} bytes")
            try:
                return base64.b64decode(value, validate=True)
            except ValueError:
                raise ValueError("image data must be standard base64") from None
        return value


ChunkIn = Annotated[Union[TextChunkIn, ImageChunkIn], Field(discriminator="type")]


class ModelInputIn(_Strict):
    chunks: list[ChunkIn] = Field(min_length=1, max_length=MAX_CHUNKS)

    @property
    def length(self) -> int:
        """Positions: text tokens plus each image's expected_tokens (the SDK's N)."""
        return sum(len(c.tokens) if isinstance(c, TextChunkIn) else (c.expected_tokens or 0) for c in self.chunks)

    def image_chunk(self) -> int | None:
        """The index of the first image chunk, if any."""
        return next((i for i, c in enumerate(self.chunks) if isinstance(c, ImageChunkIn)), None)

    def tokens(self) -> list[int]:
        return [t for c in self.chunks if isinstance(c, TextChunkIn) for t in c.tokens]


# --- inbound: the envelope and the payloads -----------------------------------------------------------------------


class EventMetadataIn(_Lenient):
    """``index``: the run's execution order (1, 2, ...; never reused). ``step`` counts completed forward_backward
    calls, not optimizer steps: it is not used."""

    index: Annotated[StrictInt, Field(ge=1, le=2**62)]
    step: Annotated[StrictInt, Field(ge=0, le=2**62)] = 0
    timestamp: StrictInt = 0
    sdk: Short = ""
    sdk_version: Short = ""
    run_id: Annotated[str, Field(min_length=1, max_length=MAX_ID)]


class EventEnvelopeIn(_Lenient):
    """A submitted event. ``event_id`` is the idempotency key: the SDK re-sends identical bytes."""

    version: Literal[1]
    event_id: Annotated[str, Field(pattern=EVENT_ID_RE)]
    type: EventType
    metadata: EventMetadataIn
    payload: dict[Short, Any] = Field(max_length=MAX_CONFIG_KEYS)


class LoraConfigIn(_Strict):
    rank: Annotated[StrictInt, Field(ge=1, le=4096)]
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] | None = None
    train_mlp: StrictBool
    train_attn: StrictBool
    train_unembed: StrictBool


class InitRunIn(_Strict):
    """trainer.init_run: the first event of a run (sent again, with a new id, if it failed)."""

    base_model: Annotated[str, Field(min_length=1, max_length=MAX_MODEL)]
    lora_config: LoraConfigIn
    checkpoint_uri: Annotated[str, Field(min_length=1, max_length=MAX_URI)] | None = None
    load_optimizer: StrictBool = False
    user_metadata: ConfigMap | None = None


class DatumIn(_Strict):
    """One datum of N positions (text tokens + images' expected_tokens); every per-position list has N entries and
    target_ids[i] is the label scored at position i (-100: ignored)."""

    model_input: ModelInputIn
    target_ids: list[TargetId] = Field(min_length=1, max_length=MAX_SEQ_TOKENS, fail_fast=True)
    weights: list[FiniteFloat] | None = Field(default=None, max_length=MAX_SEQ_TOKENS, fail_fast=True)
    logprobs: list[FiniteFloat] | None = Field(default=None, max_length=MAX_SEQ_TOKENS, fail_fast=True)
    advantages: list[FiniteFloat] | None = Field(default=None, max_length=MAX_SEQ_TOKENS, fail_fast=True)

    @model_validator(mode="after")
    def _aligned(self) -> DatumIn:
        n = self.model_input.length
        for name in ("target_ids", "weights", "logprobs", "advantages"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries, model_input has {n} positions")
        return self


class LossSpecIn(_Strict):
    type: LossType
    config: ConfigMap = Field(default_factory=dict)

    @field_validator("type", mode="before")
    @classmethod
    def _normalise(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value


class GradientAccumulationIn(_Strict):
    """The whole logical call's totals before the SDK split it; the same on each of its events."""

    total_samples: Annotated[StrictInt, Field(gt=0, le=2**31)]
    total_active_tokens: Annotated[StrictInt, Field(ge=0, le=2**40)]
    total_advantage_tokens: Annotated[StrictInt, Field(ge=0, le=2**40)]


@dataclass(frozen=True)
class ChunkCounts:
    """One event's counts under the SDK's rules for the totals."""

    samples: int
    active_tokens: int  # CE: target != -100 and weight != 0; policy: target != -100 (position 0 skipped: auto_shift)
    advantage_tokens: int  # policy losses: active positions with advantage != 0
    input_tokens: int  # sum of N


def chunk_counts(data: list[DatumIn], loss_type: str, auto_shift: bool) -> ChunkCounts:
    start = 1 if auto_shift else 0
    active = advantage = inputs = 0
    for datum in data:
        inputs += datum.model_input.length
        targets = np.asarray(datum.target_ids[start:], dtype=np.int64)
        live = targets != IGNORE_INDEX
        if loss_type == "cross_entropy":
            if datum.weights is not None:
                live &= np.asarray(datum.weights[start:], dtype=np.float64) != 0.0
            active += int(live.sum())
        else:
            active += int(live.sum())
            advantage += int((live & (np.asarray(datum.advantages[start:], dtype=np.float64) != 0.0)).sum())
    return ChunkCounts(len(data), active, advantage, inputs)


class ForwardIn(_Strict):
    """trainer.forward / trainer.forward_backward: one event (a chunk of a call)."""

    data: list[DatumIn] = Field(min_length=1, max_length=MAX_DATA)
    auto_shift: StrictBool = False
    loss: LossSpecIn
    gradient_accumulation: GradientAccumulationIn

    @model_validator(mode="after")
    def _inputs_and_totals(self) -> ForwardIn:
        for i, datum in enumerate(self.data):
            if self.loss.type != "cross_entropy" and (datum.logprobs is None or datum.advantages is None):
                raise ValueError(f"data[{i}]: loss {self.loss.type} needs logprobs and advantages")
        counts = self.counts()
        totals = self.gradient_accumulation
        # An event never holds more than its call; an event that is the whole call matches its totals exactly
        # (the totals set the gradient's scale, so they must describe the data).
        if (counts.samples > totals.total_samples or counts.active_tokens > totals.total_active_tokens
                or counts.advantage_tokens > totals.total_advantage_tokens):
            raise ValueError(f"gradient_accumulation: totals {totals.model_dump()} are smaller than this event's data "
                             f"({counts.samples} samples, {counts.active_tokens} active, {counts.advantage_tokens} "
                             "advantage tokens)")
        if counts.samples == totals.total_samples and (counts.active_tokens, counts.advantage_tokens) != (
                totals.total_active_tokens, totals.total_advantage_tokens):
            raise ValueError(f"gradient_accumulation: this event holds the whole call ({counts.samples} samples) but "
                             f"has {counts.active_tokens} active and {counts.advantage_tokens} advantage tokens, not "
                             f"{totals.total_active_tokens} and {totals.total_advantage_tokens}")
        return self

    def counts(self) -> ChunkCounts:
        return chunk_counts(self.data, self.loss.type, self.auto_shift)


class AdamParamsIn(_Strict):
    """trainer.optimize_step (SDK defaults 1e-4, 0.9, 0.95, 1e-12, 0, 0; grad_clip_norm 0: no clipping)."""

    learning_rate: Annotated[float, Field(ge=0.0, le=10.0, allow_inf_nan=False)] = 1e-4
    beta1: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = 0.9
    beta2: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = 0.95
    eps: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1e-12
    weight_decay: Annotated[float, Field(ge=0.0, le=10.0, allow_inf_nan=False)] = 0.0
    grad_clip_norm: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0


class OptimizeStepIn(_Strict):
    adam_params: AdamParamsIn


class SaveIn(_Strict):
    """trainer.save_state / trainer.save_weights (save_weights_and_get_sampling_client: temp-sampling-<hex>,
    TEMPORARY, ttl 21600)."""

    name: Annotated[str, Field(min_length=1, max_length=200, pattern=CHECKPOINT_NAME_RE)]
    ttl_seconds: Annotated[StrictInt, Field(gt=0, le=10 * 365 * 86400)] | None = None
    overwrite: StrictBool = False
    visibility: Literal["WORKSPACE", "TEMPORARY"] = "WORKSPACE"
    metadata: ConfigMap | None = None


class EndRunIn(_Strict):
    """trainer.end_run (defined by the SDK, never sent by 0.2.9)."""

    source: Short = "sdk"
    reason: Short = "user_requested"


PAYLOADS: dict[str, type[BaseModel]] = {
    "trainer.init_run": InitRunIn, "trainer.forward": ForwardIn, "trainer.forward_backward": ForwardIn,
    "trainer.optimize_step": OptimizeStepIn, "trainer.save_state": SaveIn, "trainer.save_weights": SaveIn,
    "trainer.end_run": EndRunIn,
}


def parse_payload(envelope: EventEnvelopeIn) -> BaseModel:
    """The typed payload (pydantic.ValidationError: answered as a failed event, not an HTTP error)."""
    return PAYLOADS[envelope.type].model_validate(envelope.payload)


# --- outbound -----------------------------------------------------------------------------------------------------


class WireTensorOut(_Strict):
    """Exactly four keys; ``data`` is little-endian C-order bytes (msgpack ``bin``) of prod(shape) * itemsize."""

    dtype: Literal["<f4", "<i8"]
    shape: list[Annotated[int, Field(gt=0)]] = Field(min_length=1, max_length=8)
    encoding: Literal["raw_le"] = "raw_le"
    data: bytes

    @model_validator(mode="after")
    def _length(self) -> WireTensorOut:
        expected = np.dtype(self.dtype).itemsize * math.prod(self.shape)
        if len(self.data) != expected:
            raise ValueError(f"tensor data has {len(self.data)} bytes, its shape and dtype need {expected}")
        return self


def wire_tensor(array: np.ndarray) -> WireTensorOut:
    """Floats as float32, integers as int64 (the SDK converts to exactly these; other dtypes fail in its hands)."""
    arr = np.asarray(array)
    if arr.ndim == 0 or arr.size == 0:
        raise ValueError("a wire tensor needs at least one dimension and one element")
    arr = np.ascontiguousarray(arr, dtype="<f4" if np.issubdtype(arr.dtype, np.floating) else "<i8")
    return WireTensorOut(dtype=arr.dtype.str, shape=list(arr.shape), data=arr.tobytes())


class ForwardMetricsOut(_Strict):
    """Exactly these keys. loss_sum: the event's summed per-token loss (unscaled); token_count: its active positions
    by the SDK's rule, so the SDK's aggregate loss_mean = sum(loss_sum) / sum(token_count) is the call's mean."""

    loss_sum: FiniteFloat
    loss_mean: FiniteFloat
    token_count: Annotated[int, Field(ge=0)]


class ForwardResultOut(_Strict):
    """One output map per datum of this event, in order, each with a 1-D float ``logprobs`` of length N."""

    loss_fn_outputs: list[dict[Short, WireTensorOut]] = Field(max_length=MAX_DATA)
    metrics: ForwardMetricsOut


class OptimResultOut(_Strict):
    """Exactly ``{"metrics": {name: float}}``."""

    metrics: dict[Short, FiniteFloat] = Field(max_length=MAX_CONFIG_KEYS)


class CheckpointResultOut(_Strict):
    uri: Annotated[str, Field(min_length=1, max_length=MAX_URI)]
    size_bytes: Annotated[int, Field(ge=0)]
    model_id: Annotated[str, Field(min_length=1, max_length=MAX_MODEL)] | None = None
    checkpoint_cuid: Annotated[str, Field(min_length=1, max_length=MAX_ID)] | None = None  # the SDK's telemetry


class SaveResultOut(_Strict):
    checkpoint: CheckpointResultOut


class EmptyResultOut(_Strict):
    """init_run and end_run: the SDK ignores the result."""


class UsageOut(_Strict):
    """Required in succeeded and failed answers."""

    input_tokens: Annotated[int, Field(ge=0)] = 0
    output_tokens: Annotated[int, Field(ge=0)] = 0
    train_tokens: Annotated[int, Field(ge=0)] = 0


class EventErrorOut(_Strict):
    code: Short
    message: Annotated[str, Field(max_length=MAX_TEXT)]


RESULTS: dict[str, type[BaseModel]] = {
    "trainer.forward": ForwardResultOut, "trainer.forward_backward": ForwardResultOut,
    "trainer.optimize_step": OptimResultOut, "trainer.save_state": SaveResultOut, "trainer.save_weights": SaveResultOut,
}


class EventStatusOut(_Strict):
    """The answer to a submit and to a poll: ``event_id`` and ``type`` echo the event (the SDK checks both on submit).
    accepted/running carry nothing else; succeeded a ``result`` of the type's shape; failed an ``error``."""

    version: Literal[1] = 1
    event_id: Annotated[str, Field(pattern=EVENT_ID_RE)]
    type: EventType
    status: Literal["accepted", "running", "succeeded", "failed"]
    result: Union[ForwardResultOut, OptimResultOut, SaveResultOut, EmptyResultOut, None] = None
    error: EventErrorOut | None = None
    usage: UsageOut | None = None

    @model_validator(mode="after")
    def _shape(self) -> EventStatusOut:
        if self.status == "succeeded":
            want = RESULTS.get(self.type, EmptyResultOut)
            if not isinstance(self.result, want) or self.error is not None or self.usage is None:
                raise ValueError(f"a succeeded {self.type} needs a {want.__name__} result, usage and no error")
        elif self.status == "failed":
            if self.error is None or self.result is not None or self.usage is None:
                raise ValueError("a failed event needs an error, usage and no result")
        elif (self.result, self.error, self.usage) != (None, None, None):
            raise ValueError("accepted/running answers carry only version, event_id, type and status")
        return self


def succeeded(event_id: str, type_: str, result: BaseModel, usage: UsageOut) -> EventStatusOut:
    return EventStatusOut(event_id=event_id, type=type_, status="succeeded", result=result, usage=usage)


def failed(event_id: str, type_: str, code: str, message: str, usage: UsageOut | None = None) -> EventStatusOut:
    return EventStatusOut(event_id=event_id, type=type_, status="failed", usage=usage or UsageOut(),
                          error=EventErrorOut(code=code[:MAX_SHORT], message=message[:MAX_TEXT]))


def pending(event_id: str, type_: str, running: bool = False) -> EventStatusOut:
    return EventStatusOut(event_id=event_id, type=type_, status="running" if running else "accepted")

"""The Control plane's JSON shapes (``/api/openapi/v1/...``, ``/api/models``, ``/api/sdk/bootstrap``).

Inbound bodies (``*In``) ignore unknown keys, as the SDK's own answers do, and bound every string. Outbound
answers (``*Out``) forbid extra keys on our side, so a typo cannot reach the SDK, and are dumped with ``None``
kept: several keys the SDK requires may be null ("required-nullable"). The SDK ignores extra keys in every
Control answer. Datetimes go out as aware UTC ISO-8601. See docs/pytrio.md for which route answers which shape.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

MAX_ID = 128  # cuids, tokens' run ids
MAX_SHORT = 64  # enum-like strings, versions
MAX_MODEL = 4096  # base_model / model_id: may be an absolute tokenizer folder
MAX_URI = 4096  # checkpoint URIs
MAX_TEXT = 8192
MAX_LIST_PAGE = 1000  # limit= of list routes

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID)]
Short = Annotated[str, Field(max_length=MAX_SHORT)]
Model = Annotated[str, Field(min_length=1, max_length=MAX_MODEL)]


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def utc(seconds: float) -> datetime:
    """A wall-clock time (``time.time()``) as an aware UTC datetime."""
    return datetime.fromtimestamp(seconds, timezone.utc)


class _In(BaseModel):
    model_config: ClassVar[ConfigDict] = ConfigDict(extra="ignore")


class _Out(BaseModel):
    model_config: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _aware(cls, value: Any) -> Any:
        if isinstance(value, datetime):
            if value.tzinfo is None:
                raise ValueError("datetimes sent to the SDK must be timezone-aware")
            return value.astimezone(timezone.utc)
        return value


def control_json(model: BaseModel) -> dict:
    """An answer as a JSON-ready dict, its null keys kept (the SDK requires some of them to be present)."""
    return model.model_dump(mode="json", exclude_none=False)


# --- inbound ------------------------------------------------------------------------------------------------------


class ServiceSessionCreateIn(_In):
    """C3: ``{"sdk_version": "0.2.9"}``."""

    sdk_version: Annotated[str, Field(max_length=MAX_SHORT)] = ""


class TrainingRunCreateIn(_In):
    """C5. ``base_model`` is empty for create_training_client_from_state*, whose model comes from the checkpoint;
    ``seed`` is absent when the user gave none."""

    base_model: Annotated[str, Field(max_length=MAX_MODEL)] = ""
    lora_rank: Annotated[StrictInt, Field(ge=1, le=4096)]
    train_mlp: StrictBool = True
    train_attn: StrictBool = True
    train_unembed: StrictBool = True
    source_checkpoint_uri: Annotated[str, Field(max_length=MAX_URI)] = ""
    restore_optimizer: StrictBool = False
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] | None = None

    @model_validator(mode="after")
    def _model_or_checkpoint(self) -> TrainingRunCreateIn:
        if not self.base_model and not self.source_checkpoint_uri:
            raise ValueError("base_model or source_checkpoint_uri is required")
        return self


class TrainingRunUpdateIn(_In):
    """C6 (PATCH), sent by TrainingClient.load_state* before the run's first event."""

    source_checkpoint_uri: Annotated[str, Field(min_length=1, max_length=MAX_URI)]
    restore_optimizer: StrictBool = False


class SamplingRunCreateIn(_In):
    """C7. ``base_model`` is the run's alias (from a TrainingClient) or the user's string."""

    base_model: Annotated[str, Field(max_length=MAX_MODEL)] = ""
    source_checkpoint_uri: Annotated[str, Field(max_length=MAX_URI)] = ""


class ServiceSessionCloseIn(_In):
    """C11."""

    status: Literal["ENDED", "CANCELLED"] = "ENDED"


class PageIn(_In):
    """``limit`` / ``offset`` of the list routes."""

    limit: Annotated[int, Field(ge=1, le=MAX_LIST_PAGE)] = 20
    offset: Annotated[int, Field(ge=0, le=2**31)] = 0


# --- outbound -----------------------------------------------------------------------------------------------------


class ApiKeyInfoOut(_Out):
    """C1; the three nullable keys must be present."""

    api_key_tid: Id
    api_key_name: str | None = None
    user_cuid: Id
    username: Id
    display_name: str | None = None
    workspace_cuid: Id
    workspace_name: Id
    workspace_type: Short
    expires_at: datetime | None = None


class CompatibilityOut(_Out):
    status: Literal["compatible", "warning", "blocked"]
    sdk_version: Short


class BootstrapOut(_Out):
    """C2: compatible, no notices (a 404 would log a warning at every ServiceClient())."""

    compatibility: CompatibilityOut
    notices: list[dict] = Field(default_factory=list, max_length=0)


class ServiceSessionCreatedOut(_Out):
    service_session_cuid: Id
    workspace_cuid: Id
    status: Short
    created_at: datetime


class CapabilityOut(_Out):
    """Run limits: all three keys present, each null or > 0. The trainer's drive the SDK's chunking."""

    max_batch_size: Annotated[int, Field(gt=0)] | None
    max_tokens_per_request: Annotated[int, Field(gt=0)] | None
    max_seq_len: Annotated[int, Field(gt=0)] | None


class ModelInfoOut(_Out):
    """One C4 catalog item: ``model_id`` is what get_supported_models() returns and what the SDK loads its
    tokenizer from; ``alias`` is the worker's name for the model."""

    cuid: Id
    alias: Model
    model_id: Model
    display_name: str | None = None
    context_length: int | None = None
    train_available: bool
    sample_available: bool
    trainer: CapabilityOut
    sampler: CapabilityOut
    created_at: datetime
    updated_at: datetime


class ModelListOut(_Out):
    items: list[ModelInfoOut] = Field(max_length=MAX_LIST_PAGE)
    total: Annotated[int, Field(ge=0)]
    limit: Annotated[int, Field(ge=0)]
    offset: Annotated[int, Field(ge=0)]


class ActorOut(_Out):
    """Where the Actor plane is: an absolute http(s) endpoint is used as is (its path prefix kept)."""

    actor_cuid: Id
    endpoint: Annotated[str, Field(min_length=1, max_length=MAX_URI)]
    connect_mode: Short = "direct"
    tls_enabled: bool = False


class ActorJwtOut(_Out):
    """The Actor token: opaque to the SDK, which renews it when ``expires_at`` is 300 s or less away."""

    token: Annotated[str, Field(min_length=1, max_length=512)]
    expires_at: datetime


class TrainingRunCreatedOut(_Out):
    training_run_cuid: Id
    service_session_cuid: Id
    workspace_cuid: Id
    status: Short
    run_index: int
    model_spec_cuid: Id
    model_alias: Model
    model_id: Model
    trainer: CapabilityOut
    actor: ActorOut
    actor_jwt: ActorJwtOut
    created_at: datetime


class TrainingRunUpdatedOut(_Out):
    """C6: the SDK initialises with the returned URI, flag, limits and actor."""

    source_checkpoint_uri: Annotated[str, Field(min_length=1, max_length=MAX_URI)]
    restore_optimizer: bool
    trainer: CapabilityOut
    actor: ActorOut
    actor_jwt: ActorJwtOut


class SamplingRunCreatedOut(_Out):
    sampling_run_cuid: Id
    service_session_cuid: Id
    workspace_cuid: Id
    status: Short
    run_index: int
    model_spec_cuid: Id
    model_alias: Model
    model_id: Model
    sampler: CapabilityOut
    actor: ActorOut
    actor_jwt: ActorJwtOut
    created_at: datetime


class CheckpointConfigOut(_Out):
    """C8: the LoRA settings of the run that wrote a checkpoint; ``base_model`` is the model's current model_id
    (load_state compares it with the TrainingClient's)."""

    base_model: Model
    lora_rank: int
    seed: int | None = None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool


class TrainingRunRenewedOut(_Out):
    """C9."""

    training_run_cuid: Id
    service_session_cuid: Id
    workspace_cuid: Id
    actor: ActorOut
    actor_jwt: ActorJwtOut


class SamplingRunRenewedOut(_Out):
    """C10."""

    sampling_run_cuid: Id
    service_session_cuid: Id
    workspace_cuid: Id
    actor: ActorOut
    actor_jwt: ActorJwtOut


class CursorOut(_Out):
    """``offset`` as asked, ``limit`` the rows served (> 0): the SDK pages on offset + limit < total."""

    offset: Annotated[int, Field(ge=0)]
    limit: Annotated[int, Field(gt=0)]
    total: Annotated[int, Field(ge=0)]


class ServiceSessionOut(_Out):
    """C13 (and, without the run lists, each C14 item)."""

    service_session_cuid: Id
    workspace_cuid: Id
    status: Short
    sdk_version: Short | None = None
    training_run_cuids: list[Id] | None = None
    sampling_run_cuids: list[Id] | None = None
    created_at: datetime
    updated_at: datetime


class TrainingParamsOut(_Out):
    restore_optimizer: bool
    lora_rank: int | None = None
    seed: int | None = None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool


class TrainingRunOut(_Out):
    """C15 and each C16 item."""

    training_run_cuid: Id
    base_model: Annotated[str, Field(max_length=MAX_MODEL)]
    service_session_cuid: Id
    workspace_cuid: Id
    status: Short
    run_index: int
    model_spec_cuid: Id
    is_lora: bool = True
    source_checkpoint_uri: str | None = None
    restore_optimizer: bool
    lora_rank: int
    seed: int | None = None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    corrupted: bool = False
    training_params: TrainingParamsOut
    created_at: datetime
    updated_at: datetime


class CheckpointRecordOut(_Out):
    """One C17/C18 item. ``checkpoint_type`` is TRAINING (save_state) or SAMPLER (save_weights); the SDK shows
    ``checkpoint_uri`` as the path, and addresses REST calls by ``checkpoint_cuid``."""

    cuid: Id
    checkpoint_cuid: Id
    training_run_cuid: Id
    workspace_cuid: Id | None = None
    name: Annotated[str, Field(min_length=1, max_length=200)]
    checkpoint_type: Literal["TRAINING", "SAMPLER"]
    status: Short
    checkpoint_uri: Annotated[str, Field(min_length=1, max_length=MAX_URI)]
    model: Annotated[str, Field(max_length=MAX_MODEL)]
    base_model: Annotated[str, Field(max_length=MAX_MODEL)]
    model_spec_cuid: Id
    task_id: Id
    task_created_at: datetime
    task_status: Short
    path: Annotated[str, Field(max_length=MAX_URI)]
    created_at: datetime
    size_bytes: Annotated[int, Field(ge=0)] | None = None
    lora_rank: int
    is_uploaded: bool = False
    expired_at: datetime | None = None


class DownloadUrlOut(_Out):
    """C19. ``tls_cert_pem`` and ``tls_not_after`` are required keys (null for plain http); the URL is fetched with
    no credentials, so it carries its own signature."""

    url: Annotated[str, Field(min_length=1, max_length=MAX_URI)]
    expires_at: datetime
    source: Literal["object_storage", "actor"] = "actor"
    checkpoint_status: Literal["LOCAL", "SYNCING", "READY"] = "READY"
    tls_cert_pem: str | None = None
    tls_not_after: datetime | None = None

    @model_validator(mode="after")
    def _absolute(self) -> DownloadUrlOut:
        if re.match(r"^https?://[^/]+", self.url) is None:
            raise ValueError("url must be an absolute http(s) URL")
        return self


class SamplingRunOut(_Out):
    """C21 (RestClient.get_sampler shows ``source_checkpoint_uri`` as model_path)."""

    sampling_run_cuid: Id
    service_session_cuid: Id
    workspace_cuid: Id
    status: Short
    base_model: Annotated[str, Field(max_length=MAX_MODEL)]
    model_id: Annotated[str, Field(max_length=MAX_MODEL)]
    alias: Annotated[str, Field(max_length=MAX_MODEL)]
    source_checkpoint_uri: str | None = None
    created_at: datetime
    updated_at: datetime

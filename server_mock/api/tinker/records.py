"""The records the Tinker REST API answers with, built in one place: ``Checkpoint`` (``checkpoint_record``),
``TrainingRun`` (``training_run_record``) and the ``user_metadata`` labels a client attaches to sessions,
training runs and checkpoints (``user_metadata``, bounded).

Field names and types are the SDK's (``tinker.types.Checkpoint``, ``TrainingRun``): timestamps are ISO-8601
in UTC with a ``Z`` (the cookbook compares them with ``datetime.now(UTC)``), ids are strings, and a
checkpoint's ``checkpoint_id`` is ``<kind>/<name>`` with the kind as it appears in its ``tinker://`` path.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import StringConstraints, TypeAdapter, ValidationError

from server_mock.api.bodies import first_error
from server_mock.errors import bad_request
from server_mock.storage.checkpoints import CheckpointRef, expires_at

MAX_METADATA_KEYS = 64
MAX_METADATA_KEY_CHARS = 256
MAX_METADATA_VALUE_CHARS = 4096

# storage kind -> (the kind's segment in tinker:// paths, Tinker's checkpoint_type)
KINDS = {"state": ("weights", "training"), "sampler": ("sampler_weights", "sampler"),
         "external": ("external_weights", "external")}
TINKER_KINDS = {segment: kind for kind, (segment, _) in KINDS.items()}

_Key = Annotated[str, StringConstraints(min_length=1, max_length=MAX_METADATA_KEY_CHARS)]
_METADATA = TypeAdapter(dict[_Key, Any])


def user_metadata(value: Any, field_name: str = "user_metadata") -> dict[str, str] | None:
    """A client's labels as ``dict[str, str]`` (values given as other JSON types are written as text, as the
    SDK's response type wants strings), or None; a 400 naming the field past the bounds: at most 64 keys of
    at most 256 characters, values of at most 4096."""
    if value is None:
        return None
    try:
        labels = _METADATA.validate_python(value)
    except ValidationError as exc:
        first = first_error(exc)
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(field_name + (f".{where}" if where else ""), first.get("msg", "invalid")) from None
    if len(labels) > MAX_METADATA_KEYS:
        raise bad_request(field_name, f"{len(labels)} keys; at most {MAX_METADATA_KEYS}")
    out = {key: item if isinstance(item, str) else _text(item) for key, item in labels.items()}
    for key, text in out.items():
        if len(text) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"{field_name}.{key}", f"{len(text)} characters; at most {MAX_METADATA_VALUE_CHARS}")
    return out


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)


def iso(timestamp: float | None) -> str | None:
    """Seconds since the epoch as ISO-8601 UTC with a ``Z``."""
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def owner_label(tenant: str) -> str:
    """A non-secret label of an API key (``model_owner``): the key itself is never sent."""
    return "key-" + hashlib.sha256(tenant.encode()).hexdigest()[:12]


def tinker_path(ref: CheckpointRef) -> str:
    return f"tinker://{ref.run_id}/{KINDS[ref.kind][0]}/{ref.name}"


def checkpoint_record(ref: CheckpointRef, meta: dict, size: int | None) -> dict:
    """One checkpoint on disk as Tinker's ``Checkpoint`` (its ``tinker_path`` is the one its save returned)."""
    segment, checkpoint_type = KINDS[ref.kind]
    return {"checkpoint_id": f"{segment}/{ref.name}", "checkpoint_type": checkpoint_type,
            "time": iso(meta.get("created_at", 0.0)), "tinker_path": tinker_path(ref), "size_bytes": size,
            "public": False, "user_metadata": meta.get("user_metadata"), "expires_at": iso(expires_at(meta))}


def training_run_record(run_id: str, tenant: str, base_model: str, lora_rank: int | None,
                        last_request_time: float, labels: dict[str, str] | None,
                        checkpoints: list[tuple[CheckpointRef, dict, int]]) -> dict:
    """Tinker's ``TrainingRun``: ``checkpoints`` are the run's (any order); the newest of each kind is named."""
    newest: dict[str, dict] = {}
    for ref, meta, size in sorted(checkpoints, key=lambda c: c[1].get("created_at", 0.0)):
        newest[ref.kind] = checkpoint_record(ref, meta, size)
    return {"training_run_id": run_id, "base_model": base_model, "model_owner": owner_label(tenant), "is_lora": True,
            "corrupted": False, "lora_rank": lora_rank, "last_request_time": iso(last_request_time),
            "last_checkpoint": newest.get("state"), "last_sampler_checkpoint": newest.get("sampler"),
            "user_metadata": labels}

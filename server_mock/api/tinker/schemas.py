"""The Tinker API's JSON request bodies, declared: each route's fields, their types and their bounds.

Field names and defaults follow the official ``tinker`` SDK's request types. Fields the worker does not read are
ignored (never turned into Python objects); every list has a structural bound checked while the body is parsed
(``pytrio_compat.types.bounds``), with validation stopping at the first bad item, and the worker's own limits are
checked after parsing, as for the other protocols. ``parse`` turns the first validation error into a 400 naming
the field, in the words the Tinker routes have always used ("session_id: required", "seq_id: must be an
integer, got 'x'").
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, StrictBool, StrictInt, StrictStr
from pydantic import ValidationError as PydanticValidationError

from pytrio_compat.wire import MAX_ITEMS, MAX_KEYS, MAX_TOKENS, AdamParams, bounded_dict, bounded_list
from server_mock.api.bodies import BodyLimit, check_values, first_error
from server_mock.errors import WorkerError, bad_request


class TinkerBody(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    _fingerprint: str | None = PrivateAttr(default=None)

    def received(self, fingerprint: str) -> None:
        """The fingerprint of the bytes this body was read from (``api.endpoint.fingerprint``)."""
        self._fingerprint = fingerprint

    def digest(self) -> str:
        """What tells a re-sent request (the same digest) from a different one under the same id: the fingerprint of
        its bytes as received (a body made here, not read, hashes its JSON)."""
        return self._fingerprint or hashlib.sha256(self.model_dump_json().encode()).hexdigest()


# --- sessions and training models ---------------------------------------------------------------------------

# a client's labels, checked after parsing by records.user_metadata (64 keys, values of 4096 characters)
Labels = bounded_dict(Any, MAX_KEYS) | None


class CreateSession(TinkerBody):
    """Its labels are kept for the REST API (tags and the SDK version are not)."""

    user_metadata: Labels = None
    display_name: StrictStr | None = None


class Heartbeat(TinkerBody):
    session_id: StrictStr | None = None


class LoraConfig(TinkerBody):
    rank: StrictInt | None = None
    seed: StrictInt | None = None
    train_mlp: StrictBool | None = None
    train_attn: StrictBool | None = None
    train_unembed: StrictBool | None = None


class OptimizerConfig(TinkerBody):
    type: StrictStr = "adamw"


class CreateModel(TinkerBody):
    session_id: StrictStr
    model_seq_id: StrictInt
    base_model: StrictStr
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None
    user_metadata: Labels = None


class GetInfo(TinkerBody):
    model_id: StrictStr


# --- operations of a training model, in seq_id order ----------------------------------------------------------


class ModelOp(TinkerBody):
    """What every operation of a training model carries: enough to use up its seq_id even when the rest of the
    body is refused (``submit.read_op``)."""

    model_id: StrictStr
    seq_id: StrictInt | None = None


class Adam(AdamParams):
    """AdamW's parameters as the client sends them (``type`` names the optimizer; other fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    type: StrictStr | None = None

    def params(self) -> AdamParams:
        return AdamParams(**self.model_dump(exclude={"type"}))


class OptimStep(ModelOp):
    adam_params: Adam | None = None
    optim_params: Adam | None = None
    optimizer_params: Adam | None = None


class SaveWeights(ModelOp):
    path: StrictStr | None = None
    ttl_seconds: StrictInt | None = None
    overwrite: StrictBool = False
    user_metadata: Labels = None


class SaveWeightsExternal(ModelOp):
    """An export for download (``api/tinker/export.py``); the recipients are checked by ``parse_recipients``."""

    path: StrictStr
    ttl_seconds: StrictInt | None = None
    age_encryption_recipients: bounded_list(StrictStr, MAX_ITEMS) | None = None


class SaveWeightsForSampler(ModelOp):
    path: StrictStr | None = None
    ttl_seconds: StrictInt | None = None
    user_metadata: Labels = None


class LoadWeights(TinkerBody):
    """Into an existing model (``model_id`` + ``seq_id``), or into a new one (``session_id`` + ``model_seq_id``)."""

    path: StrictStr
    optimizer: StrictBool = False
    model_id: StrictStr | None = None
    seq_id: StrictInt | None = None
    session_id: StrictStr | None = None
    model_seq_id: StrictInt | None = None
    base_model: StrictStr | None = None
    user_metadata: Labels = None


class WeightsInfo(TinkerBody):
    tinker_path: StrictStr


# --- sampling ---------------------------------------------------------------------------------------------


class CreateSamplingSession(TinkerBody):
    session_id: StrictStr
    sampling_session_seq_id: StrictInt
    base_model: StrictStr | None = None
    model_path: StrictStr | None = None


class Chunk(TinkerBody):
    type: StrictStr = "encoded_text"
    tokens: bounded_list(StrictInt, MAX_TOKENS) | None = None
    # an image chunk: base64 bytes, png or jpeg, and the client's token count (checked by the worker)
    data: StrictStr | None = None
    format: StrictStr | None = None
    expected_tokens: StrictInt | None = None


class Prompt(TinkerBody):
    chunks: bounded_list(Chunk, MAX_ITEMS)


class SamplingParams(TinkerBody):
    max_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_k: StrictInt = -1
    top_p: float = 1.0
    seed: StrictInt | None = None
    stop: StrictStr | bounded_list(StrictStr, MAX_ITEMS) | bounded_list(StrictInt, MAX_ITEMS) | None = None


class Asample(TinkerBody):
    sampling_session_id: StrictStr | None = None
    seq_id: StrictInt | None = None
    base_model: StrictStr | None = None
    model_path: StrictStr | None = None
    prompt: Prompt | None = None
    num_samples: StrictInt = 1
    sampling_params: SamplingParams | None = None
    prompt_logprobs: StrictBool | None = None
    prompt_logprobs_last_n: StrictInt | None = None
    topk_prompt_logprobs: StrictInt | None = None
    topk_sample_logprobs: StrictInt | None = None  # refused unless 0
    prompt_alt_tokens_k: StrictInt | None = None  # refused unless 0
    target_prompt_logprobs: Any = None  # refused unless null
    record_stability_info: StrictBool | None = None  # stable_reinforce: keep what each sequence was


class RetrieveFuture(TinkerBody):
    request_id: StrictStr


# --- parsing --------------------------------------------------------------------------------------------------

_WORDS = {"string_type": "must be a string", "bool_type": "must be true or false", "list_type": "must be a list",
          "model_type": "must be an object", "model_attributes_type": "must be an object",
          "dict_type": "must be an object", "float_type": "must be a number", "float_parsing": "must be a number",
          "finite_number": "must be a finite number"}
_INT_TYPES = ("int_type", "int_parsing", "int_from_float")


def _where(loc: tuple) -> str:
    """A location as ``prompt.chunks[0].tokens`` (union member tags dropped)."""
    out = ""
    for part in loc:
        text = str(part)
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in text or text in ("str", "int", "bool", "float") or text.startswith("function-"):
            continue
        else:
            out += f".{text}" if out else text
    return out


def _shown(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return f"a {'list' if isinstance(value, list) else 'object'} of {len(value)} items"
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**64) < value < 2**64:
        return f"a {value.bit_length()}-bit integer"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_error(exc: PydanticValidationError) -> WorkerError:
    """The first error of a refused body, as a 400 naming its field."""
    first = first_error(exc)
    kind, loc = first.get("type", ""), tuple(first.get("loc", ()))
    if kind in ("json_invalid", "json_type"):  # lone surrogate escapes (\ud800) are refused here too
        why = first.get("msg", "").removeprefix("Invalid JSON: ")
        return WorkerError(400, "invalid_json", f"body: not valid JSON (or not UTF-8): {why}", "body")
    where = _where(loc)
    if not where:
        return WorkerError(400, "invalid_json", "body: expected a JSON object", "body")
    value = first.get("input")
    if kind == "missing" or (value is None and kind != "too_long"):
        return bad_request(where, "required")
    if kind in _INT_TYPES:
        return bad_request(where, f"must be an integer, got {_shown(value)}")
    words = _WORDS.get(kind)
    if words:
        return bad_request(where, f"{words}, got {_shown(value)}")
    return bad_request(where, first.get("msg", "invalid"))


def parse(model: type[TinkerBody], raw: bytes, limit: BodyLimit | None = None) -> TinkerBody:
    """``raw`` (an empty body is ``{}``) validated into ``model``; a 400 naming the first bad field."""
    if limit is not None:
        check_values(raw, limit)
    try:
        return model.model_validate_json(raw or b"{}")
    except PydanticValidationError as exc:
        raise validation_error(exc) from None

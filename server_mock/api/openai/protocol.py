"""Request bodies of the OpenAI-compatible API: which fields are served, which are refused, and their checks.

A field is either served, or refused with a 400 that names it. A field sent as ``null``, or with the
value that means "off" (``frequency_penalty: 0``, ``logit_bias: {}``, ``echo: false``, ...), asks for
nothing and is accepted; any other value of an unsupported field is refused, never silently ignored.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from typing import Annotated, Any

from annotated_types import MinLen

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic import ValidationError as PydanticValidationError

from pytrio_compat.wire import MAX_TOKENS, bounded_dict, bounded_list
from server_mock.api.bodies import first_error
from server_mock.errors import WorkerError
from server_mock.service.validation import describe_int

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_LISTED_STOPS = 1024  # a longer stop list is refused while it is parsed (more than 4 are refused after)
MAX_PROMPTS = 4096  # prompts of one completions request (n x prompts is bounded by --max-num-samples after)
MAX_MESSAGES = 1 << 16  # messages of one chat
MAX_PARTS = 1 << 12  # content parts of one message
MAX_UNKNOWN_ITEMS = 16  # of a field the worker does not serve: the "off" values are [], {} or a short one
MAX_TOP_LOGPROBS = 20  # chat top_logprobs (and the worker's top-k prompt logprobs limit)
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions `logprobs` integer
ROLES = ("system", "developer", "user", "assistant")

# Unsupported fields, with the values that ask for nothing (accepted) and why anything else is refused.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "echo": (False,), "best_of": (1,), "suffix": ("",), "store": (False,), "tools": ([],), "functions": ([],),
    "tool_choice": ("none",), "function_call": ("none",), "parallel_tool_calls": (False,),
    "response_format": ({"type": "text"},), "modalities": (["text"],), "metadata": ({},),
}
_REASONS = {
    "tools": "tool calling is not supported by this worker", "functions": "function calling is not supported",
    "tool_choice": "tool calling is not supported", "function_call": "function calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "response_format": "structured output is not supported; only {\"type\": \"text\"}",
    "logit_bias": "logit_bias is not supported; only {} (no bias)",
    "frequency_penalty": "penalties are not supported; only 0",
    "presence_penalty": "penalties are not supported; only 0",
    "repetition_penalty": "penalties are not supported; only 1",
    "echo": "echo is not supported; only false", "best_of": "best_of is not supported; only 1 (use n)",
    "suffix": "suffix (insertion) is not supported", "store": "stored completions are not supported; only false",
    "modalities": "only [\"text\"] is supported", "metadata": "metadata is not stored by this worker",
    "audio": "audio output is not supported", "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported", "service_tier": "service tiers are not supported",
    "user": "user is not recorded by this worker", "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported",
}


_Scalar = StrictStr | StrictInt | StrictFloat | StrictBool | None
_Shallow = _Scalar | bounded_list(_Scalar, MAX_UNKNOWN_ITEMS) | bounded_dict(_Scalar, MAX_UNKNOWN_ITEMS)
# the value of a field the worker does not serve: enough of it to tell "off" from not, and to show it; a longer or
# deeper one is refused without being built
_Unknown = _Shallow | bounded_list(_Shallow, MAX_UNKNOWN_ITEMS) | bounded_dict(_Shallow, MAX_UNKNOWN_ITEMS)


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")  # image_url, input_audio, ...: refused by type below
    __pydantic_extra__: dict[str, _Unknown]
    type: StrictStr
    text: StrictStr | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr | bounded_list(_Part, MAX_PARTS)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Every served field may be sent as null, which asks for its default (``DEFAULTS``); fields that are not
    served are kept (``_Unknown``) to be checked against their "off" values."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, _Unknown]
    model: StrictStr | None = None
    n: StrictInt | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None  # an extension (vLLM's name): -1 is off
    stop: StrictStr | bounded_list(StrictStr, MAX_LISTED_STOPS) | None = None
    seed: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: _StreamOptions | None = None
    return_token_ids: StrictBool | None = None  # an extension (vLLM's name): token ids in each choice


class ChatBody(_Common):
    messages: bounded_list(_Message, MAX_MESSAGES) | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


_TokenIds = Annotated[bounded_list(StrictInt, MAX_TOKENS), MinLen(1)]


class CompletionBody(_Common):
    # a list of token ids must not be empty: checked while parsing, so that [[], [], ...] stops at its first
    prompt: (StrictStr | bounded_list(StrictStr, MAX_PROMPTS) | _TokenIds
             | bounded_list(_TokenIds, MAX_PROMPTS) | None) = None
    logprobs: StrictInt | None = None


EMPTY_PROMPT = "must be a non-empty string, a non-empty list of token ids, or a list of them"
DEFAULTS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stream": False, "return_token_ids": False}
CHAT_DEFAULTS = {**DEFAULTS, "logprobs": False}
REQUIRED = {ChatBody: ("model", "messages"), CompletionBody: ("model", "prompt")}


@dataclass
class Generation:
    """One validated request: what to sample, for each prompt, and how to answer."""

    model: str
    n: int
    max_tokens: int | None  # None: up to the model's context (and the worker's max_sample_tokens)
    max_tokens_field: str
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    prompts: list[str | list[int]] = field(default_factory=list)  # completions


def invalid(param: str, message: str, status: int = 400, code: str = "invalid_value") -> WorkerError:
    return WorkerError(status, code, f"{param}: {message}", param)


def parse_chat(body: bytes, max_samples: int, max_sample_tokens: int) -> Generation:
    """A chat request body (JSON bytes), checked."""
    req = _validate(ChatBody, body)
    if not req.messages:
        raise invalid("messages", "must hold at least one message")
    messages = []
    for i, message in enumerate(req.messages):
        if message.role not in ROLES:
            tools = " (tool calling is not supported)" if message.role in ("tool", "function") else ""
            raise invalid(f"messages[{i}].role", f"{_short(message.role)} is not supported; use one of "
                                                 f"{', '.join(ROLES)}{tools}")
        if isinstance(message.content, str):
            text = message.content
        else:
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise invalid(f"messages[{i}].content[{j}]", f"{_short(part.type)} parts are not supported: "
                                  "this worker serves text models (send {\"type\": \"text\", \"text\": ...})",
                                  code="unsupported_parameter")
            text = "".join(part.text or "" for part in message.content)
        messages.append({"role": message.role, "content": text})
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise invalid("max_completion_tokens", "differs from max_tokens; send one of them")
    limit_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    top = req.top_logprobs or 0
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if top and not req.logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    gen = _common(req, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
                  limit_field, max_samples, max_sample_tokens, 1, req.logprobs, top)
    gen.messages = messages
    return gen


def parse_completion(body: bytes, max_samples: int, max_sample_tokens: int) -> Generation:
    """A completions request body (JSON bytes), checked."""
    req = _validate(CompletionBody, body)
    prompt = req.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        prompts: list[str | list[int]] = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise invalid("prompt", EMPTY_PROMPT)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}")
    gen = _common(req, req.max_tokens, "max_tokens", max_samples, max_sample_tokens, len(prompts),
                  req.logprobs is not None, req.logprobs or 0)
    gen.prompts = prompts
    return gen


def _common(req: _Common, max_tokens: int | None, max_field: str, max_samples: int, max_sample_tokens: int,
            prompts: int, logprobs: bool, top_logprobs: int) -> Generation:
    if req.n < 1:
        raise invalid("n", f"must be >= 1, got {req.n}")
    if req.n * prompts > max_samples:
        what = f"n ({req.n})" + (f" x {prompts} prompts" if prompts > 1 else "")
        raise invalid("n", f"{what} exceeds limit max_num_samples={max_samples}", 413, "limit_exceeded")
    if max_tokens is not None and max_tokens < 1:
        raise invalid(max_field, f"must be >= 1, got {max_tokens}")
    if max_tokens is not None and max_tokens > max_sample_tokens:
        raise invalid(max_field, f"{max_tokens} exceeds limit max_sample_tokens={max_sample_tokens}", 413,
                      "limit_exceeded")
    if not math.isfinite(req.temperature) or not 0 <= req.temperature <= 2:
        raise invalid("temperature", f"must be in [0, 2], got {req.temperature}")
    if not math.isfinite(req.top_p) or not 0 < req.top_p <= 1:
        raise invalid("top_p", f"must be in (0, 1], got {req.top_p} (use temperature 0 for greedy decoding)")
    if req.top_k < -1:
        raise invalid("top_k", f"must be -1 (off) or >= 0, got {req.top_k}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_SEQUENCES or any(not s for s in stop):  # their length: the worker's limit
        raise invalid("stop", f"must be up to {MAX_STOP_SEQUENCES} non-empty strings")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise invalid("seed", "must fit in 64 bits")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "only allowed with stream: true")
    return Generation(
        model=req.model, n=req.n, max_tokens=max_tokens, max_tokens_field=max_field, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, stop=stop, seed=req.seed, stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage), logprobs=logprobs,
        top_logprobs=top_logprobs, return_token_ids=req.return_token_ids,
    )


def _validate(model: type[_Common], raw: bytes):
    """The body validated into ``model`` straight from its JSON (no Python object is built for a list that is
    refused); nulls take the fields' defaults, and a field the worker does not serve is accepted only with its
    "off" value."""
    if not raw.strip():
        raise invalid("body", "expected a JSON object", code="invalid_json")
    try:
        req = model.model_validate_json(raw)
    except PydanticValidationError as exc:
        first = first_error(exc)
        kind = first.get("type")
        if kind in ("json_invalid", "json_type"):  # a lone surrogate escape (\ud800) is refused here too
            raise invalid("body", f"not valid JSON ({first.get('msg', '').removeprefix('Invalid JSON: ')})",
                          code="invalid_json") from None
        loc = [str(p) for p in first.get("loc", ()) if not _is_union_tag(str(p))]
        if kind == "model_type" and not loc:
            raise invalid("body", "expected a JSON object", code="invalid_json") from None
        if loc and loc[0] not in model.model_fields:  # a field not served, with a long or deep value
            reason = _REASONS.get(loc[0], "this field is not supported by this worker")
            raise invalid(loc[0], f"{reason} (got a longer or deeper value than it could take)",
                          code="unsupported_parameter") from None
        param = loc[0] if loc else "body"
        for part in loc[1:]:
            param += f"[{part}]" if part.isdigit() else f".{part}"
        if kind == "missing":
            raise invalid(param, "required", code="missing_required_parameter") from None
        kinds = {e["type"] for e in exc.errors(include_url=False, include_context=False, include_input=False)
                 if e["loc"][:1] == ("prompt",)} if exc.error_count() <= 64 else set()
        if kinds & {"too_short", "too_long"}:
            raise invalid("prompt", f"{EMPTY_PROMPT}; at most {MAX_PROMPTS} prompts in one request") from None
        if kind == "extra_forbidden":
            raise invalid(param, "this field is not supported", code="unsupported_parameter") from None
        raise invalid(param, f"{first.get('msg', 'invalid')} (got {_short(first.get('input'))})") from None
    for key, value in (req.model_extra or {}).items():
        if value is None:
            continue  # null: the field is not set
        if key in _OFF_VALUES and any(_same(value, off) for off in _OFF_VALUES[key]):
            continue
        reason = _REASONS.get(key, "this field is not supported by this worker")
        raise invalid(key, f"{reason} (got {_short(value)})", code="unsupported_parameter")
    for name in REQUIRED[model]:
        if getattr(req, name) is None:
            raise invalid(name, "required", code="missing_required_parameter")
    for name, default in (CHAT_DEFAULTS if model is ChatBody else DEFAULTS).items():
        if getattr(req, name) is None:
            setattr(req, name, default)
    return req


def _is_union_tag(part: str) -> bool:
    return part in ("str", "int", "bool", "float", "none") or part.startswith(("list[", "dict[", "function-"))


def _same(value: Any, off: Any) -> bool:
    return type(value) is type(off) and value == off or (isinstance(off, int) and isinstance(value, (int, float))
                                                          and not isinstance(value, bool) and value == off)


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr (a few items of a list, a few levels deep), and integers too long to print as
    their size."""

    def repr_int(self, x: int, level: int) -> str:
        return describe_int(x)


_SHORT = _ShortRepr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 3, 6, 4, 50, 50


def _short(value: Any) -> str:
    """A short description of a sent value: never longer than 60 characters, and cheap for a huge one."""
    text = _SHORT.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

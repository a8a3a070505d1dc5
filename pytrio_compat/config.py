"""Process-wide settings: `configure()` plus the PYTRIO_* environment variables."""

from __future__ import annotations

import copy
import logging
import math
import os
import warnings
from dataclasses import dataclass, fields

# Keywords that older PyTRIO releases accepted and that published scripts still pass. PyTRIO 0.2.9
# fails on them at start-up; we map them onto their modern equivalents instead.
_LEGACY_ALIASES = {
    "timeout": "request_timeout_seconds",
    "actor_event_wait_timeout": "actor_event_polling_timeout_seconds",
    "actor_event_request_timeout": "actor_event_submit_timeout_seconds",
    "sampling_timeout": "sampling_timeout_seconds",  # PyTRIO 0.2.8
}

# PyTRIO options that have no counterpart here. configure() refuses them with this hint rather than
# accept and ignore them; a value in _HARMLESS_VALUES asks for nothing and is accepted.
_UNSUPPORTED = {
    "actor_capacity_poll_interval_seconds": "a full worker answers 429, which is retried within "
                                            "control_retry_timeout_seconds: set that instead",
    "actor_capacity_poll_jitter_ratio": "a full worker answers 429, which is retried with retry_jitter_ratio",
    "actor_capacity_wait_timeout_seconds": "a full worker answers 429, which is retried within "
                                           "control_retry_timeout_seconds: set that instead",
    "sampling_first_chunk_timeout_seconds": "sampling results are not streamed here: use sampling_timeout_seconds",
    "sampling_chunk_idle_timeout_seconds": "sampling results are not streamed here: use sampling_timeout_seconds",
    "training_event_queue_capacity": "calls wait for a slot without a local queue limit: "
                                     "use training_event_max_in_flight",
    "sampling_request_queue_capacity": "calls wait for a slot without a local queue limit: "
                                       "use sampling_request_max_in_flight",
    "actor_heartbeat_enabled": "training runs need no heartbeats here (only actor_heartbeat_enabled=False is "
                               "accepted)",
    "actor_heartbeat_interval_seconds": "training runs need no heartbeats here",
    "actor_heartbeat_max_in_flight": "training runs need no heartbeats here",
    "home": "there are no profiles under ~/.pytrio: use configure(base_url=..., api_key=...) or PYTRIO_BASE_URL / "
            "PYTRIO_API_KEY",
    "env": "there are no profiles under ~/.pytrio: use configure(base_url=..., api_key=...) or PYTRIO_BASE_URL / "
           "PYTRIO_API_KEY",
}
_HARMLESS_VALUES = {"actor_heartbeat_enabled": (False,)}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# option -> (kind, lowest allowed value, whether the lowest is allowed)
_BOUNDS: dict[str, tuple[type, float, bool]] = {
    "request_timeout_seconds": (float, 0, False),
    "retry_max_attempts": (int, 1, True),
    "retry_initial_delay_seconds": (float, 0, True),
    "retry_multiplier": (float, 1, True),
    "retry_max_delay_seconds": (float, 0, True),
    "retry_jitter_ratio": (float, 0, True),
    "training_retry_timeout_seconds": (float, 0, True),
    "control_retry_timeout_seconds": (float, 0, True),
    "sampling_retry_timeout_seconds": (float, 0, True),
    "actor_event_submit_timeout_seconds": (float, 0, False),
    "actor_event_polling_timeout_seconds": (float, 0, False),
    "sampling_timeout_seconds": (float, 0, False),
    "training_event_max_in_flight": (int, 1, True),
    "sampling_request_max_in_flight": (int, 1, True),
}


@dataclass
class Configuration:
    """Every option is used: where each takes effect is noted beside it."""

    api_key: str = ""
    base_url: str = ""
    request_timeout_seconds: float = 30  # HTTP timeout of control requests (and the default one)
    retry_max_attempts: int = 3  # attempts of a download (the tokenizer files)
    retry_initial_delay_seconds: float = 0.5  # backoff of every retried request
    retry_multiplier: float = 2.0
    retry_max_delay_seconds: float = 30.0
    retry_jitter_ratio: float = 0.1
    training_retry_timeout_seconds: float = 900  # retry window: training ops, submitted and polled
    control_retry_timeout_seconds: float = 900  # retry window: everything else
    sampling_retry_timeout_seconds: float = 900  # retry window: sample requests, submitted and polled
    actor_event_submit_timeout_seconds: float = 30  # HTTP timeout of submitting a training op or a sample
    actor_event_polling_timeout_seconds: float = 30  # how long one poll waits for a result
    sampling_timeout_seconds: float = 14400  # total time one sample call may take
    training_event_max_in_flight: int = 16  # training ops per TrainingClient submitted and not finished
    sampling_request_max_in_flight: int = 16  # sample calls per SamplingClient running at once
    log_level: str = "INFO"
    # Embedded worker (used when no base_url is configured)
    embedded_worker_args: tuple[str, ...] = ()


_CONFIG = Configuration()


def _strip_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if url.endswith("/api"):
        url = url[: -len("/api")]
    return url.rstrip("/")


def _apply_environment() -> None:
    env_key = os.environ.get("PYTRIO_API_KEY", "").strip()
    env_url = os.environ.get("PYTRIO_BASE_URL", "").strip()
    level = os.environ.get("PYTRIO_LOG_LEVEL", "").strip()
    if env_key:
        _CONFIG.api_key = env_key
    if env_url:
        _CONFIG.base_url = _strip_base_url(env_url)
    if level:
        _set_log_level(level)


def _set_log_level(level: str) -> None:
    from .errors import ConfigurationError

    name = level.upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigurationError(
            f"invalid log level {level!r}", code="configuration.invalid_environment",
            hint="use one of DEBUG, INFO, WARNING, ERROR, CRITICAL",
        )
    _CONFIG.log_level = name
    logging.getLogger("pytrio_compat").setLevel(name)


def configure(**kwargs: object) -> None:
    """Change process-wide settings. ``None`` leaves a value unchanged.

    Every option is honoured (see ``Configuration``). PyTRIO options with no counterpart here are
    refused with a ``ConfigurationError`` that says what to use instead; unknown keywords warn, as in
    PyTRIO. The options are all checked before any is changed.
    """
    known = {f.name for f in fields(Configuration)}
    changes: list[tuple[str, object]] = []
    for key, value in kwargs.items():
        if value is None:
            continue
        target = _LEGACY_ALIASES.get(key, key)
        if target in _UNSUPPORTED:
            if any(value is harmless for harmless in _HARMLESS_VALUES.get(target, ())):
                continue
            raise _config_error(f"configure({key}=...) is not supported by pytrio_compat: {_UNSUPPORTED[target]}",
                                "configuration.unsupported_option", f"remove {key} from the configure() call")
        if target not in known:
            warnings.warn(f"Unknown configuration option {key!r} was ignored.", UserWarning, stacklevel=2)
            continue
        changes.append((target, _checked(key, target, value)))
    for target, value in changes:
        if target == "log_level":
            _set_log_level(str(value))
        else:
            setattr(_CONFIG, target, value)


def _checked(key: str, target: str, value: object) -> object:
    if target == "base_url":
        return _strip_base_url(str(value))
    if target == "api_key":
        return str(value).strip()
    if target == "log_level":
        if str(value).strip().upper() not in _LOG_LEVELS:
            raise _config_error(f"invalid log level {value!r}", "configuration.invalid_value",
                                f"use one of {', '.join(_LOG_LEVELS)}")
        return str(value).strip()
    if target == "embedded_worker_args":
        return tuple(str(v) for v in value)  # type: ignore[union-attr]
    kind, low, inclusive = _BOUNDS[target]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise _config_error(f"configure({key}=...) must be {'an integer' if kind is int else 'a number'}, "
                            f"got {value!r}", "configuration.invalid_value")
    if not math.isfinite(value) or value < low or (value == low and not inclusive):
        want = f">= {low}" if inclusive else f"> {low}"
        raise _config_error(f"configure({key}=...) must be {want}, got {value!r}", "configuration.invalid_value")
    return kind(value)


def _config_error(message: str, code: str, hint: str | None = None) -> Exception:
    from .errors import ConfigurationError

    return ConfigurationError(message, code=code, hint=hint)


def snapshot() -> Configuration:
    """A private copy for one client: later configure() calls do not change running clients."""
    return copy.deepcopy(_CONFIG)


_apply_environment()

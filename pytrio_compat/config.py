"""Process-wide settings: `configure()` plus the PYTRIO_* environment variables."""

from __future__ import annotations

import copy
import logging
import os
import warnings
from dataclasses import dataclass, fields

# Keywords that older PyTRIO releases accepted and that published scripts still pass. PyTRIO 0.2.9
# fails on them at start-up; we map them onto their modern equivalents instead.
_LEGACY_ALIASES = {
    "timeout": "request_timeout_seconds",
    "actor_event_wait_timeout": "actor_event_polling_timeout_seconds",
    "actor_event_request_timeout": "actor_event_submit_timeout_seconds",
}


@dataclass
class Configuration:
    api_key: str = ""
    base_url: str = ""
    request_timeout_seconds: float = 30
    retry_max_attempts: int = 3
    retry_initial_delay_seconds: float = 0.5
    retry_multiplier: float = 2.0
    retry_max_delay_seconds: float = 30.0
    retry_jitter_ratio: float = 0.1
    training_retry_timeout_seconds: float = 900
    control_retry_timeout_seconds: float = 900
    sampling_retry_timeout_seconds: float = 900
    actor_event_submit_timeout_seconds: float = 30
    actor_event_polling_timeout_seconds: float = 30
    sampling_timeout_seconds: float = 14400
    training_event_max_in_flight: int = 16
    sampling_request_max_in_flight: int = 16
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
    """Change process-wide settings. ``None`` leaves a value unchanged; unknown keys warn, never fail."""
    known = {f.name for f in fields(Configuration)}
    for key, value in kwargs.items():
        if value is None:
            continue
        target = _LEGACY_ALIASES.get(key, key)
        if target not in known:
            warnings.warn(f"Unknown configuration option {key!r} was ignored.", UserWarning, stacklevel=2)
            continue
        if target == "base_url":
            value = _strip_base_url(str(value))
        if target == "log_level":
            _set_log_level(str(value))
            continue
        setattr(_CONFIG, target, value)


def snapshot() -> Configuration:
    """A private copy for one client: later configure() calls do not change running clients."""
    return copy.deepcopy(_CONFIG)


_apply_environment()

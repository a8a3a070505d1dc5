"""ServiceClient: the entry point. Connects to a worker (or starts one) and creates the other clients."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from .config import snapshot
from .embedded import EmbeddedWorker
from .errors import APIError, DependencyError, ValidationError
from .rest_client import RestClient
from .runtime import Runtime
from .sampling_client import SamplingClient
from .training_client import TrainingClient
from .types import GetServerCapabilitiesResponse
from .wire import (
    CheckpointConfig,
    CreateSampler,
    CreateTrainingRun,
    LoraSpec,
    SamplerInfo,
    TokenizerFiles,
    TrainingRunInfo,
)

logger = logging.getLogger("pytrio_compat")


def _install_log_handler() -> None:
    if any(getattr(h, "_pytrio_compat", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("trio: %(message)s"))
    handler._pytrio_compat = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


class ServiceClient:
    """``ServiceClient(api_key=None, base_url=None)``.

    Where the worker is: ``base_url`` argument, else ``PYTRIO_BASE_URL`` / ``configure(base_url=...)``,
    else a worker started for this process on a free loopback port (stopped by ``close()`` or at exit).
    """

    def __init__(self, api_key: str | None = None, base_url: str | None = None, *,
                 _transport: Any = None, **_ignored: Any) -> None:
        _install_log_handler()
        self._config = snapshot()
        self._embedded: EmbeddedWorker | None = None
        base = (base_url or self._config.base_url or "").rstrip("/")
        key = api_key or self._config.api_key
        if not base:
            self._embedded = EmbeddedWorker(tuple(self._config.embedded_worker_args))
            base, key = self._embedded.base_url, self._embedded.api_key
        self.base_url = base
        self._runtime = Runtime(base, key or "", self._config, transport=_transport)
        self._tokenizers: dict[str, Any] = {}
        self._tokenizer_lock = threading.Lock()
        try:
            self._runtime.run(self._runtime.request("GET", "/v1/health", operation="health", retry_window=30))
            self._runtime.run(self._runtime.request("GET", "/v1/whoami", operation="verify api key", retry_window=30))
        except BaseException:
            self.close()
            raise

    # --- lifecycle ----------------------------------------------------------------------------------

    def close(self) -> None:
        self._runtime.close() if hasattr(self, "_runtime") else None
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- capabilities -------------------------------------------------------------------------------

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        return self._runtime.run(self._capabilities())

    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        return await self._runtime.run_async(self._capabilities())

    async def _capabilities(self) -> GetServerCapabilitiesResponse:
        raw = await self._runtime.request("GET", "/v1/capabilities", operation="get_server_capabilities")
        return GetServerCapabilitiesResponse.model_validate(raw)

    def get_supported_models(self) -> list[str]:
        return [m.model_name for m in self.get_server_capabilities().supported_models]

    # --- training clients ---------------------------------------------------------------------------

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    **_ignored: Any) -> TrainingClient:
        if not isinstance(rank, int) or not 4 <= rank <= 64:
            raise ValidationError(f"rank must be in [4, 64]. Got {rank}", code="validation.invalid_lora_rank")
        if not (train_mlp or train_attn or train_unembed):
            raise ValidationError("at least one of train_mlp, train_attn, train_unembed must be True",
                                  code="validation.no_trainable_modules")
        body = CreateTrainingRun(base_model=base_model, lora=LoraSpec(
            rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed))
        return self._create_training_run(body)

    async def create_lora_training_client_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return await asyncio.to_thread(self.create_lora_training_client, *args, **kwargs)

    def create_training_client_from_state(self, path: str) -> TrainingClient:
        return self._create_training_run(CreateTrainingRun(from_checkpoint=path, load_optimizer=False))

    def create_training_client_from_state_with_optimizer(self, path: str) -> TrainingClient:
        return self._create_training_run(CreateTrainingRun(from_checkpoint=path, load_optimizer=True))

    async def create_training_client_from_state_async(self, path: str) -> TrainingClient:
        return await asyncio.to_thread(self.create_training_client_from_state, path)

    async def create_training_client_from_state_with_optimizer_async(self, path: str) -> TrainingClient:
        return await asyncio.to_thread(self.create_training_client_from_state_with_optimizer, path)

    def _create_training_run(self, body: CreateTrainingRun) -> TrainingClient:
        raw = self._runtime.run(self._runtime.request(
            "POST", "/v1/training_runs", body=body, operation="create_training_run", idempotent=False,
            timeout=self._config.request_timeout_seconds + 600))  # may load the base model first
        return TrainingClient(self, TrainingRunInfo.model_validate(raw))

    def get_checkpoint_config(self, path: str) -> CheckpointConfig:
        raw = self._runtime.run(self._runtime.request("GET", "/v1/checkpoint_config", params={"path": path},
                                                      operation="checkpoint_config"))
        return CheckpointConfig.model_validate(raw)

    # --- sampling clients ---------------------------------------------------------------------------

    def create_sampling_client(self, base_model: str | None = None, model_path: str | None = None,
                               **_ignored: Any) -> SamplingClient:
        if not base_model and not model_path:
            raise ValidationError("create_sampling_client needs base_model or model_path",
                                  code="validation.missing_base_model")
        raw = self._runtime.run(self._runtime.request(
            "POST", "/v1/samplers", body=CreateSampler(base_model=base_model, model_path=model_path),
            operation="create_sampling_client", idempotent=False,
            timeout=self._config.request_timeout_seconds + 600))
        return SamplingClient(self, SamplerInfo.model_validate(raw))

    async def create_sampling_client_async(self, *args: Any, **kwargs: Any) -> SamplingClient:
        return await asyncio.to_thread(self.create_sampling_client, *args, **kwargs)

    def create_rest_client(self) -> RestClient:
        return RestClient(self)

    # --- tokenizer ----------------------------------------------------------------------------------

    def _tokenizer_for(self, model: str) -> Any:
        """The worker's own tokenizer files, cached locally, so the client never needs the worker's disk."""
        with self._tokenizer_lock:
            if model in self._tokenizers:
                return self._tokenizers[model]
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:
                raise DependencyError("get_tokenizer needs transformers: pip install transformers",
                                      code="dependency.missing_tokenizer_backend") from exc
            try:
                raw = self._runtime.run(self._runtime.request("GET", "/v1/tokenizer", params={"model": model},
                                                              operation="get_tokenizer",
                                                              max_attempts=self._config.retry_max_attempts))
            except APIError:
                raise
            files = TokenizerFiles.model_validate(raw)
            digest = hashlib.sha256("".join(f"{k}:{v}" for k, v in sorted(files.files.items())).encode()).hexdigest()
            cache = Path(os.environ.get("PYTRIO_COMPAT_CACHE", Path.home() / ".cache" / "pytrio_compat"))
            folder = cache / "tokenizers" / digest[:24]
            if not (folder / ".complete").exists():
                folder.mkdir(parents=True, exist_ok=True)
                for name, content in files.files.items():
                    (folder / Path(name).name).write_bytes(base64.b64decode(content))
                (folder / ".complete").write_text(model)
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            self._tokenizers[model] = tokenizer
            return tokenizer

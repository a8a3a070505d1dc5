"""The worker's state and rules: models, training runs, samplers, snapshots and checkpoints.

Route handlers (server_mock/routes/) only parse and answer; everything that decides lives in the
service. ``WorkerService`` holds the state and the models; its methods come from one module per
resource: runs.py (training runs and their ops), samplers.py (samplers and sample requests),
checkpoints.py (checkpoints on disk) and quotas.py (each tenant's share of the caches and queue).
Requests are validated completely (validation.py) before they are queued, so a rejected request
never touches an adapter.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from pytrio_compat.wire import ModelOperationCapabilities, SupportedModel
from server_mock.config import Limits, TrainOptions
from server_mock.engine.host import ModelHost
from server_mock.engine.queue import ModelQueue
from server_mock.engine.requests import RequestStore
from server_mock.errors import WorkerError
from server_mock.lora import Layer, Snapshot
from server_mock.service.checkpoints import CheckpointsMixin
from server_mock.service.quotas import TenantLRU
from server_mock.service.runs import RunsMixin, TrainingRun
from server_mock.service.samplers import Sampler, SamplersMixin
from server_mock.storage.checkpoints import CheckpointStore
from server_mock.training import faults

logger = logging.getLogger("server_mock")

__all__ = ["Limits", "Sampler", "TrainingRun", "WorkerService"]


class WorkerService(RunsMixin, SamplersMixin, CheckpointsMixin):
    def __init__(self, models: dict[str, str], storage: str | Path, device: str, dtype: torch.dtype,
                 lazy_models: bool = False, limits: Limits | None = None, result_ttl: float = 3600.0,
                 allow_adapter_dirs: list[str] | None = None, fault_injection: bool | None = None,
                 train_options: TrainOptions | None = None, cluster=None) -> None:
        self.train_options = train_options or TrainOptions()
        self.cluster = cluster  # a server_mock.cluster.Cluster: models live on Ray actors (None: in this process)
        self.model_sources = dict(models)
        # local PEFT adapter folders may be sampled from only inside these (real paths, symlinks resolved)
        self.allow_adapter_dirs = [os.path.realpath(d) for d in (allow_adapter_dirs or [])]
        self.fault_injection = faults.enabled_by_environment() if fault_injection is None else fault_injection
        self._layouts: dict[str, dict[str, Layer]] = {}
        self.lazy_models = lazy_models
        self.device = device
        self.dtype = dtype
        self.limits = limits or Limits()
        self.store = CheckpointStore(storage)
        self.requests = RequestStore(result_ttl)
        self.hosts: dict[str, ModelHost] = {}
        self.queues: dict[str, ModelQueue] = {}
        self.runs: dict[str, TrainingRun] = {}
        # per-tenant caches: one tenant's volume only ever evicts its own entries
        self.samplers: TenantLRU[Sampler] = TenantLRU(self.limits.max_samplers)
        self.snapshots: TenantLRU[tuple[str, Snapshot]] = TenantLRU(self.limits.max_snapshots)  # path -> (model, snap)
        self.local_snapshots: TenantLRU[Snapshot] = TenantLRU(self.limits.max_snapshots)
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._tokenizer_files: dict[str, dict[str, str]] = {}
        self.started = time.time()

    # --- models ---------------------------------------------------------------------------------------

    def _source_for(self, name: str, field_name: str = "base_model") -> str:
        if name in self.model_sources:
            return self.model_sources[name]
        if self.lazy_models and name:
            return name
        served = ", ".join(sorted(self.model_sources)) or "none"
        raise WorkerError(404, "model_not_found", f"{field_name}: model {name!r} is not served here "
                                                  f"(served: {served}); start the worker with --model {name}=PATH",
                          field_name)

    async def host(self, name: str, field_name: str = "base_model") -> ModelHost:
        if name in self.hosts:
            return self.hosts[name]
        source = self._source_for(name, field_name)
        lock = self._load_locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self.hosts:
                logger.info("loading model %s from %s", name, source)
                try:
                    make_host = self.cluster.model_host if self.cluster is not None else ModelHost
                    host = await asyncio.to_thread(make_host, name, source, self.device, self.dtype,
                                                   self.limits.max_seq_len, self.train_options)
                except WorkerError:  # e.g. model_not_supported: already says what is missing
                    raise
                except Exception as exc:  # noqa: BLE001 - report why the model could not load
                    raise WorkerError(404 if self.lazy_models else 500, "model_load_failed",
                                      f"{field_name}: could not load model {name!r}: {exc}", field_name) from exc
                self.queues[name] = ModelQueue(name, asyncio.get_running_loop())
                if self.cluster is not None:  # samples go to the replicas from their own queue, beside training
                    self.queues[f"{name}:sampling"] = host.sampling_queue(asyncio.get_running_loop())
                self.hosts[name] = host
        return self.hosts[name]

    async def run_on_model(self, model: str, kind: str, fn, owner: str = "") -> dict:
        """Queue work on a model's thread, in ``owner``'s lane, and wait for it (short control operations)."""
        job = self.requests.new_job(kind, fn, owner)
        self.queues[model].put(job)
        await job.done.wait()
        if job.status == "failed":
            err = job.error
            raise WorkerError(400 if err.field else 500, err.code, err.message, err.field)
        return job.result or {}

    def queue_position(self, request_id: str) -> int | None:
        """How many requests run before this queued one (None once it runs, or if unknown)."""
        for queue in self.queues.values():
            position = queue.position(request_id)
            if position is not None:
                return position
        return None

    def capabilities(self) -> list[SupportedModel]:
        names = sorted(set(self.model_sources) | set(self.hosts))
        out = []
        for name in names:
            host = self.hosts.get(name)
            max_len = host.max_seq_len if host else None
            limits = ModelOperationCapabilities(available=True, max_seq_len=max_len,
                                                max_tokens_per_request=self.limits.max_tokens_per_request)
            out.append(SupportedModel(model_name=name, max_context_length=max_len, training=limits, sampling=limits))
        return out

    async def tokenizer_files(self, model: str) -> dict[str, str]:
        host = await self.host(model, "model")
        if model not in self._tokenizer_files:
            self._tokenizer_files[model] = await asyncio.to_thread(_tokenizer_files, host)
        return self._tokenizer_files[model]

    def stop(self) -> None:
        for queue in self.queues.values():
            queue.stop()
        if self.cluster is not None:
            self.cluster.close()


def _tokenizer_files(host: ModelHost) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        host.tokenizer.save_pretrained(tmp)
        return {p.name: base64.b64encode(p.read_bytes()).decode("ascii") for p in Path(tmp).iterdir() if p.is_file()}

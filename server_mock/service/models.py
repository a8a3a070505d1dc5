"""The served base models: where each comes from, its host (loaded on first use) and its queue.

A model is loaded once, in a worker thread, and then lives for the worker's lifetime. Work for it runs on its
queue's thread (engine/queue.py); a short control operation waits for its result with ``run_on_model``.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import functools
import logging
import os
import tempfile
from pathlib import Path

import torch

from pytrio_compat.wire import ModelOperationCapabilities, SupportedModel
from server_mock.config import Limits, TrainOptions
from server_mock.engine.fairness import FairShare
from server_mock.engine.host import ModelHost
from server_mock.engine.local_host import LocalModelHost
from server_mock.engine.jobs import job_result
from server_mock.engine.queue import ModelQueue, QueueObserver
from server_mock.engine.requests import RequestStore
from server_mock.errors import WorkerError
from server_mock.lora import Layer
from server_mock.service.quotas import ByteBudget, PoolCharge

logger = logging.getLogger("server_mock")


class Models:
    def __init__(self, sources: dict[str, str], device: str, dtype: torch.dtype, requests: RequestStore,
                 limits: Limits, train_options: TrainOptions, lazy: bool = False, cluster=None,
                 tokenizer_ids: dict[str, str] | None = None, lazy_allow: list[str] | None = None,
                 observer: QueueObserver | None = None, adapter_memory: ByteBudget | None = None) -> None:
        self.sources = dict(sources)
        # the worker's adapter bytes (--max-adapter-bytes-total): each local host's adapter pool is charged to it
        self.adapter_memory = adapter_memory
        self.observer = observer  # told what every model queue runs (service/usage.py)
        # tenant id -> its weight=W from the keys file (engine/fairness.py; missing: 1), read by every queue
        self.weights: dict[str, float] = {}
        self.tokenizer_ids = dict(tokenizer_ids or {})  # operator-set, per served model name
        self.device = device
        self.dtype = dtype
        self.requests = requests
        self.limits = limits
        self.train_options = train_options
        self.lazy = lazy  # also load a model a client names (the embedded worker)
        self.lazy_allow = list(lazy_allow or [])  # ... if it matches one of these patterns (empty: any)
        self.cluster = cluster  # a server_mock.cluster.Cluster: models live on Ray actors (None: in this process)
        self.hosts: dict[str, ModelHost] = {}
        self.queues: dict[str, ModelQueue] = {}
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._tokenizer_files: dict[str, dict[str, str]] = {}
        self._layouts: dict[str, dict[str, Layer]] = {}

    def _source_for(self, name: str, field_name: str) -> str:
        if name in self.sources:
            return self.sources[name]
        if self.lazy and name and self.lazy_allowed(name):
            return name
        raise self._not_served(name, field_name)

    def lazy_allowed(self, name: str) -> bool:
        """Whether ``--lazy-models`` may load ``name``: every pattern list allows it (none given: any name), and a
        name that is a local path is judged by its real path too (so ``allowed/../elsewhere`` is not allowed)."""
        if not self.lazy_allow:
            return True
        forms = [name]
        if os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name):
            forms.append(os.path.realpath(os.path.expanduser(name)))
        return all(any(fnmatch.fnmatchcase(form, pattern) for pattern in self.lazy_allow) for form in forms)

    def _not_served(self, name: str, field_name: str) -> WorkerError:
        """The one answer for a model a client cannot have: not served, not allowed, missing, or not loadable alike
        (so a lazily loading worker does not tell which folders exist)."""
        served = ", ".join(sorted(self.sources)) or "none"
        shown = repr(name[:100]) + ("..." if len(name) > 100 else "")
        return WorkerError(404, "model_not_found", f"{field_name}: model {shown} is not served here "
                                                   f"(served: {served}); start the worker with --model NAME=PATH",
                           field_name)

    def is_served(self, name: str) -> bool:
        return name in self.sources or name in self.hosts

    async def host(self, name: str, field_name: str = "base_model") -> ModelHost:
        """The model's host, loaded on first use."""
        if name in self.hosts:
            return self.hosts[name]
        source = self._source_for(name, field_name)
        lock = self._load_locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self.hosts:
                logger.info("loading model %s from %s", name, source)
                try:
                    make_host = LocalModelHost
                    if self.cluster is not None:  # the replicas' adapter pools are charged from the front end
                        make_host = functools.partial(self.cluster.model_host, adapter_budget=self._pool_charge(name))
                    host = await asyncio.to_thread(make_host, name, source, self.device, self.dtype,
                                                   self.limits.max_seq_len, self.train_options)
                except Exception as exc:  # noqa: BLE001 - report why the model could not load
                    if name not in self.sources:  # a client's name (--lazy-models): the reason stays in the log
                        logger.warning("lazily loading %r failed: %s", name[:200], exc)
                        raise self._not_served(name, field_name) from None
                    if isinstance(exc, WorkerError):  # e.g. model_not_supported: already says what is missing
                        raise
                    raise WorkerError(500, "model_load_failed",
                                      f"{field_name}: could not load model {name!r}: {exc}", field_name) from exc
                self.queues[name] = ModelQueue(name, asyncio.get_running_loop(),
                                               slice_seconds=self.limits.decode_slice_seconds, observer=self.observer,
                                               policy=FairShare(weights=self.weights))
                if self.cluster is not None:  # samples go to the replicas from their own queue, beside training
                    self.queues[f"{name}:sampling"] = host.sampling_queue(asyncio.get_running_loop())
                    self.queues[f"{name}:sampling"].observer = self.queues[name].observer
                    self.queues[f"{name}:sampling"].policy = FairShare(weights=self.weights)
                self._charge_pool(name, host)
                self.hosts[name] = host
        return self.hosts[name]

    def _pool_charge(self, name: str) -> PoolCharge | None:
        return None if self.adapter_memory is None else PoolCharge(self.adapter_memory, name)

    def _charge_pool(self, name: str, host: ModelHost) -> None:
        """Count the host's resident sampler adapters in the worker's adapter budget (the training runs' too): a
        local host's adapter pool, or (charged since the host was made) its sampler replicas' pools."""
        if self.adapter_memory is None:
            return
        reclaim = getattr(host, "reclaim_adapters", None)
        pool = getattr(host, "adapter_pool", None)
        if reclaim is None and pool is not None:
            pool.budget = self._pool_charge(name)
            reclaim = pool.reclaim
        if reclaim is not None:
            self.adapter_memory.reclaimers.append(reclaim)

    async def lora_layout(self, name: str, owner: str = "") -> dict[str, Layer]:
        """The model's LoRA-able layers (read once, on the model's thread: PEFT may be wrapping them)."""
        if name not in self._layouts:
            host = await self.host(name)
            layout = await self.run_on_model(name, "adapter_layout", lambda: {"layout": host.lora_layout()}, owner)
            self._layouts[name] = layout["layout"]
        return self._layouts[name]

    def tokenizer_id(self, name: str) -> str:
        """What a client loads this model's tokenizer from (``AutoTokenizer.from_pretrained``): the operator's
        ``--tokenizer-id``, else where the model was served from (its hub id, or the folder it was loaded from)."""
        if name in self.tokenizer_ids:
            return self.tokenizer_ids[name]
        host = self.hosts.get(name)
        source = host.source_dir if host is not None else self.sources.get(name, name)
        return os.path.abspath(source) if os.path.isdir(source) else source

    def loaded(self, name: str) -> ModelHost:
        """The host of a model already in use (a run's or a sampler's)."""
        return self.hosts[name]

    def queue(self, name: str) -> ModelQueue:
        return self.queues[name]

    def sampling_queue(self, name: str) -> ModelQueue:
        """Where sample requests for the model go: a Ray-backed model has its own, drained per replica."""
        return self.queues.get(f"{name}:sampling") or self.queues[name]

    async def run_on_model(self, model: str, kind: str, fn, owner: str = "") -> dict:
        """Queue work on a model's thread, in ``owner``'s lane, and wait for it (short control operations)."""
        job = self.requests.new_job(kind, fn, owner)
        self.queues[model].put(job)
        return await job_result(job)

    def queue_position(self, request_id: str) -> int | None:
        """How many requests run before this queued one (None once it runs, or if unknown)."""
        for queue in self.queues.values():
            position = queue.position(request_id)
            if position is not None:
                return position
        return None

    def capabilities(self) -> list[SupportedModel]:
        names = sorted(set(self.sources) | set(self.hosts))
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

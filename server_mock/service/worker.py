"""``WorkerService``: the worker's rules, for every front end. No HTTP here.

It is composed of one object per resource, each with its dependencies given to its constructor:
``models`` (service/models.py: the served models, their hosts and queues), ``checkpoints``
(service/checkpoints.py), ``runs`` (service/runs.py: training runs and their ops), ``samplers``
(service/samplers.py) and ``stability`` (service/stability.py: what samplers record for stable_reinforce),
sharing the ``requests`` store (engine/requests.py) and the ``limits``. Front ends
call their public methods. Requests are validated completely before they are queued, so a rejected request
never touches an adapter.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from server_mock.config import Limits, StorageOptions, TrainOptions
from server_mock.engine.requests import RequestStore
from server_mock.service.checkpoints import Checkpoints
from server_mock.service.journal import Journal
from server_mock.service.models import Models
from server_mock.service.quotas import ByteBudget, TenantLRU
from server_mock.service.rate_limits import TokenBudgets
from server_mock.service.runs import Runs
from server_mock.service.samplers import Samplers
from server_mock.service.stability import StabilityRecords
from server_mock.service.usage import Usage
from server_mock.storage.archive import Archives
from server_mock.storage.checkpoints import CheckpointStore
from server_mock.training import faults


class WorkerService:
    def __init__(self, models: dict[str, str], storage: str | Path, device: str, dtype: torch.dtype,
                 lazy_models: bool = False, limits: Limits | None = None, result_ttl: float = 3600.0,
                 allow_adapter_dirs: list[str] | None = None, fault_injection: bool | None = None,
                 train_options: TrainOptions | None = None, cluster=None,
                 tokenizer_ids: dict[str, str] | None = None, lazy_allow: list[str] | None = None,
                 storage_options: StorageOptions | None = None) -> None:
        self.limits = limits or Limits()
        self.storage_options = storage_options or StorageOptions()
        # --durability full: what is acknowledged is recorded first, and recovered at start (service/recovery.py)
        self.journal = Journal(storage, result_ttl) if self.storage_options.durability == "full" else None
        self.fault_injection = faults.enabled_by_environment() if fault_injection is None else fault_injection
        self.lazy_models = lazy_models
        self.requests = RequestStore(result_ttl, self.limits.max_result_bytes)
        # --tokens-per-minute (and per key, from the keys file); what every model queue ran, counted once
        self.budgets = TokenBudgets(self.limits.tokens_per_minute)
        self.usage = Usage(self.budgets)
        self.store = CheckpointStore(storage)
        self.store.build_index()  # which runs are whose: listings then read only the caller's folders
        total = self.limits.max_adapter_bytes_total or device_memory(device) // 2
        self.adapter_memory = ByteBudget(self.limits.max_adapter_bytes or total // 4, total, "lora",
                                         "max_adapter_bytes", "max_adapter_bytes_total")
        self.models = Models(models, device, dtype, self.requests, self.limits, train_options or TrainOptions(),
                             lazy=lazy_models, cluster=cluster, tokenizer_ids=tokenizer_ids, lazy_allow=lazy_allow,
                             observer=self.usage, adapter_memory=self.adapter_memory)
        self.checkpoints = Checkpoints(self.store, TenantLRU(self.limits.max_snapshots), self.journal,
                                       self.storage_options.max_storage_bytes_per_tenant,
                                       Archives(self.store, self.limits.max_archive_builds))
        self.runs = Runs(self.models, self.requests, self.checkpoints, self.limits, self.fault_injection,
                         self.adapter_memory, self.journal, budgets=self.budgets)
        self.stability = StabilityRecords(self.limits)  # per-sequence sampling records (stable_reinforce)
        self.samplers = Samplers(self.models, self.requests, self.checkpoints, self.limits, allow_adapter_dirs,
                                 dropped=self.stability.drop_sampler, journal=self.journal, budgets=self.budgets)
        # front ends' coroutines that rebuild their own state at start, after the service's (service/recovery.py)
        self.recovery_hooks: list[Callable[[], Awaitable[dict[str, int]]]] = []
        self.usage.metrics.watch(self)  # queue depth, adapters and memory, read when /metrics is scraped
        self.started = time.time()

    def stop(self) -> None:
        self.models.stop()
        if self.journal is not None:
            self.journal.close()


def device_memory(device: str) -> int:
    """The memory of the device the adapters live on: the GPU's, or the machine's RAM."""
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index
        return int(torch.cuda.get_device_properties(index if index is not None else 0).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 << 30

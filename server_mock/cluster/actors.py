"""The code that runs inside the cluster's actor processes: trainer ranks and sampler replicas.

Each actor holds its own copy of the base model in a ``LocalModelHost``. A ``WorkerError`` (a request's
fault, e.g. a non-finite loss) comes back as a ``Refusal`` value rather than a Ray task error, so the
front end can answer it exactly as the in-process worker does.
"""

from __future__ import annotations

import collections
import functools
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from pytrio_compat.wire import AdamParams, LoraSpec
from server_mock.cluster import data_parallel
from server_mock.cluster.replica_adapters import Report
from server_mock.config import TrainOptions
from server_mock.engine.local_host import LocalModelHost
from server_mock.errors import WorkerError


@dataclass
class Refusal:
    status: int
    code: str
    message: str
    field: str | None

    def error(self) -> WorkerError:
        return WorkerError(self.status, self.code, self.message, self.field)


def _refusing(fn):
    @functools.wraps(fn)  # Ray reads the method's signature through __wrapped__
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except WorkerError as exc:
            return Refusal(exc.status, exc.code, exc.message, exc.field)
    return wrapper


def _host(name: str, source: str, device: str, dtype: str, max_seq_len: int | None, options: TrainOptions,
          threads: int) -> LocalModelHost:
    torch.set_num_threads(max(1, threads))
    # the same known, harmless library notices the CLI silences in the front end
    warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    return LocalModelHost(name, source, device, getattr(torch, dtype), max_seq_len, options)


class TrainerRank:
    """One data-parallel rank of a trainer group: every run of the group has its adapter and Adam state here."""

    def __init__(self, name: str, source: str, device: str, dtype: str, max_seq_len: int | None,
                 options: TrainOptions, threads: int) -> None:
        self.device = device
        self.host = _host(name, source, device, dtype, max_seq_len, options, threads)
        self.world = 1
        self._grads_before: dict[str, dict] = {}  # run -> its gradients before the last forward_backward

    def ping(self) -> int:
        return os.getpid()

    def rendezvous(self) -> str:
        return data_parallel.free_address()

    def join(self, init_method: str, rank: int, world: int) -> None:
        data_parallel.join_group(init_method, rank, world, self.device)
        self.world = world

    def runs(self) -> list[str]:
        return sorted(self.host.adapters)

    def create(self, run_id: str, spec: dict) -> int:
        return self.host.create_adapter(run_id, LoraSpec.model_validate(spec)).seed

    def delete(self, run_id: str) -> None:
        self._grads_before.pop(run_id, None)
        self.host.drop_adapter(run_id)

    def _adapter(self, run_id: str):
        adapter = self.host.adapters.get(run_id)
        if adapter is None:
            raise WorkerError(404, "training_run_not_found", f"unknown training run: {run_id}")
        return adapter

    @_refusing
    def forward_backward(self, run_id: str, data: list, loss_fn: str, config: dict, backward: bool,
                         loss_scale: float = 1.0):
        adapter = self._adapter(run_id)
        if backward:
            self._grads_before[run_id] = {n: None if p.grad is None else p.grad.clone()
                                          for n, p in adapter.params.items()}
        data = [{k: np.array(v) for k, v in d.items()} for d in data]  # writable copies of the object-store views
        if not data:
            return {"outputs": [], "metrics": {"loss_sum": 0.0, "loss_mean": 0.0, "token_count": 0.0,
                                               "loss:sum": 0.0}}
        return self.host.forward_backward(adapter, data, loss_fn, config, backward, loss_scale)

    def undo_backward(self, run_id: str) -> None:
        """Put back the gradients from before the last forward_backward (another rank refused its shard)."""
        saved = self._grads_before.pop(run_id, None)
        adapter = self.host.adapters.get(run_id)
        if saved is None or adapter is None:
            return
        for name, param in adapter.params.items():
            param.grad = saved[name]

    @_refusing
    def optim_step(self, run_id: str, adam: dict) -> dict:
        adapter = self._adapter(run_id)
        self._grads_before.pop(run_id, None)
        if self.world > 1:
            data_parallel.sum_gradients(adapter.params)
        return self.host.optim_step(adapter, AdamParams.model_validate(adam))

    def adapter_weights(self, run_id: str) -> dict:
        return {k: v.cpu() for k, v in self.host.adapter_weights(self._adapter(run_id)).items()}

    def optimizer_state(self, run_id: str) -> dict:
        return {k: v.cpu() for k, v in self.host.optimizer_state(self._adapter(run_id)).items()}

    @_refusing
    def load_adapter_weights(self, run_id: str, tensors: dict) -> None:
        self.host.load_adapter_weights(self._adapter(run_id), tensors)

    @_refusing
    def load_optimizer_state(self, run_id: str, state: dict | None) -> int:
        adapter = self._adapter(run_id)
        self.host.load_optimizer_state(adapter, state)
        return adapter.optim_steps

    def snapshot(self, run_id: str):
        snap = self.host.snapshot(self._adapter(run_id))
        snap.tensors = {k: v.cpu() for k, v in snap.tensors.items()}
        return snap


class SamplerReplica:
    """A copy of the base model that samples. A call carries one or more groups of requests, each for one set of
    weights (``sample_groups``); groups of several adapters decode as one mixed batch, on the host's adapter pool
    and mixed decoder (``LocalModelHost.sample_mixed``). Snapshots are fetched from the object store on first use
    and kept, the least recently used dropped beyond ``keep`` (never one of the running call); what the host derived
    from a dropped one (its adapter pool entry, its merged copy) goes with it, so a replica holds the weights of at
    most ``keep`` snapshots, or of the snapshots of its call where that is more (``--adapter-pool-bytes`` and
    ``--merge-lora-bytes`` may hold fewer of them ready)."""

    def __init__(self, index: int, name: str, source: str, device: str, dtype: str, max_seq_len: int | None,
                 options: TrainOptions, threads: int, keep: int) -> None:
        self.index = index
        self.keep = max(1, keep)
        self.host = _host(name, source, device, dtype, max_seq_len, options, threads)
        self.snapshots: collections.OrderedDict[str, object] = collections.OrderedDict()
        self.fetched = 0
        self.batches = 0
        self.calls = 0  # sample and drop calls run, numbering their reports (cluster/replica_adapters.py)
        self.weights_per_batch: collections.Counter[int] = collections.Counter()  # calls by sets of weights

    def ping(self) -> int:
        return os.getpid()

    def can_mix(self) -> bool:
        """Whether a call's groups of different adapters decode as one batch (else one after another)."""
        return bool(self.host.can_mix)

    def stats(self) -> dict:
        pool = self.host.adapter_pool
        return {"index": self.index, "pid": os.getpid(), "fetched": self.fetched, "batches": self.batches,
                "weights_per_batch": dict(self.weights_per_batch), "snapshots": list(self.snapshots),
                "pool": None if pool is None else {"entries": pool.keys(), "resident": pool.resident(),
                                                   "loads": pool.stats.loads,
                                                   "hits": pool.stats.hits, "evictions": pool.stats.evictions}}

    def _snapshot(self, snapshot_id: str | None, holder: list | None):
        if snapshot_id is None:
            return None
        snap = self.snapshots.get(snapshot_id)
        if snap is None:
            import ray

            snap = ray.get(holder[0])  # published once by the front end (ray.put); fetched here once
            self.fetched += 1
            self.snapshots[snapshot_id] = snap
        else:
            self.snapshots.move_to_end(snapshot_id)
        return snap

    def _report(self) -> Report:
        """What the adapter pool holds after this call (the front end charges it to the worker's budget)."""
        self.calls += 1
        pool = self.host.adapter_pool
        return Report(os.getpid(), self.calls, {} if pool is None else pool.resident())

    def drop(self, snapshot_ids: list[str]):
        """Drop these snapshots and what the host derived from them (the front end evicts them to make room)."""
        for snapshot_id in snapshot_ids:
            self.snapshots.pop(snapshot_id, None)
            self.host.forget_snapshot(snapshot_id)
        return self._report()

    def _trim(self, running: set) -> None:
        """Drop the least recently used snapshots beyond ``keep``, but not those of the running call."""
        for snapshot_id in list(self.snapshots):
            if len(self.snapshots) <= self.keep:
                return
            if snapshot_id not in running:
                del self.snapshots[snapshot_id]
                self.host.forget_snapshot(snapshot_id)

    def sample_groups(self, groups: list[tuple[str | None, list | None, list]]) -> tuple[list[list], dict, int, Report]:
        """Sample ``(snapshot id, holder, specs)`` groups as one batch: each group's results in order, the batch's
        timings, this replica's index and what its adapter pool holds after it (``Report``)."""
        snapshots = [self._snapshot(snapshot_id, holder) for snapshot_id, holder, _ in groups]
        self._trim({snapshot_id for snapshot_id, _, _ in groups})
        requests = [(snap, spec) for snap, (_, _, specs) in zip(snapshots, groups) for spec in specs]
        timings: dict[str, float] = {}
        flat = self.host.sample_mixed(requests, timings)
        self.batches += 1
        self.weights_per_batch[len(groups)] += 1
        out, start = [], 0
        for _, _, specs in groups:
            out.append(flat[start:start + len(specs)])
            start += len(specs)
        return out, timings, self.index, self._report()

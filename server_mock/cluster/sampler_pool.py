"""Sampler replicas and how a batch is sent to them: the least loaded live replica, retried elsewhere if it dies.

A batch of several requests (coalesced by the front-end queue: the same weights, or, where the replicas can mix
adapters, any adapters of one mix key) is split by tokens over the replicas that are idle, so that one burst of
requests uses every free replica; each replica decodes its part as one batch, its adapters mixed.

Replicas are restarted by Ray when they die (their ``__init__`` loads the model again). A batch whose
replica died is not retried by Ray (``max_task_retries=0``); the pool sends it again to another replica.
A failed call returns nothing, so each result comes from exactly one complete run of the batch.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from server_mock.cluster.actors import SamplerReplica
from server_mock.cluster.config import NAMESPACE
from server_mock.cluster.data_parallel import split_by_tokens
from server_mock.cluster.replica_adapters import ReplicaAdapters, ReplicaBudget
from server_mock.errors import WorkerError

logger = logging.getLogger("server_mock")

RETRY_FOR = 600.0  # seconds a batch keeps looking for a live replica (one restarting reloads the model)


class SamplerPool:
    """The replicas of one model. ``adapter_budget``: where the replicas' adapter pool entries are charged beside the
    worker's other adapter memory (``--max-adapter-bytes-total``; service/quotas.py's ``PoolCharge``, the books in
    cluster/replica_adapters.py; None: they are not)."""

    def __init__(self, prefix: str, config, host_args: tuple, start_timeout: float = 900.0,
                 adapter_budget: ReplicaBudget | None = None) -> None:
        import ray

        actor = ray.remote(SamplerReplica)
        self.replicas = [actor.options(name=f"{prefix}/sampler-{i}", namespace=NAMESPACE,
                                       num_cpus=config.cpus_per_replica, num_gpus=config.gpus_per_replica,
                                       max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD")
                         .remote(i, *host_args, config.snapshots_per_replica)
                         for i in range(config.sampler_replicas)]
        self.load = [0] * len(self.replicas)  # tokens in flight on each replica
        self.failed_at = [0.0] * len(self.replicas)
        self.retries = 0
        self._next = 0
        self._executor = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="sampler-pool")
        self._lock = threading.Lock()
        try:
            ray.get([r.ping.remote() for r in self.replicas], timeout=start_timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(503, "cluster_full", f"sampler replicas did not start within {start_timeout:g}s "
                                                   "(the cluster may not have room for them)") from None
        # every replica holds the same model and options: whether one call's adapters decode as one batch
        self.can_mix = all(ray.get([r.can_mix.remote() for r in self.replicas], timeout=start_timeout))
        # a call of one set of weights decodes on its merged copy, not on the pool, unless --batch-invariant
        # (LocalModelHost.sample_mixed)
        self.pool_alone = bool(host_args[5].batch_invariant)
        self.adapters = ReplicaAdapters(adapter_budget, self._drop)

    def _pick(self, cost: int) -> int:
        now = time.monotonic()
        with self._lock:
            # a replica that failed in the last few seconds is likely restarting: others first
            n = len(self.replicas)
            index = min(range(n), key=lambda i: (now - self.failed_at[i] < 5.0, self.load[i], (i - self._next) % n))
            self._next = index + 1  # equal loads: take turns
            self.load[index] += cost
            return index

    def _drop(self, index: int, snapshot_ids: list[str]) -> None:
        """Ask a replica to drop snapshots (evicted by the books); not waited for: it runs after the calls sent to it
        before, and a replica that is gone holds nothing."""
        self.replicas[index].drop.remote(snapshot_ids).future().add_done_callback(lambda done: done.exception())

    def sample_groups(self, groups: list[tuple[str | None, list | None, list]], costs: list[list[int]],
                      sizes: dict[str, int] | None = None) -> tuple[list[list], dict, int]:
        """Sample a coalesced batch of ``(snapshot id, holder, specs)`` groups (``costs``: each spec's tokens;
        ``sizes``: each snapshot's adapter pool entry bytes, charged where a replica decodes it mixed): each
        group's results in order, the timings and the index of a replica that ran it. The batch is split over the
        idle replicas (sampling is seeded per row, so where a request runs does not change its result): whole groups
        where no group outweighs a replica's share (each replica then fetches and loads fewer adapters), else request
        by request. Each part goes to its replica as one call, its adapters decoding together."""
        now = time.monotonic()
        with self._lock:
            idle = sum(1 for i in range(len(self.replicas)) if self.load[i] == 0 and now - self.failed_at[i] >= 5.0)
        pairs = [(g, j) for g, (_, _, specs) in enumerate(groups) for j in range(len(specs))]
        parts = max(1, min(len(pairs), idle))
        group_costs = [sum(c) for c in costs]
        if max(group_costs) * parts <= sum(group_costs):
            by_group = split_by_tokens(group_costs, parts)
            shards = [[(g, j) for g in shard for j in range(len(groups[g][2]))] for shard in by_group if shard]
        else:
            shards = [[pairs[i] for i in shard]
                      for shard in split_by_tokens([costs[g][j] for g, j in pairs], parts) if shard]

        def run(shard: list[tuple[int, int]]) -> tuple[list, dict, int]:
            members: dict[int, list[int]] = {}
            for g, j in shard:
                members.setdefault(g, []).append(j)
            part = [(groups[g][0], groups[g][1], [groups[g][2][j] for j in js]) for g, js in members.items()]
            results, timings, index = self._sample_on_one(part, sum(costs[g][j] for g, j in shard), sizes or {})
            return [((g, j), result) for (g, js), got in zip(members.items(), results)
                    for j, result in zip(js, got)], timings, index

        ran = [run(shards[0])] if len(shards) == 1 else list(self._executor.map(run, shards))
        results: list[list] = [[None] * len(specs) for _, _, specs in groups]
        timings: dict[str, float] = {}
        for placed, part_timings, _ in ran:
            for (g, j), result in placed:
                results[g][j] = result
            for key, value in part_timings.items():  # the replicas ran at the same time: the slowest counts
                timings[key] = max(timings.get(key, 0.0), value)
        return results, timings, ran[0][2]

    def _sample_on_one(self, groups: list, cost: int, sizes: dict[str, int]) -> tuple[list, dict, int]:
        """One call to one replica (the least loaded), its adapters charged there first (``ReplicaAdapters``)."""
        import ray

        deadline = time.monotonic() + RETRY_FOR
        mine = {sid: sizes[sid] for sid, _, _ in groups if sid is not None and sid in sizes}
        pooled = self.can_mix and (len(groups) > 1 or self.pool_alone)
        while True:
            index = self._pick(cost)
            report, lost = None, False
            try:
                self.adapters.reserve(index, mine, pooled)
            except WorkerError:
                with self._lock:
                    self.load[index] -= cost
                raise
            try:
                results, timings, where, report = ray.get(self.replicas[index].sample_groups.remote(groups))
                return results, timings, where
            except ray.exceptions.RayActorError as exc:
                lost = True
                with self._lock:
                    self.failed_at[index] = time.monotonic()
                    self.retries += 1
                logger.warning("sampler replica %d failed (%s); sending its batch to another replica", index,
                               type(exc).__name__)
                if time.monotonic() > deadline:
                    raise WorkerError(503, "sampler_unavailable",
                                      f"no sampler replica answered within {RETRY_FOR:g}s; retry later") from None
                time.sleep(0.2)
            finally:
                self.adapters.settle(index, mine, report, lost)
                with self._lock:
                    self.load[index] -= cost

    def kill(self) -> None:
        import ray

        self._executor.shutdown(wait=False)
        self.adapters.forget()
        for replica in self.replicas:
            try:
                ray.kill(replica, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

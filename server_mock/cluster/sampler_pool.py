"""Sampler replicas and how a batch is sent to them: the least loaded live replica, retried elsewhere if it dies.

A batch of several requests (coalesced by the front-end queue) is split by tokens over the replicas that
are idle, so that one burst of requests for the same weights uses every free replica.

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
from server_mock.errors import WorkerError

logger = logging.getLogger("server_mock")

RETRY_FOR = 600.0  # seconds a batch keeps looking for a live replica (one restarting reloads the model)


class SamplerPool:
    def __init__(self, prefix: str, config, host_args: tuple, start_timeout: float = 900.0) -> None:
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

    def _pick(self, cost: int) -> int:
        now = time.monotonic()
        with self._lock:
            # a replica that failed in the last few seconds is likely restarting: others first
            n = len(self.replicas)
            index = min(range(n), key=lambda i: (now - self.failed_at[i] < 5.0, self.load[i], (i - self._next) % n))
            self._next = index + 1  # equal loads: take turns
            self.load[index] += cost
            return index

    def sample(self, snapshot_id: str | None, holder: list | None, specs: list, costs: list[int]
               ) -> tuple[list, dict, int]:
        """Sample a coalesced batch; several requests are split over the idle replicas (sampling is seeded per
        row, so where a request runs does not change its result)."""
        now = time.monotonic()
        with self._lock:
            idle = sum(1 for i in range(len(self.replicas)) if self.load[i] == 0 and now - self.failed_at[i] >= 5.0)
        shards = [s for s in split_by_tokens(costs, max(1, min(len(specs), idle))) if s]
        if len(shards) == 1:
            return self._sample_on_one(snapshot_id, holder, specs, sum(costs))
        parts = list(self._executor.map(
            lambda shard: self._sample_on_one(snapshot_id, holder, [specs[i] for i in shard],
                                              sum(costs[i] for i in shard)), shards))
        results: list = [None] * len(specs)
        timings: dict[str, float] = {}
        for shard, (shard_results, shard_timings, _) in zip(shards, parts):
            for i, result in zip(shard, shard_results):
                results[i] = result
            for key, value in shard_timings.items():  # the replicas ran at the same time: the slowest counts
                timings[key] = max(timings.get(key, 0.0), value)
        return results, timings, parts[0][2]

    def _sample_on_one(self, snapshot_id: str | None, holder: list | None, specs: list, cost: int
                       ) -> tuple[list, dict, int]:
        import ray

        deadline = time.monotonic() + RETRY_FOR
        while True:
            index = self._pick(cost)
            try:
                return ray.get(self.replicas[index].sample.remote(snapshot_id, holder, specs))
            except ray.exceptions.RayActorError as exc:
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
                with self._lock:
                    self.load[index] -= cost

    def kill(self) -> None:
        import ray

        self._executor.shutdown(wait=False)
        for replica in self.replicas:
            try:
                ray.kill(replica, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

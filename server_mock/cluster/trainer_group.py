"""The front end's handle on one trainer group: M data-parallel ranks placed together, owning some runs.

Trainer actors are never restarted and their calls never retried by Ray: a call that fails because a
rank died is not run again, so no training op is applied twice. A group with a dead rank is killed
whole (its other ranks would wait forever in the gradient all-reduce) and its runs are lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from server_mock.cluster.actors import Refusal, TrainerRank
from server_mock.cluster.config import NAMESPACE
from server_mock.errors import WorkerError

logger = logging.getLogger("server_mock")

START_TIMEOUT = 900.0  # seconds for a group's ranks to be placed and load the model


class GroupLost(Exception):
    """A rank of the group died; the group and its runs' state are gone."""


@dataclass
class TrainerGroup:
    index: int
    ranks: list
    placement: object = None
    runs: set[str] = field(default_factory=set)
    dead: str | None = None  # why the group was lost

    @classmethod
    def start(cls, index: int, prefix: str, config, host_args: tuple) -> "TrainerGroup":
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": config.cpus_per_replica}
        if config.gpus_per_replica:
            bundle["GPU"] = config.gpus_per_replica
        placement = placement_group([dict(bundle) for _ in range(config.train_replicas)], strategy="PACK")
        try:
            ray.get(placement.ready(), timeout=START_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(placement)
            raise WorkerError(503, "cluster_full", f"trainer group {index}: the cluster could not place "
                              f"{config.train_replicas} x {bundle} within {START_TIMEOUT:g}s") from None
        actor = ray.remote(TrainerRank)
        ranks = [actor.options(name=f"{prefix}/trainer-g{index}-r{rank}", namespace=NAMESPACE,
                               num_cpus=config.cpus_per_replica, num_gpus=config.gpus_per_replica,
                               max_restarts=0, max_task_retries=0,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(placement, rank))
                 .remote(*host_args)
                 for rank in range(config.train_replicas)]
        group = cls(index, ranks, placement)
        try:
            group.gather([r.ping.remote() for r in ranks], timeout=START_TIMEOUT)
            if len(ranks) > 1:
                address = ray.get(ranks[0].rendezvous.remote())
                group.gather([r.join.remote(address, i, len(ranks)) for i, r in enumerate(ranks)])
        except GroupLost as exc:
            raise WorkerError(500, "trainer_start_failed", f"trainer group {index} could not start: {exc}") from None
        return group

    def gather(self, refs: list, timeout: float | None = None) -> list:
        """Every call's value, in order; the first dead rank kills the group and raises GroupLost."""
        import ray

        if self.dead:
            raise GroupLost(self.dead)
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
                if not ready:
                    raise ray.exceptions.GetTimeoutError(f"no answer within {timeout}s")
                ray.get(ready)
            return ray.get(list(refs))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self.kill(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            raise GroupLost(self.dead) from None

    def call_all(self, method: str, *args) -> list:
        """The same call on every rank (as one step, e.g. the AdamW step or loading weights)."""
        return self.gather([getattr(rank, method).remote(*args) for rank in self.ranks])

    def call_first(self, method: str, *args):
        return self.gather([getattr(self.ranks[0], method).remote(*args)])[0]

    def call_each(self, method: str, args: list[tuple]) -> list:
        return self.gather([getattr(rank, method).remote(*a) for rank, a in zip(self.ranks, args)])

    def kill(self, why: str, quiet: bool = False) -> None:
        import ray

        if self.dead:
            return
        self.dead = why or "a trainer process died"
        if not quiet:
                logger.error("trainer group %d lost (%s); its runs %s fail until resumed from a saved state",
                         self.index, self.dead, sorted(self.runs))
        for rank in self.ranks:
            try:
                ray.kill(rank)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.placement is not None:
            ray.util.remove_placement_group(self.placement)


def raise_refusals(values: list) -> None:
    for value in values:
        if isinstance(value, Refusal):
            raise value.error()

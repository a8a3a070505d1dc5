"""What the worker asks of the cluster: how many replicas of each kind, and what each one needs."""

from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "pytrio_compat"  # Ray namespace of the worker's named actors
MAX_REPLICAS = 256  # per kind: a bound on the actors one flag can start


@dataclass(frozen=True)
class ClusterConfig:
    address: str = "auto"  # "auto": join a running cluster or start a local one; else HOST:PORT of a head node
    sampler_replicas: int = 1
    train_replicas: int = 1  # data-parallel ranks of one trainer group (one run's batch is split across them)
    trainer_groups: int = 1  # runs are spread over the groups, the least loaded first
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    snapshots_per_replica: int = 8  # adapter snapshots a sampler replica keeps (least recently used dropped)
    connect_timeout: float = 10.0

    def problems(self) -> list[str]:
        """Each flag that is out of range, with its limit."""
        out = []
        for flag, value in (("--sampler-replicas", self.sampler_replicas), ("--train-replicas", self.train_replicas),
                            ("--trainer-groups", self.trainer_groups)):
            if not 1 <= value <= MAX_REPLICAS:
                out.append(f"{flag} must be in [1, {MAX_REPLICAS}], got {value}")
        if self.gpus_per_replica < 0:
            out.append(f"--gpus-per-replica must be >= 0, got {self.gpus_per_replica}")
        if self.cpus_per_replica <= 0:
            out.append(f"--cpus-per-replica must be > 0, got {self.cpus_per_replica}")
        if self.gpus_per_replica > 1 and self.gpus_per_replica != int(self.gpus_per_replica):
            out.append(f"--gpus-per-replica above 1 must be a whole number, got {self.gpus_per_replica}")
        return out

    @property
    def actors(self) -> int:
        return self.sampler_replicas + self.train_replicas * self.trainer_groups

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_replica > 0 else "cpu"

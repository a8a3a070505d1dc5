"""Helpers for the Ray tests: the worker's named actors on the test cluster."""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager
from pathlib import Path

from support import WorkerProcess, running_worker

NAMESPACE = "pytrio_compat"


def _e2e_numerics():
    """tests/e2e/test_training_numerics.py, whose reference checks the Ray tests run again."""
    path = Path(__file__).resolve().parents[1] / "e2e" / "test_training_numerics.py"
    spec = importlib.util.spec_from_file_location("e2e_training_numerics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


E2E = _e2e_numerics()


ADMIN_KEY = "ray-operator-key-0123"  # reads the Ray worker's /metrics (an operator key, no tenant)


def running_ray_worker(address: str, model_dir: Path, root: Path, trainer_groups: int
                       ) -> AbstractContextManager[WorkerProcess]:
    """A worker on the cluster at ``address``: 2 sampler replicas, ``trainer_groups`` groups of 2 ranks, operator
    key ``ADMIN_KEY``; stopped after the block. Each test module starts its own (a module-scoped ``ray_worker``
    fixture)."""
    admin_keys = root / "admin-keys.txt"
    admin_keys.write_text(ADMIN_KEY + "\n")
    return running_worker(model_dir, root, "--ray", address, "--sampler-replicas", "2", "--train-replicas", "2",
                          "--trainer-groups", str(trainer_groups), "--cpus-per-replica", "1",
                          "--admin-key-file", str(admin_keys))


def named_actors(kind: str) -> dict[str, object]:
    """This cluster's live worker actors of one kind (sampler / trainer), by name."""
    import ray

    return {name: ray.get_actor(name, namespace=NAMESPACE)
            for name in ray.util.list_named_actors() if name.split("/")[-1].startswith(kind)}


def trainer_runs() -> dict[str, set[str]]:
    """Runs held by each trainer group (by actor-name prefix), asked of the rank-0 actors."""
    import ray

    out: dict[str, set[str]] = {}
    for name, actor in named_actors("trainer").items():
        if name.endswith("-r0"):
            out[name[:-len("-r0")]] = set(ray.get(actor.runs.remote(), timeout=60))
    return out

"""Helpers for the Ray tests: the worker's named actors on the test cluster."""

from __future__ import annotations

NAMESPACE = "pytrio_compat"


def named_actors(kind: str) -> dict[str, object]:
    """This cluster's live worker actors of one kind (sampler / trainer), by name."""
    import ray

    return {name: ray.get_actor(name, namespace=NAMESPACE)
            for name in ray.util.list_named_actors() if name.split("/")[-1].startswith(kind)}

"""Joining (or starting) the Ray cluster, and checking that it can hold what the worker asks for."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from server_mock.cluster.config import NAMESPACE, ClusterConfig

logger = logging.getLogger("server_mock")

# settings the actors need to see as the front end does (offline hub, model cache)
_FORWARDED_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM",
                  "PYTRIO_COMPAT_CACHE", "PYTRIO_WORKER_FAULT_INJECTION")


class ClusterError(RuntimeError):
    """The cluster cannot be reached, or cannot hold the replicas asked for."""


def check_reachable(address: str, timeout: float) -> None:
    """A TCP connection to the head's GCS port, so that a wrong address fails in seconds, naming it."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ClusterError(f"--ray {address!r}: expected auto or HOST:PORT of the head node (the address "
                           "`ray start --head` prints, port 6379 by default)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ClusterError(f"cannot reach the Ray cluster at {address} within {timeout:g}s: {exc} (is `ray start "
                           "--head` running there, and is the port open from this machine?)") from None


def check_resources(config: ClusterConfig, available: dict, nodes: list[dict], models: int = 1) -> None:
    """Refuse, naming the resource, when the cluster cannot place every replica for ``models`` base models."""
    actors = config.actors * max(1, models)
    what = (f"{models} model(s) x ({config.sampler_replicas} sampler replica(s) + {config.trainer_groups} trainer "
            f"group(s) x {config.train_replicas} train replica(s))")
    for resource, each in (("CPU", config.cpus_per_replica), ("GPU", config.gpus_per_replica)):
        if each <= 0:
            continue
        flag = f"--{resource.lower()}s-per-replica"
        need, have = actors * each, float(available.get(resource, 0.0))
        if need > have + 1e-9:
            raise ClusterError(f"not enough {resource}s: {what} x {each:g} {resource} ({flag}) need {need:g} "
                               f"{resource}s; the cluster has {have:g} available. Lower the replica counts or "
                               f"{flag}, or add nodes (`ray start --address ...`)")
        biggest = max((float(n.get(resource, 0.0)) for n in nodes), default=0.0)
        if each > biggest + 1e-9:
            raise ClusterError(f"no node has {each:g} {resource}s for one replica ({flag}); the largest node "
                               f"offers {biggest:g}")


def connect(config: ClusterConfig, storage: str | Path, models: int = 1) -> "Cluster":
    """Join the cluster at ``config.address`` (``auto``: a running one, else start a local one) and check it."""
    problems = config.problems()
    if problems:
        raise ClusterError("; ".join(problems))
    try:
        import ray
    except ImportError as exc:
        raise ClusterError(f"Ray is not installed: pip install -e '.[worker,cluster]' ({exc})") from None

    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        logger.warning("Ray token authentication is off (RAY_AUTH_MODE=disabled): anyone who can reach the cluster's "
                       "ports can run code on it. Unset it and share ~/.ray/auth_token between the nodes instead")
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    options = {"namespace": NAMESPACE, "runtime_env": {"env_vars": env} if env else None,
               "include_dashboard": False, "logging_level": logging.WARNING}
    if config.address == "auto":
        try:
            ray.init(address="auto", **options)
            logger.info("joined the running Ray cluster")
        except ConnectionError:
            ray.init(**options)
            logger.info("started a local Ray cluster")
    else:
        check_reachable(config.address, config.connect_timeout)
        ray.init(address=config.address, **options)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    try:
        check_resources(config, ray.available_resources(), nodes, models)
    except ClusterError:
        ray.shutdown()
        raise
    return Cluster(config, Path(storage))


class Cluster:
    """The joined cluster: makes the Ray-backed host for each base model the worker loads."""

    def __init__(self, config: ClusterConfig, storage: Path) -> None:
        self.config = config
        self.storage = storage
        self.hosts = []

    def model_host(self, name: str, source: str, device: str, dtype, max_seq_len, options, adapter_budget=None):
        from server_mock.cluster.remote_host import RemoteModelHost

        host = RemoteModelHost(self, name, source, dtype, max_seq_len, options, adapter_budget=adapter_budget)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        import ray

        for host in self.hosts:
            host.close()
        ray.shutdown()

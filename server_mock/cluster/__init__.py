"""Running the worker's models on a Ray cluster: sampler replicas and data-parallel LoRA trainers.

The HTTP front end stays one process. For each base model it holds a ``RemoteModelHost`` (remote_host.py)
in place of the in-process ``LocalModelHost``; that proxy forwards sampling to sampler replica actors
(sampler_pool.py) and each run's training to the trainer group that owns it (trainer_group.py). ``connect``
(placement.py) joins or starts the cluster and checks that it can hold the replicas asked for.

Nothing here is imported unless the worker is started with ``--ray``.
"""

from server_mock.cluster.config import ClusterConfig
from server_mock.cluster.placement import Cluster, ClusterError, connect

__all__ = ["Cluster", "ClusterConfig", "ClusterError", "connect"]

"""``RemoteModelHost``: the front end's stand-in for a ``ModelHost`` whose model lives on Ray actors.

It answers what the service reads locally (tokenizer, vocab size, context length, the LoRA layout,
from a copy of the model built on the ``meta`` device: no weights in the front end) and forwards the
work: sampling to the sampler replicas, each run's training to the trainer group that owns it. Runs are
placed on the group with the fewest runs and stay there.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import threading
import uuid
from dataclasses import dataclass, field

import torch

from server_mock.cluster import data_parallel
from server_mock.cluster.replica_adapters import ReplicaBudget
from server_mock.cluster.sampler_pool import SamplerPool
from server_mock.cluster.trainer_group import GroupLost, TrainerGroup, raise_refusals
from server_mock.config import TrainOptions
from server_mock.engine.adapter_pool import entry_nbytes
from server_mock.engine.host import ModelFacts
from server_mock.engine.queue import ModelQueue
from server_mock.errors import WorkerError
from server_mock.engine.vision import is_image_text
from server_mock.lora import Snapshot, linear_groups
from server_mock.storage.checkpoints import CheckpointStore

logger = logging.getLogger("server_mock")

PUBLISHED_SNAPSHOTS = 64  # snapshots kept in the object store by the front end (least recently used dropped)


@dataclass
class RemoteAdapter:
    """What the service keeps of a run's adapter; the weights and Adam state live on its trainer group."""

    adapter_id: str
    spec: object
    seed: int
    group: TrainerGroup
    optim_steps: int = 0
    params: dict = field(default_factory=dict)  # none here (fault injection hooks have nothing to wrap)
    version: int = 0  # bumped whenever the weights change, as lora.Adapter's (the journal records it)


class ReplicaQueue(ModelQueue):
    """The model's sampling queue with one draining thread per replica, so that replicas sample in parallel.
    Requests of one batch key are still coalesced into one batch before a thread sends it (the same weights; where
    the replicas mix adapters, the service gives sample jobs their mix key as batch key: ``mixed_batches``)."""

    def __init__(self, name: str, loop, threads: int) -> None:
        super().__init__(name, loop)
        self._more = [threading.Thread(target=self._run, name=f"model-{name}-{i}", daemon=True)
                      for i in range(1, threads)]
        for thread in self._more:
            thread.start()


def _unstreamed(spec):
    return dataclasses.replace(spec, stream=None) if getattr(spec, "stream", None) is not None else spec


def _meta_model(source: str):
    """The model's modules without weights (on the meta device), its tokenizer and resolved source."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from server_mock.engine.loading import model_class, resolve_source

    source = resolve_source(source)
    config = AutoConfig.from_pretrained(source)
    auto_class = model_class(config)  # the class the actors load, so both sides see one module tree
    with torch.device("meta"):
        model = auto_class.from_config(config)
    try:
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass  # no generation_config.json: the defaults from the config stand
    return model, AutoTokenizer.from_pretrained(source), source


class RemoteModelHost(ModelFacts):
    """A ``ModelHost`` (engine/host.py) whose model lives on Ray actors (see the module docstring)."""

    def __init__(self, cluster, name: str, source: str, dtype: torch.dtype, max_seq_len: int | None,
                 options: TrainOptions, adapter_budget: ReplicaBudget | None = None) -> None:
        config = cluster.config
        self.cluster = cluster
        self.name = name
        self.options = options
        self.device = config.device
        self.dtype = dtype
        self.model, self.tokenizer, self.source_dir = _meta_model(source)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self._linear_groups = linear_groups(self.model, vision_tower=options.lora_vision_tower)
        ctx = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.max_seq_len = min(x for x in (max_seq_len, ctx) if x) if (max_seq_len or ctx) else None
        self.vision = None
        self.vision_refusal = ("image inputs are not taken when the model runs on Ray actors"
                               if is_image_text(self.model.config) else None)
        self.adapters: dict[str, RemoteAdapter] = {}
        self.store = CheckpointStore(cluster.storage)
        self.prefix = f"{name}-{uuid.uuid4().hex[:8]}"  # the actors' names: PREFIX/sampler-i, PREFIX/trainer-gG-rR
        self._host_args = (name, self.source_dir, config.device, str(dtype).removeprefix("torch."), max_seq_len,
                           options, max(1, int(config.cpus_per_replica)))
        self._published: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._lock = threading.Lock()
        logger.info("starting %d sampler replica(s) and %d trainer group(s) x %d rank(s) of %s on the cluster "
                    "(actors %s/...)", config.sampler_replicas, config.trainer_groups, config.train_replicas, name,
                    self.prefix)
        # the replicas' adapter pool entries count against --max-adapter-bytes-total (cluster/replica_adapters.py)
        self.pool = SamplerPool(self.prefix, config, self._host_args, adapter_budget=adapter_budget)
        self.groups = [TrainerGroup.start(i, self.prefix, config, self._host_args)
                       for i in range(config.trainer_groups)]

    def sampling_queue(self, loop) -> ReplicaQueue:
        return ReplicaQueue(f"{self.name}:sampling", loop, len(self.pool.replicas))

    # --- sampling -------------------------------------------------------------------------------------

    def _publish(self, snapshot: Snapshot):
        """The snapshot's object-store reference, put there once."""
        import ray

        with self._lock:
            ref = self._published.get(snapshot.snapshot_id)
            if ref is None:
                ref = self._published[snapshot.snapshot_id] = ray.put(snapshot)
                while len(self._published) > PUBLISHED_SNAPSHOTS:
                    self._published.popitem(last=False)
            else:
                self._published.move_to_end(snapshot.snapshot_id)
            return ref

    @property
    def mixed_batches(self) -> bool:
        """A batch may hold requests of several adapters of one mix key where the replicas can mix them: it goes to
        a replica as one call, its adapters decoding together (``sample_mixed``)."""
        return self.pool.can_mix

    def sample_batch(self, snapshot: Snapshot | None, specs: list, timings: dict) -> list:
        return self.sample_mixed([(snapshot, spec) for spec in specs], timings)

    def sample_mixed(self, requests: list[tuple[Snapshot | None, object]], timings: dict) -> list:
        """The requests grouped by weights (first appearance order), each snapshot published once; the groups go
        to the replicas together (``SamplerPool.sample_groups``), the results back in request order."""
        groups: dict[str | None, tuple[Snapshot | None, list[int]]] = {}
        for i, (snapshot, _) in enumerate(requests):
            groups.setdefault(None if snapshot is None else snapshot.snapshot_id, (snapshot, []))[1].append(i)
        wire, costs, sizes = [], [], {}
        for snapshot_id, (snapshot, indices) in groups.items():
            # a request's token stream stays in this process: the replica decodes without it (its tokens come at
            # the end)
            specs = [_unstreamed(requests[i][1]) for i in indices]
            holder = None if snapshot is None else [self._publish(snapshot)]  # in a list: the replica fetches it
            wire.append((snapshot_id, holder, specs))
            costs.append([s.num_samples * (len(s.prompt_tokens) + s.max_tokens) for s in specs])
            if snapshot is not None:
                sizes[snapshot_id] = entry_nbytes(snapshot, self.dtype)
        results, replica_timings, index = self.pool.sample_groups(wire, costs, sizes)
        timings.update(replica_timings)
        timings["replica"] = float(index)
        out: list = [None] * len(requests)
        for (_, indices), got in zip(groups.values(), results):
            for i, result in zip(indices, got):
                out[i] = result
        return out

    def reclaim_adapters(self, size: int) -> int:
        """Drop the replicas' least recently used adapter pool entries not in use until ``size`` bytes are freed;
        the bytes freed (the worker's adapter budget asks, when a training run needs them)."""
        return self.pool.adapters.reclaim(size)

    def sampling_session(self, snapshot: Snapshot | None, defer: bool = False) -> None:
        """None: a replica decodes each batch in one go (the replicas' own threads keep other tenants moving)."""
        return None

    # --- runs -----------------------------------------------------------------------------------------

    def _group_for_new_run(self) -> TrainerGroup:
        for i, group in enumerate(self.groups):
            if group.dead:
                logger.warning("replacing lost trainer group %d", i)
                self.groups[i] = TrainerGroup.start(i, f"{self.prefix}-{uuid.uuid4().hex[:4]}", self.cluster.config,
                                                    self._host_args)
        return min(self.groups, key=lambda g: (len(g.runs), g.index))

    def _lost(self, adapter: RemoteAdapter) -> WorkerError:
        states = [(self.store.folder(ref).joinpath("meta.json").stat().st_mtime, ref.path)
                  for ref, _, _ in self.store.list(adapter.adapter_id) if ref.kind == "state"]
        resume = (f"resume from its last saved state {max(states)[1]} (create a training client from that state)"
                  if states else "it has no saved state (save_state) to resume from; start a new run")
        return WorkerError(503, "training_run_lost",
                           f"training run {adapter.adapter_id} was lost: a process of its trainer group died "
                           f"({adapter.group.dead}); its unsaved progress is gone; {resume}")

    def _on_group(self, adapter: RemoteAdapter, call):
        try:
            return call(adapter.group)
        except GroupLost:
            raise self._lost(adapter) from None

    def create_adapter(self, adapter_id: str, spec) -> RemoteAdapter:
        group = self._group_for_new_run()
        seed = spec.seed if spec.seed is not None else secrets.randbits(31)
        try:
            group.call_all("create", adapter_id, spec.model_copy(update={"seed": seed}).model_dump())
        except GroupLost as exc:
            raise WorkerError(503, "trainer_lost", f"the trainer group for the new run died ({exc}); retry") from None
        adapter = RemoteAdapter(adapter_id, spec, seed, group)
        group.runs.add(adapter_id)
        self.adapters[adapter_id] = adapter
        return adapter

    def drop_adapter(self, adapter_id: str) -> None:
        adapter = self.adapters.pop(adapter_id, None)
        if adapter is None:
            return
        adapter.group.runs.discard(adapter_id)
        if not adapter.group.dead:
            try:
                adapter.group.call_all("delete", adapter_id)
            except GroupLost:
                pass

    def forward_backward(self, adapter: RemoteAdapter, data: list, loss_fn: str, config: dict,
                         backward: bool, loss_scale: float = 1.0) -> dict:
        def run(group: TrainerGroup) -> dict:
            shards = data_parallel.split_by_tokens([len(d["tokens"]) for d in data], len(group.ranks))
            args = [(adapter.adapter_id, data_parallel.shard_data(data, s), loss_fn, config, backward, loss_scale)
                    for s in shards]
            results = group.call_each("forward_backward", args)
            refused = [(i, r) for i, r in enumerate(results) if not isinstance(r, dict)]
            if refused:
                if backward:  # the ranks that accepted their shard take its gradient back
                    group.call_all("undo_backward", adapter.adapter_id)
                index, refusal = refused[0]
                raise data_parallel.global_error(refusal.error(), shards[index])
            return data_parallel.merge_results(shards, results, len(data))

        return self._on_group(adapter, run)

    def optim_step(self, adapter: RemoteAdapter, adam) -> dict:
        values = self._on_group(adapter, lambda g: g.call_all("optim_step", adapter.adapter_id, adam.model_dump()))
        raise_refusals(values)
        adapter.optim_steps = int(values[0]["step"])
        adapter.version += 1
        return values[0]

    def adapter_weights(self, adapter: RemoteAdapter) -> dict[str, torch.Tensor]:
        return self._on_group(adapter, lambda g: g.call_first("adapter_weights", adapter.adapter_id))

    def optimizer_state(self, adapter: RemoteAdapter) -> dict[str, torch.Tensor]:
        return self._on_group(adapter, lambda g: g.call_first("optimizer_state", adapter.adapter_id))

    def load_adapter_weights(self, adapter: RemoteAdapter, tensors: dict[str, torch.Tensor]) -> None:
        import ray

        ref = ray.put(tensors)  # once, read by every rank
        raise_refusals(self._on_group(adapter, lambda g: g.call_all("load_adapter_weights", adapter.adapter_id, ref)))
        adapter.version += 1

    def load_optimizer_state(self, adapter: RemoteAdapter, state: dict[str, torch.Tensor] | None) -> None:
        import ray

        ref = None if state is None else ray.put(state)
        values = self._on_group(adapter, lambda g: g.call_all("load_optimizer_state", adapter.adapter_id, ref))
        raise_refusals(values)
        adapter.optim_steps = int(values[0])

    def snapshot(self, adapter: RemoteAdapter) -> Snapshot:
        snap = self._on_group(adapter, lambda g: g.call_first("snapshot", adapter.adapter_id))
        self._publish(snap)  # save_weights_for_sampler publishes it once; replicas fetch it on first use
        return snap

    def close(self) -> None:
        self.pool.kill()
        for group in self.groups:
            group.kill("the worker stopped", quiet=True)

"""The sampler replicas' adapter pools charged to the worker's adapter budget (``--max-adapter-bytes-total``), on a
local Ray cluster: two real replicas (cluster/sampler_pool.py) and the books of cluster/replica_adapters.py, the
bytes checked against the snapshots' own tensors."""

from __future__ import annotations

import pytest
import torch

from server_mock.errors import WorkerError

ray = pytest.importorskip("ray", reason="the cluster extra (pip install -e .[cluster]) is not installed")
pytestmark = pytest.mark.timeout(600)


def _snapshots(model_dir, count: int) -> list:
    """``count`` rank-8 snapshots of different weights (rank 8 is its own bucket and float32 the pool's dtype here:
    an entry takes exactly the bytes of the snapshot's tensors)."""
    from pytrio_compat.wire import LoraSpec
    from server_mock.engine.local_host import LocalModelHost

    host = LocalModelHost("tiny", str(model_dir), "cpu", torch.float32)
    out = []
    for i in range(count):
        adapter = host.create_adapter(f"run-{i}", LoraSpec(rank=8, seed=i))
        with torch.no_grad():
            for name, p in adapter.params.items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
        out.append(host.snapshot(adapter))
    return out


def test_replica_pools_count_against_the_total_and_the_oldest_are_dropped_first(ray_address, tiny_model_dir):
    """Two replicas' pools share a total of three entries: a second replica's two adapters drop the first's least
    recently used; a batch of one adapter builds no entry and charges nothing; a batch that cannot fit even with
    every other entry dropped is refused naming the flag, with nothing dropped, charged or sent; a training run's
    bytes reclaim the oldest entries."""
    from server_mock.cluster import ClusterConfig
    from server_mock.cluster.sampler_pool import SamplerPool
    from server_mock.config import TrainOptions
    from server_mock.engine.adapter_pool import entry_nbytes
    from server_mock.sampling.generate import SampleSpec
    from server_mock.service.quotas import ByteBudget, PoolCharge

    snaps = _snapshots(tiny_model_dir, 7)
    size = sum(t.nbytes for t in snaps[0].tensors.values())  # the independent count: the adapter's own tensors
    assert all(sum(t.nbytes for t in s.tensors.values()) == size for s in snaps)
    assert entry_nbytes(snaps[0], torch.float32) == size
    budget = ByteBudget(1 << 40, 3 * size, "lora", "max_adapter_bytes", "max_adapter_bytes_total")
    pool = SamplerPool(
        "budget-test",
        ClusterConfig(sampler_replicas=2, cpus_per_replica=1, snapshots_per_replica=8),
        ("tiny", str(tiny_model_dir), "cpu", "float32", None, TrainOptions(), 1),
        adapter_budget=PoolCharge(budget, "tiny"),
    )
    try:
        assert pool.can_mix
        holders = {s.snapshot_id: [ray.put(s)] for s in snaps}
        spec = SampleSpec(
            prompt_tokens=[5, 6, 7, 8], num_samples=1, max_tokens=4, seed=1, temperature=0.0, stop_token_ids=[]
        )
        ids = [s.snapshot_id for s in snaps]

        def call(which: list[int]) -> int:
            groups = [(ids[i], holders[ids[i]], [spec]) for i in which]
            return pool._sample_on_one(groups, 1, {ids[i]: entry_nbytes(snaps[i], torch.float32) for i in which})[2]

        def stats() -> list[dict]:
            return [ray.get(r.stats.remote(), timeout=60) for r in pool.replicas]

        def resident() -> list[dict[str, int]]:
            return [s["pool"]["resident"] for s in stats()]

        first = call([0, 1])
        assert resident()[first] == {ids[0]: size, ids[1]: size}
        assert budget.held == budget.shared == 2 * size == sum(resident()[first].values())

        second = call([2, 3])  # the other replica (turns): one more entry than the total holds, so the oldest goes
        assert second != first
        held = resident()
        assert held[first] == {ids[1]: size} and held[second] == {ids[2]: size, ids[3]: size}
        assert ids[0] not in stats()[first]["snapshots"]
        assert budget.held == 3 * size == sum(sum(r.values()) for r in held) == pool.adapters.nbytes

        call([4])  # one set of weights: its merged copy, no pool entry
        assert resident() == held and budget.held == 3 * size

        before = stats()
        with pytest.raises(WorkerError) as refused:
            call([0, 4, 5, 6])  # four entries: more than the whole total, whatever is dropped
        err = refused.value
        assert err.status == 429 and err.code == "memory_budget_exceeded"
        assert "--max-adapter-bytes-total" in err.message and "raise --max-adapter-bytes-total" in err.message
        assert f"needs {4 * size} bytes" in err.message
        assert stats() == before and budget.held == 3 * size and pool.adapters.nbytes == 3 * size

        third = call([0, 4])  # two new entries: the two least recently used (1, then 2) are dropped
        held = resident()
        assert {ids[0], ids[4]} <= set(held[third])
        assert {sid for r in held for sid in r} == {ids[0], ids[3], ids[4]}
        assert budget.held == 3 * size == sum(sum(r.values()) for r in held)

        budget.reclaimers.append(pool.adapters.reclaim)
        budget.take("run-new", "tenant", 2 * size, "a new training run")  # the oldest two entries make room
        assert budget.held == 3 * size and budget.shared == size == pool.adapters.nbytes
        assert {sid for r in resident() for sid in r} == set(pool.adapters.charged(third)) | set(
            pool.adapters.charged(1 - third)
        )
    finally:
        pool.kill()

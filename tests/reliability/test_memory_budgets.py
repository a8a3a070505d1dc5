"""Memory by bytes, not counts: a run's adapter (weights, gradients, AdamW moments) is charged against per-key and
worker-wide budgets when the run is created; finished results and Tinker futures are kept within --result-ttl
and a per-key byte budget; one sample request holds the model for at most --max-sample-request-tokens."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from support import running_worker

from server_mock.api.tinker.futures import Futures
from server_mock.engine.requests import RequestStore, approx_bytes

from .reliability_helpers import KEY_A, KEY_B

BYTES_PER_PARAM = 16  # float32 weight, its gradient, AdamW's two moments


def rank_one_bytes(model_dir) -> int:
    """A rank-1 LoRA on every Linear layer of the tiny Qwen2, from its config: each layer of in x out gets
    1 x in + out x 1 parameters."""
    c = json.loads((model_dir / "config.json").read_text())
    hidden, inter, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"]
    head_dim = hidden // c["num_attention_heads"]
    attention = (hidden + hidden) + 2 * (hidden + kv * head_dim) + (hidden + hidden)  # q, k, v, o
    mlp = 2 * (hidden + inter) + (inter + hidden)  # gate, up, down
    return BYTES_PER_PARAM * (c["num_hidden_layers"] * (attention + mlp) + hidden + c["vocab_size"])  # + lm_head


def test_the_adapter_budget_counts_bytes_not_runs(tiny_model_dir, tmp_path):
    unit = rank_one_bytes(tiny_model_dir)
    assert unit == 16 * 2624  # 2 x (448 + 576) + 64 + 512 parameters per unit of rank
    extra = ("--max-adapter-bytes", str(64 * unit), "--max-adapter-bytes-total", str(100 * unit),
             "--max-training-runs", "1000", "--max-adapters", "1000")
    with running_worker(tiny_model_dir, tmp_path, *extra, api_keys=[KEY_A, KEY_B], in_process=True) as proc:
        def http(key):
            return httpx.Client(base_url=proc.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

        def create(client, rank: int) -> httpx.Response:
            return client.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": rank, "seed": 0}})

        with http(KEY_A) as a, http(KEY_B) as b:
            runs = [create(a, 1) for _ in range(64)]
            assert all(r.status_code == 200 for r in runs), [r.text for r in runs if r.status_code != 200][:1]
            over = create(a, 1)  # the 65th: its bytes, not its count, are over (the count limit is 1000)
            assert over.status_code == 429 and over.headers["Retry-After"], over.text
            message = over.json()["error"]["message"]
            assert f"max_adapter_bytes={64 * unit}" in message and f"needs {unit} bytes" in message, message
            assert f"hold {64 * unit}" in message, message
            # one rank-2 run costs what two rank-1 runs cost
            assert a.delete(f"/v1/training_runs/{runs[0].json()['training_run_id']}").status_code == 200
            assert create(a, 2).status_code == 429
            assert create(a, 1).status_code == 200
            # the other key has its own share, up to the worker's total: 100 - 64 = 36 units left
            assert create(b, 32).status_code == 200
            assert create(b, 4).status_code == 200
            last = create(b, 1)
            assert last.status_code == 429 and f"max_adapter_bytes_total={100 * unit}" in last.text, last.text


def test_a_sample_request_holds_at_most_its_token_budget(tiny_model_dir, tmp_path):
    with running_worker(tiny_model_dir, tmp_path, "--max-sample-request-tokens", "100", in_process=True) as proc:
        with httpx.Client(base_url=proc.base_url, timeout=30) as http:
            sampler = http.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]

            def sample(n: int, max_tokens: int) -> httpx.Response:
                return http.post(f"/v1/samplers/{sampler}/sample", json={
                    "prompt_tokens": [3, 4, 5, 6, 7], "num_samples": n, "sampling_params": {"max_tokens": max_tokens}})

            at_limit = sample(4, 20)  # 4 x (5 + 20) = 100
            assert at_limit.status_code == 200, at_limit.text
            over = sample(4, 21)  # 4 x (5 + 21) = 104
            assert over.status_code == 413, over.text
            assert "max_sample_request_tokens=100" in over.text and "104 tokens" in over.text, over.text
            # the same budget on the other protocols
            chat = http.post("/api/openai/v1/completions", json={"model": "tiny", "prompt": [3, 4, 5, 6, 7], "n": 4,
                                                                 "max_tokens": 21})
            assert chat.status_code == 413 and "max_sample_request_tokens" in chat.text, chat.text
            assert http.get(f"/v1/requests/{at_limit.json()['request_id']}",
                            params={"wait": 20}).json()["status"] == "succeeded"


def _finished_job(store: RequestStore, owner: str, size: int):
    job = store.new_job("sample", dict, owner)
    job.result = {"data": "x" * size}
    job.finished, job.status = time.monotonic(), "succeeded"
    job.on_finish(job)
    return job


def test_held_results_are_dropped_oldest_first_past_the_byte_budget():
    async def scenario():
        store = RequestStore(result_ttl=3600, max_result_bytes=10_000)
        size = approx_bytes({"data": "x" * 3000})
        a = [_finished_job(store, "A", 3000) for _ in range(3)]  # 3 x ~3.1 kB: within the budget
        b = _finished_job(store, "B", 3000)
        assert all(store.get(j.request_id, "A") is j for j in a) and store.held_bytes("A") == 3 * size
        fourth = _finished_job(store, "A", 3000)  # past 10 kB: A's oldest goes, B's stays
        assert store.get(a[0].request_id, "A") is None
        assert "max_result_bytes=10000" in store.why_gone(a[0].request_id, "A")
        assert store.why_gone(a[0].request_id, "B") == "expired or worker restarted"  # not B's to know
        assert store.get(a[1].request_id, "A") is a[1] and store.get(fourth.request_id, "A") is fourth
        assert store.get(b.request_id, "B") is b and store.held_bytes("A") == 3 * size
        huge = _finished_job(store, "A", 50_000)  # alone over the budget: kept (the newest always is), others go
        assert store.get(huge.request_id, "A") is huge and store.held_bytes("A") == approx_bytes(huge.result)
        assert store.get(fourth.request_id, "A") is None

    asyncio.run(scenario())


def test_finished_results_expire_by_their_finish_time_and_stay_within_the_budget():
    from server_mock.engine.requests import FinishedResults

    results = FinishedResults(ttl=10.0, max_bytes=100)
    assert results.add("A", "a1", 60, finished=1.0) == [] and results.add("B", "b1", 60, finished=2.0) == []
    assert results.add("A", "a2", 40, finished=3.0) == []  # exactly the budget: kept
    assert results.add("A", "a3", 1, finished=4.0) == ["a1"]  # one past it: the oldest goes
    assert results.held_bytes("A") == 41 and results.held_bytes("B") == 60
    assert results.dropped_for_bytes("a1", "A") and not results.dropped_for_bytes("a1", "B")
    assert results.expired(now=13.0) == [("B", "b1")]  # finished more than 10 s before: b1 only (a2 at exactly 10)
    results.remove("B", "b1")
    assert results.held_bytes("B") == 0 and results.expired(now=100.0) == [("A", "a2"), ("A", "a3")]


def test_tinker_futures_expire_and_are_dropped_past_the_byte_budget():
    async def scenario():
        futures = Futures(ttl=0.3, max_bytes=10_000)

        async def result(size: int):
            return b"x" * size

        first = futures.add("A", result(4000))
        second = futures.add("A", result(4000))
        other = futures.add("B", result(4000))
        await asyncio.sleep(0.01)
        assert futures.get(first, "A") is not None and futures.get(second, "A") is not None
        third = futures.add("A", result(4000))  # 12 kB of A's: the oldest finished goes
        await asyncio.sleep(0.01)
        assert futures.get(first, "A") is None and futures.get(third, "A") is not None
        assert "max_result_bytes=10000" in futures.why_gone(first, "A")  # the same reason as the service's store
        assert "expired" in futures.why_gone(first, "B")  # not B's to know
        assert futures.get(other, "B") is not None and futures.get(other, "A") is None
        pending = futures.add("A", asyncio.sleep(10))
        await asyncio.sleep(0.4)  # past the TTL: finished futures are gone, a pending one is not
        assert futures.get(second, "A") is None and futures.get(other, "B") is None
        assert futures.get(pending, "A") is not None
        futures.get(pending, "A").task.cancel()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_an_expired_tinker_future_answers_404(tiny_model_dir, tmp_path):
    with running_worker(tiny_model_dir, tmp_path, "--result-ttl", "1", api_keys=[KEY_A], in_process=True) as proc:
        with httpx.Client(base_url=proc.base_url + "/api/v1", headers={"X-API-Key": KEY_A}, timeout=30) as http:
            session = http.post("/create_session", json={"tags": []}).json()["session_id"]
            created = http.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                                       "base_model": "tiny", "lora_config": {"rank": 2}}).json()
            answer = http.post("/retrieve_future", json={"request_id": created["request_id"]})
            assert answer.status_code == 200 and answer.json().get("model_id") == created["model_id"], answer.text
            time.sleep(1.6)
            gone = http.post("/retrieve_future", json={"request_id": created["request_id"]})
            assert gone.status_code == 404 and gone.json()["code"] == "request_not_found", gone.text


# --- the adapter pools' resident sampler adapters, counted in the same worker-wide budget ---


def _random_snapshots(host, count: int, rank: int = 4) -> list:
    """``count`` snapshots of random rank-``rank`` LoRA tensors in PEFT's layout on the host's model."""
    import torch

    from pytrio_compat.wire import LoraSpec
    from server_mock.lora import Snapshot, model_layout

    spec = LoraSpec(rank=rank)
    targets = host.lora_targets(spec)
    layout = model_layout(host.model, host._linear_groups)
    snaps = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for name in targets:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, layout[name].in_features,
                                                                            generator=gen)
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(layout[name].out_features, rank,
                                                                            generator=gen) * 0.05
        snaps.append(Snapshot(f"snap-{rank}-{i}", spec, targets, tensors))
    return snaps


def _pool_setup(tiny_model_dir, count: int, total_in_entries: float):
    """``count`` random snapshots, the bytes of one pool entry, a budget whose total is ``total_in_entries``
    entries (and one key's share one entry), and a pool charged to it."""
    import torch

    from server_mock.config import TrainOptions
    from server_mock.engine.adapter_pool import AdapterPool, prepare
    from server_mock.engine.local_host import LocalModelHost
    from server_mock.service.quotas import ByteBudget, PoolCharge

    host = LocalModelHost("tiny", str(tiny_model_dir), "cpu", torch.float32, options=TrainOptions())
    snaps = _random_snapshots(host, count)
    size = prepare(snaps[0], torch.float32, "cpu").nbytes
    budget = ByteBudget(size, int(total_in_entries * size), "lora", "max_adapter_bytes", "max_adapter_bytes_total")
    pool = AdapterPool(1 << 40, torch.float32, "cpu", PoolCharge(budget, "tiny"))
    budget.reclaimers.append(pool.reclaim)
    return snaps, size, budget, pool


def test_resident_pool_entries_count_in_the_worker_budget_and_eviction_frees_them(tiny_model_dir):
    """A budget of exactly two entries holds two resident adapters (none evicted, both counted); a third evicts
    the least recently used, whose bytes are given back. A pool entry counts toward the worker's total only, not
    toward any API key's share."""
    from server_mock.errors import WorkerError

    snaps, size, budget, pool = _pool_setup(tiny_model_dir, 3, 2)
    pool.get(snaps[0])
    pool.get(snaps[1])
    assert pool.keys() == ["snap-4-0", "snap-4-1"] and pool.stats.evictions == 0
    assert budget.held == budget.shared == 2 * size and budget.by_tenant == {}
    pool.get(snaps[2])  # one past the budget: the least recently used goes, its bytes with it
    assert pool.keys() == ["snap-4-1", "snap-4-2"] and pool.stats.evictions == 1
    assert budget.held == 2 * size
    assert pool.reclaim(1) == size and budget.held == size  # the budget may ask for bytes back
    # the per-key limit (one entry's bytes) is not touched by the pool: a run of exactly that fits...
    budget.total = 2 * size
    budget.take("run-a", "key-a", size, "a run")
    assert budget.held == 2 * size and len(pool) == 1
    with pytest.raises(WorkerError, match="max_adapter_bytes=") as over:  # ...and one byte more is the key's
        budget.take("run-b", "key-a", 1, "a run")
    assert over.value.status == 429 and budget.held == 2 * size and len(pool) == 1


def test_a_training_run_reclaims_pool_bytes_and_a_pool_load_past_the_total_is_refused(tiny_model_dir):
    """Total = 3 entries, two resident: a run of one entry's bytes fits beside them (the bound, nothing evicted);
    one byte more evicts the least recently used entry. With the runs holding all but one entry's bytes an entry
    still loads; with one byte more it cannot, even with the pool empty: 429 naming --max-adapter-bytes-total,
    nothing changed."""
    from server_mock.errors import WorkerError

    snaps, size, budget, pool = _pool_setup(tiny_model_dir, 3, 3)
    budget.per_tenant = 1 << 40
    pool.get(snaps[0])
    pool.get(snaps[1])
    budget.take("run-1", "key-a", size, "a run")
    assert budget.held == 3 * size and pool.stats.evictions == 0
    budget.give_back("run-1")
    budget.take("run-1", "key-a", size + 1, "a run")  # one past: the pool makes room
    assert pool.keys() == ["snap-4-1"] and pool.stats.evictions == 1
    assert budget.held == 2 * size + 1
    with pytest.raises(WorkerError, match="--max-adapter-bytes-total"):  # more than the pool could free
        budget.take("run-big", "key-a", 2 * size, "a run")
    assert pool.keys() == ["snap-4-1"] and budget.held == 2 * size + 1  # refused as it was: the pool kept
    budget.give_back("run-1")
    budget.take("run-2", "key-a", 2 * size, "a run")  # the runs leave exactly one entry's bytes
    pool.reclaim(size)
    assert len(pool) == 0 and budget.held == 2 * size
    pool.get(snaps[2])
    assert pool.keys() == ["snap-4-2"] and budget.held == 3 * size
    pool.reclaim(size)
    budget.give_back("run-2")
    budget.take("run-2", "key-a", 2 * size + 1, "a run")
    with pytest.raises(WorkerError) as refused:
        pool.get(snaps[0])
    assert refused.value.status == 429 and "--max-adapter-bytes-total" in str(refused.value), refused.value
    assert f"max_adapter_bytes_total={3 * size}" in str(refused.value)
    assert len(pool) == 0 and budget.held == 2 * size + 1
    with pytest.raises(WorkerError, match="--max-adapter-bytes-total"):  # a run the pool cannot make room for
        budget.take("run-3", "key-b", size, "a run")
    assert budget.held == 2 * size + 1


def test_the_worker_charges_each_model_pool_to_its_adapter_budget(tiny_model_dir, tmp_path):
    """Through the service: a mixed batch of two adapters on the worker's own host puts both in the pool, and the
    worker's adapter budget (the one training runs are charged to) holds exactly the pool's bytes."""
    import torch

    from server_mock.sampling.generate import SampleSpec
    from server_mock.service.worker import WorkerService

    service = WorkerService({"tiny": str(tiny_model_dir)}, tmp_path, "cpu", torch.float32)
    try:
        host = asyncio.run(service.models.host("tiny"))
        assert host.adapter_pool.budget.budget is service.adapter_memory
        assert service.adapter_memory.held == 0
        snaps = [*_random_snapshots(host, 1, rank=4), *_random_snapshots(host, 1, rank=8)]
        session = host.sampling_session(snaps[0])
        for snap in snaps:
            session.add(SampleSpec(prompt_tokens=[5, 6, 7], num_samples=2, max_tokens=4, temperature=0.0,
                                   stop_token_ids=[]), snap)
        while session.active:
            session.run(lambda: False)
        assert len(host.adapter_pool) == 2
        assert service.adapter_memory.held == service.adapter_memory.shared == host.adapter_pool.nbytes > 0
    finally:
        service.stop()

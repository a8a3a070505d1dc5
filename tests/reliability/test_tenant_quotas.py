"""Each API key has its own quota of cached samplers and in-memory snapshots: a tenant over its quota
loses its own least recently used, never another tenant's. Tinker futures likewise: one tenant's volume
never cancels or forgets another tenant's futures."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import pytrio_compat as trio
from server_mock.api.tinker.futures import Futures

from .reliability_helpers import KEY_A, KEY_B, datum

SAMPLE = {"prompt_tokens": [5, 6, 7], "sampling_params": {"max_tokens": 2}}


@pytest.fixture(scope="module")
def quota_worker(worker_factory):
    return worker_factory("--max-snapshots", "2", "--max-samplers", "3", api_keys=[KEY_A, KEY_B])


def _client(worker, key: str) -> httpx.Client:
    return httpx.Client(base_url=worker.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _snapshot_sampler(tc) -> str:
    """A sampler on an in-memory snapshot of the run's current weights (train a step first: new weights)."""
    tc.forward_backward([datum()]).result()
    tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
    return tc.save_weights_and_get_sampling_client().sampler_id


def test_one_tenant_volume_evicts_only_its_own_snapshots_and_samplers(quota_worker, client_cache):
    service_a = trio.ServiceClient(base_url=quota_worker.base_url, api_key=KEY_A)
    service_b = trio.ServiceClient(base_url=quota_worker.base_url, api_key=KEY_B)
    try:
        b_sampler = _snapshot_sampler(service_b.create_lora_training_client("tiny", rank=4, seed=1))
        tc_a = service_a.create_lora_training_client("tiny", rank=4, seed=2)
        a_samplers = [_snapshot_sampler(tc_a) for _ in range(3)]  # one more snapshot than A's quota of 2
        with _client(quota_worker, KEY_A) as a, _client(quota_worker, KEY_B) as b:
            # B's snapshot survived A's volume (a shared LRU of 2 would have dropped it)
            assert b.post(f"/v1/samplers/{b_sampler}/sample", json=SAMPLE).status_code == 200
            # A lost its own oldest snapshot, and is told so
            gone = a.post(f"/v1/samplers/{a_samplers[0]}/sample", json=SAMPLE)
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "sampler_weights_expired", gone.text
            assert "max-snapshots" in gone.json()["error"]["message"]
            for sampler_id in a_samplers[1:]:
                assert a.post(f"/v1/samplers/{sampler_id}/sample", json=SAMPLE).status_code == 200

            # samplers: A makes more than its quota of 3; only A's least recently used are dropped
            a.get(f"/v1/samplers/{a_samplers[2]}")  # used just now: kept
            more = [a.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"] for _ in range(2)]
            assert b.get(f"/v1/samplers/{b_sampler}").status_code == 200
            kept = [sid for sid in a_samplers + more if a.get(f"/v1/samplers/{sid}").status_code == 200]
            assert kept == [a_samplers[2], *more]
    finally:
        service_a.close()
        service_b.close()


def test_tinker_futures_of_one_tenant_never_cancel_another_tenants():
    async def scenario() -> None:
        futures = Futures(max_entries=3)
        release = asyncio.Event()
        b_id = futures.add("tenant-b", release.wait())
        a_ids = [futures.add("tenant-a", release.wait()) for _ in range(10)]
        await asyncio.sleep(0)
        b_future = futures.get(b_id, "tenant-b")
        assert b_future is not None and not b_future.task.cancelled()
        assert [futures.get(rid, "tenant-a") is not None for rid in a_ids] == [False] * 7 + [True] * 3
        release.set()
        await asyncio.wait_for(b_future.task, 5)
        assert b_future.task.done() and not b_future.task.cancelled()

    asyncio.run(scenario())

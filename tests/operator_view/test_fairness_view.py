"""The fair share's books in ``/metrics`` and ``/operator/state``: the cost a queue served each tenant moves by
exactly the documented prices times what ran, the counter is that cost over the tenant's weight, and a key's
``weight=W`` from the keys file is validated and shown."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pytrio_compat as trio
from server_mock.api.auth import parse_key_lines, tenant_id
from server_mock.engine.fairness import DECODE_PRICE, PREFILL_PRICE, REQUEST_TOKENS, TRAIN_PRICE

from .operator_support import ADMIN, OTHER_KEY, TENANT_KEY, operator_worker


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    with operator_worker(tiny_model_dir, tmp_path_factory.mktemp("fairness") / "storage") as running:
        yield running


def _books(url: str, tenant: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=ADMIN).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("pytrio_worker_served_cost", "pytrio_worker_fair_share_counter"):
            assert family.type == "gauge"
            for sample in family.samples:
                if sample.labels == {"queue": "tiny", "tenant": tenant}:
                    out[family.name] = sample.value
    return out


def _datum(first: int, n: int) -> trio.Datum:
    ids = list(range(first, first + n + 1))
    return trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})


def test_served_cost_moves_by_the_prices_times_what_ran(worker):
    tenant = tenant_id(TENANT_KEY)
    worker.service.models.weights[tenant] = 2.0
    client = trio.ServiceClient(base_url=worker.url, api_key=TENANT_KEY)
    try:
        tc = client.create_lora_training_client("tiny", rank=4, seed=1)
        before = _books(worker.url, tenant)
        tc.forward_backward([_datum(10, 7), _datum(40, 11)]).result()  # 18 train tokens
        after_train = _books(worker.url, tenant)
        served = "pytrio_worker_served_cost"
        # the request's fixed price (REQUEST_TOKENS train tokens) and its tokens
        assert after_train[served] - before.get(served, 0.0) == pytest.approx((REQUEST_TOKENS + 18) * TRAIN_PRICE)
        sampler = tc.save_weights_and_get_sampling_client("f1")
        result = sampler.sample(trio.ModelInput.from_ints([5, 6, 7, 8]), num_samples=2,
                                sampling_params=trio.SamplingParams(max_tokens=5, seed=3)).result()
        returned = sum(len(seq.tokens) for seq in result.sequences)
        after = _books(worker.url, tenant)
        assert after[served] - after_train[served] == pytest.approx((REQUEST_TOKENS + 4) * PREFILL_PRICE
                                                                    + returned * DECODE_PRICE)
        # weight 2: the counter grows by half the cost served (nothing else waited, so nothing lifted it)
        counter = "pytrio_worker_fair_share_counter"
        assert after[counter] - after_train[counter] == pytest.approx((after[served] - after_train[served]) / 2)
    finally:
        client.close()

    state = httpx.get(worker.url + "/operator/state", headers=ADMIN).json()
    mine = next(t for t in state["tenants"] if t["tenant"] == tenant)
    assert mine["fair_share"]["tiny"]["weight"] == 2.0
    assert mine["fair_share"]["tiny"]["served_cost"] == pytest.approx(after["pytrio_worker_served_cost"])
    assert tenant_id(OTHER_KEY) not in {t["tenant"] for t in state["tenants"]}  # never ran anything


def test_the_keys_file_takes_a_weight_within_bounds():
    parsed = parse_key_lines("a-key weight=2 tokens_per_minute=600\nb-key weight=0.5\nc-key weight=1000\n", "f")
    assert parsed == [("a-key", {"weight": 2.0, "tokens_per_minute": 600}), ("b-key", {"weight": 0.5}),
                      ("c-key", {"weight": 1000.0})]
    for bad in ("weight=1000.5", "weight=0", "weight=-1", "weight=x", "weight="):
        with pytest.raises(ValueError, match=r"keys line 1: weight must be a number > 0 and <= 1000") as refused:
            parse_key_lines(f"secret-key {bad}\n", "keys")
        assert "secret-key" not in str(refused.value)
    with pytest.raises(ValueError, match="admins line 1: only a key may stand") as refused:
        parse_key_lines("ops-key weight=2\n", "admins", settings_allowed=False)
    assert "ops-key" not in str(refused.value)

"""``GET /metrics`` on an in-process worker over real HTTP, driven by the SDK: the families and their types (read
with prometheus_client's own parser), token counters that move by exactly what ran, queue depth while the model is
busy, answers counted by protocol and code, and a registry per worker."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pytrio_compat as trio
from server_mock.api.auth import tenant_id
from server_mock.engine.jobs import Job

from .operator_support import ADMIN, ADMIN_KEY, OTHER_KEY, TENANT_KEY, operator_worker

FAMILIES = {  # name as the parser gives it (a counter's without _total) -> type
    "pytrio_worker_requests": "counter", "pytrio_worker_queue_depth": "gauge",
    "pytrio_worker_op_duration_seconds": "histogram", "pytrio_worker_queue_wait_seconds": "histogram",
    "pytrio_worker_generation_tokens": "counter", "pytrio_worker_prefill_tokens": "counter",
    "pytrio_worker_train_tokens": "counter", "pytrio_worker_batch_rows": "histogram",
    "pytrio_worker_batch_adapters": "histogram",
    "pytrio_worker_adapters_resident": "gauge", "pytrio_worker_adapter_memory_bytes": "gauge",
    "pytrio_worker_device_memory_bytes": "gauge", "pytrio_worker_errors": "counter",
    "pytrio_worker_rate_limited": "counter", "process_resident_memory_bytes": "gauge",
}


def scrape(url: str) -> tuple[str, dict]:
    answer = httpx.get(url + "/metrics", headers=ADMIN)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(answer.text)}
    return answer.text, families


def value(families: dict, family: str, sample: str, **labels) -> float:
    """One sample's value (0 when absent: a counter not yet touched)."""
    for s in families[family].samples if family in families else ():
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return 0.0


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    with operator_worker(tiny_model_dir, tmp_path_factory.mktemp("metrics") / "storage") as running:
        yield running


@pytest.fixture(scope="module")
def client(worker):
    service = trio.ServiceClient(base_url=worker.url, api_key=TENANT_KEY)
    yield service
    service.close()


def _datum(first: int, n: int) -> trio.Datum:
    ids = list(range(first, first + n + 1))
    return trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})


def test_the_families_exist_with_their_types_and_no_key_appears(worker, client):
    client.create_lora_training_client("tiny", rank=4)  # the model is loaded, a run exists
    text, families = scrape(worker.url)
    for name, kind in FAMILIES.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
    for key in (TENANT_KEY, OTHER_KEY, ADMIN_KEY):
        assert key not in text
    assert value(families, "pytrio_worker_adapters_resident", "pytrio_worker_adapters_resident", kind="training") >= 1
    assert value(families, "process_resident_memory_bytes", "process_resident_memory_bytes") > 10 << 20


def test_token_counters_move_by_exactly_what_ran(worker, client):
    tenant = tenant_id(TENANT_KEY)
    tc = client.create_lora_training_client("tiny", rank=4, seed=3)
    _, before = scrape(worker.url)
    data = [_datum(10, 7), _datum(40, 11)]  # 7 + 11 input tokens
    tc.forward_backward(data).result()
    _, after_train = scrape(worker.url)
    train = ("pytrio_worker_train_tokens", "pytrio_worker_train_tokens_total")
    assert value(after_train, *train, tenant=tenant) - value(before, *train, tenant=tenant) == 7 + 11
    rows = ("pytrio_worker_batch_rows", "pytrio_worker_batch_rows_sum")
    assert value(after_train, *rows) - value(before, *rows) == 2  # one forward op of two datums

    sampler = tc.save_weights_and_get_sampling_client("m1")
    prompt = trio.ModelInput.from_ints([5, 6, 7, 8])
    results = [sampler.sample(prompt, num_samples=2, sampling_params=trio.SamplingParams(max_tokens=6, seed=s))
               .result() for s in (1, 2)]
    returned = sum(len(seq.tokens) for r in results for seq in r.sequences)
    _, after = scrape(worker.url)
    gen = ("pytrio_worker_generation_tokens", "pytrio_worker_generation_tokens_total")
    pre = ("pytrio_worker_prefill_tokens", "pytrio_worker_prefill_tokens_total")
    assert value(after, *gen, tenant=tenant) - value(after_train, *gen, tenant=tenant) == returned
    assert value(after, *pre, tenant=tenant) - value(after_train, *pre, tenant=tenant) == 2 * 4  # a prompt a request
    assert value(after, *train, tenant=tenant) == value(after_train, *train, tenant=tenant)  # sampling trains nothing
    waited = ("pytrio_worker_queue_wait_seconds", "pytrio_worker_queue_wait_seconds_count")
    assert value(after, *waited, op="sample") - value(after_train, *waited, op="sample") == 2


def _hold(queue, request_id: str, owner: str) -> threading.Event:
    """Occupy the queue's model thread with a job of ``owner`` until the returned event is set (30 s at most)."""
    gate, running = threading.Event(), threading.Event()

    def hold() -> dict:
        running.set()
        gate.wait(30)
        return {}

    queue.put(Job(request_id, "hold", hold, owner=owner))
    assert running.wait(10)
    return gate


def test_queue_depth_counts_waiting_jobs_by_tenant_and_op(worker, client):
    client.create_lora_training_client("tiny", rank=4)
    queue = worker.service.models.queue("tiny")
    gate = _hold(queue, "hold", "tenant-x")
    for i in range(3):
        queue.put(Job(f"a{i}", "forward_backward", dict, owner="tenant-a"))
    queue.put(Job("b0", "sample", dict, owner="tenant-b"))
    try:
        _, families = scrape(worker.url)
        depth = ("pytrio_worker_queue_depth", "pytrio_worker_queue_depth")
        assert value(families, *depth, tenant="tenant-a", op="forward_backward") == 3
        assert value(families, *depth, tenant="tenant-b", op="sample") == 1
        assert value(families, *depth, tenant="tenant-x", op="hold") == 0  # running, not waiting
    finally:
        gate.set()
    deadline = time.monotonic() + 10
    while queue.depth() and time.monotonic() < deadline:
        time.sleep(0.01)
    _, families = scrape(worker.url)
    assert value(families, "pytrio_worker_queue_depth", "pytrio_worker_queue_depth", tenant="tenant-a") == 0


def _batches_of(families: dict, adapters: int) -> float:
    """Batches the metric saw with exactly ``adapters`` sets of weights (its buckets are 1, 2, 3, 4, ...)."""
    family, bucket = "pytrio_worker_batch_adapters", "pytrio_worker_batch_adapters_bucket"
    return value(families, family, bucket, le=f"{float(adapters)}") - value(families, family, bucket,
                                                                            le=f"{float(adapters - 1)}")


def test_a_mixed_decode_batch_of_three_adapters_is_reported_as_three(worker, client):
    """Three adapters' requests queued behind a held model thread decode as one mixed batch (the local backend's
    decode session): the console's running batch and ``batch_adapters`` count three sets of weights, not one."""
    samplers = [client.create_lora_training_client("tiny", rank=4, seed=20 + i).save_weights_and_get_sampling_client()
                for i in range(3)]
    queue = worker.service.models.sampling_queue("tiny")
    _, before = scrape(worker.url)
    seen: list[dict] = []
    observed = worker.service.usage.activity.running

    def spy(thread, batch):
        if batch is not None and batch.kind == "sample":
            seen.append({"adapters": batch.adapters, "rows": batch.rows})
        observed(thread, batch)

    worker.service.usage.activity.running = spy
    try:
        gate = _hold(queue, "hold-mixed", tenant_id(TENANT_KEY))
        prompt = trio.ModelInput.from_ints([5, 6, 7, 8])
        params = trio.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
        futures = [s.sample(prompt, num_samples=2, sampling_params=params) for s in samplers]
        deadline = time.monotonic() + 10
        while queue.depth() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        for future in futures:
            future.result()
    finally:
        worker.service.usage.activity.running = observed
    _, after = scrape(worker.url)
    assert {"adapters": 3, "rows": 6} in seen, seen
    assert max(b["adapters"] for b in seen) == 3
    assert _batches_of(after, 3) - _batches_of(before, 3) >= 1
    family = "pytrio_worker_batch_adapters"
    up_to_three, count = (family, f"{family}_bucket"), (family, f"{family}_count")
    assert (value(after, *up_to_three, le="3.0") - value(before, *up_to_three, le="3.0")
            == value(after, *count) - value(before, *count))  # none of more than three


def test_a_batch_of_one_mix_key_counts_its_distinct_weights():
    """A host that takes a mix key's jobs as one batch (the Ray replicas) gives them one batch key: the batch still
    counts the distinct weights its jobs hold."""
    from server_mock.service.usage import Usage

    usage = Usage()
    jobs = []
    for i, weights in enumerate(["tiny:a", "tiny:b", "tiny:c", "tiny:a"]):
        job = Job(f"r{i}", "sample", dict, owner="t", batch_key="t|tiny", scope=f"sampler-{weights}")
        job.weights_key = weights
        jobs.append(job)
    usage.batch(jobs)
    (running,) = usage.activity.snapshot()["running"]
    assert running["adapters"] == 3 and running["rows"] == 4
    samples = {(s.name, s.labels.get("le")): s.value for family in usage.metrics.registry.collect()
               if family.name == "pytrio_worker_batch_adapters" for s in family.samples}
    assert samples[("pytrio_worker_batch_adapters_sum", None)] == 3
    assert samples[("pytrio_worker_batch_adapters_bucket", "2.0")] == 0
    assert samples[("pytrio_worker_batch_adapters_bucket", "3.0")] == 1


def test_answers_are_counted_by_protocol_and_code(worker):
    _, before = scrape(worker.url)
    key = {"authorization": f"Bearer {TENANT_KEY}"}
    httpx.get(worker.url + "/v1/whoami", headers=key)
    httpx.get(worker.url + "/v1/whoami")  # 401
    httpx.get(worker.url + "/api/openai/v1/models", headers=key)
    httpx.get(worker.url + "/v1/whoami", headers={**key, "origin": "http://evil.example"})  # the browser guard's 403
    _, after = scrape(worker.url)
    sample = ("pytrio_worker_requests", "pytrio_worker_requests_total")

    def moved(protocol: str, code: str) -> float:
        return value(after, *sample, protocol=protocol, code=code) - value(before, *sample, protocol=protocol,
                                                                             code=code)

    assert moved("native", "200") == 1 and moved("native", "401") == 1 and moved("native", "403") == 1
    assert moved("openai", "200") == 1
    assert moved("operator", "200") == 1  # the first scrape, counted by the second


def test_a_refused_request_is_counted_with_its_code(worker):
    _, before = scrape(worker.url)
    gone = httpx.get(worker.url + "/v1/training_runs/run-00000000000000000000",
                     headers={"authorization": f"Bearer {TENANT_KEY}"})
    assert gone.status_code == 404
    _, after = scrape(worker.url)
    tenant = tenant_id(TENANT_KEY)
    sample = ("pytrio_worker_errors", "pytrio_worker_errors_total")
    assert value(after, *sample, tenant=tenant, code="training_run_not_found") - value(
        before, *sample, tenant=tenant, code="training_run_not_found") == 1
    state = httpx.get(worker.url + "/operator/state", headers=ADMIN).json()
    mine = next(t for t in state["tenants"] if t["tenant"] == tenant)
    newest = mine["errors"][0]
    assert (newest["code"], newest["status"]) == ("training_run_not_found", 404)
    assert newest["op"] == "GET /v1/training_runs/run-00000000000000000000"


def test_two_workers_in_one_process_keep_their_own_registry(worker, tiny_model_dir, tmp_path):
    with operator_worker(tiny_model_dir, tmp_path / "storage") as other:
        _, fresh = scrape(other.url)
        assert value(fresh, "pytrio_worker_train_tokens", "pytrio_worker_train_tokens_total",
                     tenant=tenant_id(TENANT_KEY)) == 0
        assert other.service.usage.metrics.registry is not worker.service.usage.metrics.registry

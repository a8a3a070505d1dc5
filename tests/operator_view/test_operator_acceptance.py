"""The operator's view on a real worker process started with ``--admin-key-file`` (and ``--api-key-file``), as a lab
runs it: /metrics to an admin key only, its families and types parsed by prometheus_client, token counters that move
by exactly a forward_backward's datum tokens and two seeded samples' returned tokens, no key in the text, in the
process list or in the log, and /console a text/html page."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pytrio_compat as trio
from server_mock.api.auth import tenant_id

from .test_metrics import FAMILIES, value

TENANT_KEY = "lab-key-alpha-7f3e"
BUDGETED_KEY = "lab-key-beta-22d0"  # its own budget, from the keys file
BUDGET = 30
ADMIN_KEY = "lab-operator-key-91c2"


@pytest.fixture(scope="module")
def lab_worker(tiny_model_dir, tmp_path_factory):
    from support import WorkerProcess

    root = tmp_path_factory.mktemp("lab")
    keys, admins = root / "keys.txt", root / "admins.txt"
    keys.write_text(f"# the lab's tenants\n{TENANT_KEY}\n{BUDGETED_KEY} tokens_per_minute={BUDGET}\n")
    admins.write_text(f"{ADMIN_KEY}  # the operator\n")
    for path in (keys, admins):
        path.chmod(0o600)
    proc = WorkerProcess(tiny_model_dir, root / "storage", "--api-key-file", str(keys), "--admin-key-file",
                         str(admins), "--log-level", "INFO", warm=False).start()  # cold: it reads the command line
    yield proc
    proc.stop()


def metrics(proc, headers: dict) -> httpx.Response:
    return httpx.get(proc.base_url + "/metrics", headers=headers, timeout=30)


def test_metrics_answer_the_admin_key_only(lab_worker):
    assert metrics(lab_worker, {}).status_code == 401
    assert metrics(lab_worker, {"authorization": f"Bearer {TENANT_KEY}"}).status_code == 403
    assert metrics(lab_worker, {"authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
    assert metrics(lab_worker, {"x-admin-key": ADMIN_KEY}).status_code == 200


def test_families_types_and_exact_token_counts(lab_worker):
    client = trio.ServiceClient(base_url=lab_worker.base_url, api_key=TENANT_KEY)
    tc = client.create_lora_training_client("tiny", rank=4, seed=5)
    before = {f.name: f for f in text_string_to_metric_families(metrics(lab_worker, {"x-admin-key": ADMIN_KEY}).text)}
    lengths = (9, 13)
    data = []
    for i, n in enumerate(lengths):
        ids = [(11 * j + 7 * i) % 400 + 20 for j in range(n + 1)]
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]}))
    tc.forward_backward(data).result()
    sampler = tc.save_weights_and_get_sampling_client("acceptance")
    prompt = trio.ModelInput.from_ints([30, 31, 32, 33, 34])
    returned = 0
    for seed in (101, 202):
        result = sampler.sample(prompt, num_samples=1, sampling_params=trio.SamplingParams(max_tokens=8, seed=seed))
        returned += sum(len(s.tokens) for s in result.result().sequences)
    text = metrics(lab_worker, {"x-admin-key": ADMIN_KEY}).text
    after = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in FAMILIES.items():
        assert name in after and after[name].type == kind, name
    tenant = tenant_id(TENANT_KEY)
    train = ("pytrio_worker_train_tokens", "pytrio_worker_train_tokens_total")
    gen = ("pytrio_worker_generation_tokens", "pytrio_worker_generation_tokens_total")
    assert value(after, *train, tenant=tenant) - value(before, *train, tenant=tenant) == sum(lengths)
    assert value(after, *gen, tenant=tenant) - value(before, *gen, tenant=tenant) == returned
    assert returned > 0
    assert TENANT_KEY not in text and ADMIN_KEY not in text
    client.close()


def test_a_key_file_budget_limits_that_key_only(lab_worker):
    from .test_rate_limits import _wire

    def op(key: str, run: str, seq: int, n: int) -> httpx.Response:
        return httpx.post(f"{lab_worker.base_url}/v1/training_runs/{run}/ops", timeout=60,
                          headers={"authorization": f"Bearer {key}"},
                          json={"seq_id": seq, "payload": {"op": "forward_backward", "data": [_wire(10, n)]}})

    runs = {}
    for key in (TENANT_KEY, BUDGETED_KEY):
        runs[key] = httpx.post(lab_worker.base_url + "/v1/training_runs", headers={"authorization": f"Bearer {key}"},
                               json={"base_model": "tiny", "lora": {"rank": 4}}, timeout=60).json()["training_run_id"]
    assert op(BUDGETED_KEY, runs[BUDGETED_KEY], 1, BUDGET).status_code == 200  # the whole budget
    refused = op(BUDGETED_KEY, runs[BUDGETED_KEY], 2, 10)  # 10 tokens at 30 a minute: 20 s
    assert refused.status_code == 429 and 19 <= int(refused.headers["retry-after"]) <= 20, refused.headers
    assert op(TENANT_KEY, runs[TENANT_KEY], 1, 200).status_code == 200  # no budget for the other key


def test_console_page_and_no_key_in_the_process_list_or_the_log(lab_worker):
    page = httpx.get(lab_worker.base_url + "/console", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    cmdline = open(f"/proc/{lab_worker.process.pid}/cmdline", "rb").read().decode()
    log = (lab_worker.storage.parent / "worker.log").read_text()
    for key in (TENANT_KEY, BUDGETED_KEY, ADMIN_KEY):
        assert key not in cmdline and key not in log

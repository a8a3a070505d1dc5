"""A long decode is sliced: another tenant's work takes its turn between slices, a request for the same weights
joins the running batch at its next step, and every request's tokens are those it gets alone."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from support import running_worker

from server_mock.engine.jobs import Job


from server_mock.engine.queue import ModelQueue

from .reliability_helpers import KEY_A, KEY_B, datum_wire

# --- the queue, with a stand-in decode batch ----------------------------------------------------------


class FakeDecoding:
    """Each payload is (tag, steps); a step advances every request by one and takes ``step_seconds``."""

    def __init__(self, log: list, name: str, step_seconds: float = 0.005) -> None:
        self.log, self.name, self.step_seconds = log, name, step_seconds
        self.left: dict[int, list] = {}
        self.added: list[str] = []

    @property
    def active(self) -> bool:
        return bool(self.left)

    def can_add(self) -> bool:
        return True

    def add(self, payload) -> int:
        tag, steps = payload
        self.added.append(tag)
        handle = len(self.added)
        self.left[handle] = [tag, steps]
        return handle

    def run(self, stop) -> list[tuple[int, dict]]:
        while True:
            time.sleep(self.step_seconds)
            self.log.append(f"{self.name}:step")
            done = []
            for handle, item in list(self.left.items()):
                item[1] -= 1
                if item[1] == 0:
                    del self.left[handle]
                    self.log.append(item[0])
                    done.append((handle, {"tag": item[0]}))
            if done or not self.left or stop():
                return done


def _setup(slice_seconds: float = 0.05, budget: int = 65536):
    loop = asyncio.new_event_loop()
    queue = ModelQueue("unit", loop, batch_token_budget=budget, batch_window=0.0, slice_seconds=slice_seconds)
    log: list[str] = []
    decodings: dict[str, FakeDecoding] = {}

    def sample(owner: str, tag: str, key: str, steps: int, cost: int = 1) -> Job:
        job = Job(request_id=tag, kind="sample", fn=lambda: {"solo": tag}, owner=owner, batch_key=key)
        job.payload, job.batch_cost = (tag, steps), cost

        def open_decode():
            decodings[tag] = FakeDecoding(log, tag)
            return decodings[tag]
        job.open_decode = open_decode
        return job

    def plain(owner: str, tag: str) -> Job:
        def fn() -> dict:
            log.append(tag)
            return {}
        return Job(request_id=tag, kind="test", fn=fn, owner=owner)

    return loop, queue, log, decodings, sample, plain


def _wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_another_tenant_runs_between_slices_of_a_long_decode():
    loop, queue, log, decodings, sample, plain = _setup()
    try:
        long = sample("A", "A-long", "wA", steps=400)
        queue.put(long)
        _wait_until(lambda: "A-long:step" in log)
        a_next = plain("A", "A-next")
        queue.put(a_next)  # A's own next job waits for A's decode (A's lane keeps its order)
        b_job, c_sample = plain("B", "B-op"), sample("C", "C-sample", "wC", steps=3)
        queue.put(b_job)
        queue.put(c_sample)
        _wait_until(lambda: "C-sample" in log)
        # B's op and C's whole decode ran while A's decode was still going
        assert "A-long" not in log and long.status == "running"
        assert log.index("B-op") < log.index("C-sample")
        assert log.count("A-long:step") < 400
        _wait_until(lambda: "A-next" in log)
        assert log.index("A-long") < log.index("A-next")  # the owner's session before its next job
        assert log[log.index("B-op") + 1:].count("A-long:step") > 0  # A resumed after B's turn
        assert long.result == {"tag": "A-long"} and c_sample.result == {"tag": "C-sample"}
    finally:
        queue.stop()
        loop.close()


def test_a_request_for_the_same_weights_joins_the_running_batch():
    loop, queue, log, decodings, sample, plain = _setup(slice_seconds=30.0)
    try:
        queue.put(sample("A", "A-long", "w", steps=300))
        _wait_until(lambda: "A-long:step" in log)
        b = sample("B", "B-short", "w", steps=3)
        queue.put(b)
        _wait_until(lambda: b.status == "succeeded")
        # it was added to A's batch (no batch of its own) and finished there, long before A's request
        assert decodings["A-long"].added == ["A-long", "B-short"] and "B-short" not in decodings
        assert "A-long" not in log
        steps_before_join = log.index("B-short") - 3
        assert log[steps_before_join:log.index("B-short")] == ["A-long:step"] * 3
        assert b.result == {"tag": "B-short"}
    finally:
        queue.stop()
        loop.close()


def test_joining_is_bounded_by_the_token_budget():
    """A batch of cost 8 with budget 10: a cost-2 request joins (exactly at the budget), a cost-3 one does not
    (one past it) and decodes in its own batch at its owner's turn."""
    loop, queue, log, decodings, sample, plain = _setup(slice_seconds=0.05, budget=10)
    try:
        queue.put(sample("A", "A-long", "w", steps=300, cost=8))
        _wait_until(lambda: "A-long:step" in log)
        fits, too_big = sample("B", "B-fits", "w", steps=5, cost=2), sample("C", "C-big", "w", steps=5, cost=3)
        queue.put(too_big)
        queue.put(fits)
        _wait_until(lambda: fits.status == "succeeded" and too_big.status == "succeeded")
        assert decodings["A-long"].added == ["A-long", "B-fits"]
        assert decodings["C-big"].added == ["C-big"]
        assert "A-long" not in log
    finally:
        queue.stop()
        loop.close()


def test_a_host_without_sessions_runs_the_batch_in_one_go():
    loop, queue, log, decodings, sample, plain = _setup()
    try:
        gate = threading.Event()
        blocker = plain("A", "A0")
        blocker.fn = lambda: (gate.wait(10), log.append("A0"), {})[-1]
        queue.put(blocker)
        _wait_until(lambda: queue.depth() == 0)
        jobs = [sample(owner, f"{owner}-s", "w", steps=2) for owner in ("B", "C")]
        for job in jobs:
            job.open_decode = lambda: None  # e.g. a Ray-backed model: batch_fn decodes the batch
            job.batch_fn = lambda payloads: [{"batched": [p[0] for p in payloads]} for p in payloads]
            queue.put(job)
        gate.set()
        _wait_until(lambda: all(j.status == "succeeded" for j in jobs))
        assert [j.result for j in jobs] == [{"batched": ["B-s", "C-s"]}] * 2
    finally:
        queue.stop()
        loop.close()


# --- over HTTP: tenant B behind tenant A's longest allowed sample request -------------------------------


def _done(http: httpx.Client, request_id: str) -> dict:
    reply = http.get(f"/v1/requests/{request_id}", params={"wait": 60}).json()
    assert reply["status"] == "succeeded", reply
    return reply["result"]


def _b_setup(b: httpx.Client) -> list[str]:
    """Tenant B's samplers: the base model (whose batch key every tenant shares) and its own trained weights."""
    run = b.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}).json()["training_run_id"]
    ops = [{"op": "forward_backward", "loss_fn": "cross_entropy", "data": [datum_wire()]},
           {"op": "optim_step", "adam_params": {"learning_rate": 1e-2}},
           {"op": "save_weights_for_sampler", "name": "w"}]
    results = [_done(b, b.post(f"/v1/training_runs/{run}/ops", json={"seq_id": seq, "payload": payload}).json()
                     ["request_id"]) for seq, payload in enumerate(ops, start=1)]
    return [b.post("/v1/samplers", json=body).json()["sampler_id"]
            for body in ({"base_model": "tiny"}, {"model_path": results[-1]["path"]})]


SHORT = {"prompt_tokens": [9, 10, 11], "num_samples": 2, "sampling_params": {"max_tokens": 4, "seed": 3}}


def _start_long(a: httpx.Client, num_samples: int, max_tokens: int) -> str:
    sampler = a.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
    body = {"prompt_tokens": [5, 6, 7, 8], "num_samples": num_samples,
            "sampling_params": {"max_tokens": max_tokens, "stop": [], "seed": 1}}
    reply = a.post(f"/v1/samplers/{sampler}/sample", json=body)
    assert reply.status_code == 200, reply.text
    request_id = reply.json()["request_id"]
    _wait_until(lambda: a.get(f"/v1/requests/{request_id}").json()["status"] == "running", timeout=60)
    return request_id


def test_a_short_sample_does_not_wait_for_another_tenants_longest_request(tiny_model_dir, tmp_path):
    with running_worker(tiny_model_dir, tmp_path, api_keys=[KEY_A, KEY_B], in_process=True) as worker, \
            httpx.Client(base_url=worker.base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=90) as a, \
            httpx.Client(base_url=worker.base_url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=90) as b:
        b_samplers = _b_setup(b)
        alone = [_done(b, b.post(f"/v1/samplers/{s}/sample", json=SHORT).json()["request_id"]) for s in b_samplers]
        # A's longest allowed request: rows to the model's whole context (2048), never stopping, as many as the
        # request token budget allows (--max-sample-request-tokens 262144 = 128 x 2048); one more row is refused
        sampler = a.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
        over = {"prompt_tokens": [5, 6, 7, 8], "num_samples": 129, "sampling_params": {"max_tokens": 2044}}
        assert a.post(f"/v1/samplers/{sampler}/sample", json=over).status_code == 413
        a_id = _start_long(a, 128, 2044)
        b_ids = [b.post(f"/v1/samplers/{s}/sample", json=SHORT).json()["request_id"] for s in b_samplers]
        got = [_done(b, rid) for rid in b_ids]
        # both of B's requests finished while A's was still decoding: B waited for slices, not for A's request
        assert a.get(f"/v1/requests/{a_id}").json()["status"] == "running"
        for mine, solo in zip(got, alone):
            assert [s["tokens"] for s in mine["sequences"]] == [s["tokens"] for s in solo["sequences"]]
        # A's request alone is over the batch token budget, so neither joined its batch (that would count 3); B's
        # two (the base model and its adapter) may share one mixed-adapter batch of B's own
        assert [r["metrics"]["batch_requests"] for r in got] in ([1.0, 1.0], [2.0, 2.0])


@pytest.mark.parametrize("across", [True, False], ids=["batch-across-tenants", "per-tenant-batches"])
def test_a_request_for_the_same_weights_joins_another_tenants_running_batch(tiny_model_dir, tmp_path, across):
    """With --batch-across-tenants B joins A's running batch; by default it waits for a slice of its own."""
    flags = ["--batch-across-tenants"] if across else []
    with running_worker(tiny_model_dir, tmp_path, *flags, api_keys=[KEY_A, KEY_B], in_process=True) as worker, \
            httpx.Client(base_url=worker.base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=90) as a, \
            httpx.Client(base_url=worker.base_url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=90) as b:
        base = b.post("/v1/samplers", json={"base_model": "tiny"}).json()["sampler_id"]
        alone = _done(b, b.post(f"/v1/samplers/{base}/sample", json=SHORT).json()["request_id"])
        a_id = _start_long(a, 8, 2044)  # 8 x 2048 tokens: within the batch token budget (65,536)
        mine = _done(b, b.post(f"/v1/samplers/{base}/sample", json=SHORT).json()["request_id"])
        assert a.get(f"/v1/requests/{a_id}").json()["status"] == "running"
        # it joined A's batch while that decoded, or (tenants apart) decoded in a batch of its own
        assert mine["metrics"]["batch_requests"] == (2.0 if across else 1.0)
        assert [s["tokens"] for s in mine["sequences"]] == [s["tokens"] for s in alone["sequences"]]
        for x, y in zip(mine["sequences"], alone["sequences"]):
            assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) < 1e-5


class GroupDecoding(FakeDecoding):
    """A FakeDecoding that also admits a group at once (``add_many``), recording each group; ``refuse_groups``:
    every group admission fails (as a prefill that runs out of memory would), and a payload tagged ``*bad`` fails
    on its own."""

    def __init__(self, log: list, name: str, refuse_groups: bool = False) -> None:
        super().__init__(log, name)
        self.groups: list[list[str]] = []
        self.refuse_groups = refuse_groups

    def add(self, payload) -> int:
        if payload[0].endswith("bad"):
            raise ValueError(f"{payload[0]} cannot be prefilled")
        return super().add(payload)

    def add_many(self, payloads) -> list[int]:
        if self.refuse_groups:
            raise RuntimeError("the group's prefill failed")
        self.groups.append([tag for tag, _ in payloads])
        return [super(GroupDecoding, self).add(payload) for payload in payloads]


@pytest.mark.parametrize("refuse_groups", [False, True])
def test_requests_queued_for_the_same_weights_are_admitted_as_one_group(refuse_groups):
    """Five requests for one set of weights that waited together are prefilled as one group (one ``add_many``);
    where the group's admission fails, each is added alone and only the one that cannot be prefilled fails."""
    loop = asyncio.new_event_loop()
    queue = ModelQueue("unit", loop, batch_token_budget=65536, batch_window=0.0)
    log: list[str] = []
    made: list[GroupDecoding] = []
    started, release = threading.Event(), threading.Event()

    def hold() -> dict:  # B's op holds the model's thread while A's requests queue up
        started.set()
        release.wait(20)
        return {}
    try:
        queue.put(Job(request_id="B-op", kind="test", fn=hold, owner="B"))
        assert started.wait(20)
        tags = ["A0", "A1", "A2bad" if refuse_groups else "A2", "A3", "A4"]
        jobs = []
        for tag in tags:
            job = Job(request_id=tag, kind="sample", fn=lambda: {}, owner="A", batch_key="wA")
            job.payload, job.batch_cost = (tag, 3), 1

            def open_decode():
                made.append(GroupDecoding(log, "wA", refuse_groups))
                return made[-1]
            job.open_decode = open_decode
            jobs.append(job)
            queue.put(job)
        release.set()
        _wait_until(lambda: all(job.finished for job in jobs))
        assert len(made) == 1
        if refuse_groups:
            assert made[0].groups == [] and made[0].added == ["A0", "A1", "A3", "A4"]
            assert jobs[2].error is not None and "A2bad cannot be prefilled" in jobs[2].error.message
            assert [job.result for job in jobs if job is not jobs[2]] == [{"tag": t} for t in ("A0", "A1", "A3", "A4")]
        else:
            assert made[0].groups == [tags]  # one admission for all five
            assert [job.result for job in jobs] == [{"tag": t} for t in tags]
    finally:
        release.set()
        queue.stop()
        loop.close()

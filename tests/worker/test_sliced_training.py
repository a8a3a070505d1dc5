"""A long forward_backward runs in slices between its micro-batches: other tenants' jobs run in between, and its
losses, gradients and the weights after optim_step are those of running it in one go, to the bit."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from pytrio_compat.wire import AdamParams, CreateSampler, CreateTrainingRun, LoraSpec, OptimStepOp, SampleRequest
from pytrio_compat.wire import WireSamplingParams
from server_mock.config import TrainOptions
from server_mock.engine.jobs import Job, job_result
from server_mock.service.ops import ForwardBatch
from server_mock.service.worker import WorkerService
from server_mock.training import losses

MICRO_BATCH_TOKENS = 64  # 40 datums of 10-14 tokens: about ten micro-batches


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    loop = asyncio.new_event_loop()
    service = WorkerService({"tiny": str(tiny_model_dir)}, tmp_path_factory.mktemp("sliced"), "cpu", torch.float32,
                            train_options=TrainOptions(micro_batch_tokens=MICRO_BATCH_TOKENS))
    try:
        yield loop, service
    finally:
        service.stop()
        loop.close()


class Recorder:
    """The queue's observer, passed through to the service's, that writes down the order of starts and ends,
    and how many parts of A's op had run when each job ended (``parts``: A's step counter)."""

    def __init__(self, inner, parts: list) -> None:
        self.inner, self.parts, self.events = inner, parts, []

    def started(self, jobs):
        self.events += [("started", job.request_id) for job in jobs]
        self.inner.started(jobs)

    def batch(self, jobs):
        self.inner.batch(jobs)

    def computed(self, job, result):
        self.inner.computed(job, result)

    def finished(self, job):
        self.events.append(("finished", job.request_id, len(self.parts)))
        self.inner.finished(job)


def _data(vocab: int, n: int = 40, policy_inputs: bool = False) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(n):
        ids = rng.integers(10, vocab - 1, int(rng.integers(11, 16)))
        row = {"tokens": ids[:-1].astype(np.int64), "target_tokens": ids[1:].astype(np.int64)}
        if policy_inputs:  # a GRPO-shaped datum: the sampler's logprobs and an advantage per token
            row["logprobs"] = -rng.uniform(0.5, 3.0, len(row["tokens"])).astype(np.float32)
            row["advantages"] = np.full(len(row["tokens"]), rng.normal(), dtype=np.float32)
        rows.append(row)
    return rows


async def _train(service: WorkerService, run, tenant: str, data, loss: tuple = ("cross_entropy", {})) -> dict:
    prepared = await asyncio.to_thread(service.runs.prepare, run, ForwardBatch(loss[0], data, True, dict(loss[1])))
    return await job_result(service.runs.submit(run.run_id, prepared, tenant, seq_id=None).job)


async def _step(service: WorkerService, run, tenant: str) -> dict:
    op = OptimStepOp(adam_params=AdamParams(learning_rate=1e-2))
    return await job_result(service.runs.submit(run.run_id, op, tenant, seq_id=None).job)


# the loss of a plain call, and a GRPO-shaped one whose KL term adds a reference pass (in parts too) before it
LOSSES = {"cross_entropy": ("cross_entropy", {}),
          "importance_sampling+kl": ("importance_sampling", {"kl_coef": 0.1})}


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_sliced_forward_backward_is_bit_identical_and_yields_between_micro_batches(worker, loss_name):
    loop, service = worker
    loss = LOSSES[loss_name]
    a, w, b, c, x = (f"{name}-{loss_name}" for name in "AWBCX")  # fresh keys: fresh counters

    async def scenario():
        spec = LoraSpec(rank=4, seed=11)
        sliced_run = await service.runs.create(CreateTrainingRun(base_model="tiny", lora=spec), a)
        whole_run = await service.runs.create(CreateTrainingRun(base_model="tiny", lora=spec), w)
        other_run = await service.runs.create(CreateTrainingRun(base_model="tiny", lora=LoraSpec(rank=4)), c)
        sampler = await service.samplers.create(CreateSampler(base_model="tiny"), b)
        host = service.models.loaded("tiny")
        before = host.adapter_weights(sliced_run.adapter)
        assert all(torch.equal(before[k], v) for k, v in host.adapter_weights(whole_run.adapter).items())
        data = _data(host.vocab_size, policy_inputs=loss[0] != "cross_entropy")
        queue = service.models.queue("tiny")
        queue.slice_seconds = 0.0  # yield after every part whenever another tenant waits
        inner, parts = queue.observer, []
        recorder = queue.observer = Recorder(inner, parts)

        # a third tenant holds the model until everything below is queued, so the order does not depend on timing
        gate = threading.Event()
        queue.put(Job(f"hold-{loss_name}", "test", lambda: gate.wait(30) and {}, owner=x))
        prepared = await asyncio.to_thread(service.runs.prepare, sliced_run,
                                           ForwardBatch(loss[0], data, True, dict(loss[1])))
        assert prepared.steps is not None
        run_in_parts = prepared.steps

        def counted():  # the op's parts, counted as they run
            steps = run_in_parts()
            while True:
                try:
                    tokens = next(steps)
                except StopIteration as end:
                    return end.value
                parts.append(tokens)
                yield tokens

        prepared.steps = counted
        train = service.runs.submit(sliced_run.run_id, prepared, a, seq_id=None).job
        body = SampleRequest(prompt_tokens=list(range(5, 13)), num_samples=2,
                             sampling_params=WireSamplingParams(max_tokens=6, temperature=1.0, seed=5))
        sample = service.samplers.submit(sampler.sampler_id, body, b)
        small = await asyncio.to_thread(service.runs.prepare, other_run, ForwardBatch("cross_entropy", data[:2],
                                                                                      True))
        other = service.runs.submit(other_run.run_id, small, c, seq_id=None).job
        gate.set()
        sliced, sampled, _ = await asyncio.gather(job_result(train), job_result(sample), job_result(other))
        assert len(sampled["sequences"]) == 2
        queue.observer = inner
        sliced_step = await _step(service, sliced_run, a)

        queue.slice_jobs = False  # the same op in one go
        try:
            whole = await _train(service, whole_run, w, data, loss)
        finally:
            queue.slice_jobs = True
        whole_step = await _step(service, whole_run, w)
        return (recorder.events, train.request_id, sample.request_id, other.request_id, sliced, whole,
                sliced_step, whole_step, host.adapter_weights(sliced_run.adapter),
                host.adapter_weights(whole_run.adapter), before)

    (events, train_id, sample_id, other_id, sliced, whole, sliced_step, whole_step, sliced_w, whole_w,
     before) = loop.run_until_complete(scenario())

    # ordering: A's long op started first, then B's sample and C's op both ran and ended before it did
    starts = [e[1] for e in events if e[0] == "started"]
    ends = {e[1]: e[2] for e in events if e[0] == "finished"}
    order = [e[1] for e in events if e[0] == "finished"]
    assert starts.index(train_id) < starts.index(sample_id) and starts.index(train_id) < starts.index(other_id)
    assert order.index(sample_id) < order.index(train_id) and order.index(other_id) < order.index(train_id)
    total = ends[train_id]  # all of A's parts: ten or so, twice that with the KL's reference pass
    assert total >= 8
    assert 0 < ends[sample_id] < total and 0 < ends[other_id] < total  # ... while A's op was part-way

    # bit-identical results: per-datum losses and logprobs, metrics, grad norm and the weights after optim_step
    assert len(sliced["loss_fn_outputs"]) == len(whole["loss_fn_outputs"]) == 40
    for a, b in zip(sliced["loss_fn_outputs"], whole["loss_fn_outputs"]):
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(np.asarray(a[name]), np.asarray(b[name])), name
    assert {k: v for k, v in sliced["metrics"].items() if not k.startswith("time/")} == \
        {k: v for k, v in whole["metrics"].items() if not k.startswith("time/")}
    assert sliced_step["metrics"]["grad_norm"] == whole_step["metrics"]["grad_norm"] > 0
    assert sliced_w.keys() == whole_w.keys()
    assert all(torch.equal(sliced_w[k], whole_w[k]) for k in sliced_w)
    assert not all(torch.equal(sliced_w[k], before[k]) for k in sliced_w)  # the step did change the weights


def test_a_part_that_fails_restores_the_gradients_of_before_the_op(worker):
    """The host's parts: a failure between two of them (thrown in at the pause, as an error in the next part would
    be) leaves the run's gradients as they were before the op, not half-accumulated."""
    loop, service = worker

    async def scenario():
        run = await service.runs.create(CreateTrainingRun(base_model="tiny", lora=LoraSpec(rank=4, seed=2)), "F")
        host = service.models.loaded("tiny")
        data = _data(host.vocab_size, 12)
        await _train(service, run, "F", data[:3])
        prepared = await asyncio.to_thread(service.runs.prepare, run, ForwardBatch("cross_entropy", data, True))
        return run, host, prepared.record["data"]

    run, host, rows = loop.run_until_complete(scenario())
    grads = {n: p.grad.clone() for n, p in run.adapter.params.items()}
    steps = host.forward_backward_steps(run.adapter, rows, "cross_entropy", losses.resolve_loss_config(
        "cross_entropy", {}), True)
    assert next(steps) > 0 and next(steps) > 0
    assert not all(torch.equal(grads[n], p.grad) for n, p in run.adapter.params.items())  # part-way
    with pytest.raises(RuntimeError, match="a part failed"):
        steps.throw(RuntimeError("a part failed"))
    assert all(torch.equal(grads[n], p.grad) for n, p in run.adapter.params.items())

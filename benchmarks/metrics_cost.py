"""What the operator's metrics cost: a scrape of ``/metrics`` (target <= 5 ms) and the queue observer's counting on
every op (target <= 1% of a step), in one process.

Scrape: a worker whose registry holds what a busy lab's does (``--tenants`` tenants with token counters and errors,
every op kind's histograms, answers of five protocols and ten codes), rendered ``--scrapes`` times; also the
console's JSON. Step: an RL step on the served model, in-process (a group sample of 8, a forward_backward of 8 datums,
an optim_step), run alternately with the observer on and swapped for the queue's no-op one; the observer's own time
is also timed call by call while it is on, which is the figure the target is about (the A/B step times are noisy).

    python benchmarks/metrics_cost.py [--model tiny|HuggingFaceTB/SmolLM2-135M-Instruct] [--steps 8] [--tenants 8 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import save
from pytrio_compat.wire import AdamParams, CreateSampler, CreateTrainingRun, LoraSpec, OptimStepOp, SampleRequest
from pytrio_compat.wire import WireSamplingParams
from server_mock.engine.jobs import Job, job_result
from server_mock.engine.queue import _Unobserved
from server_mock.errors import WorkerError
from server_mock.operator.state import console_state
from server_mock.service.ops import ForwardBatch
from server_mock.service.worker import WorkerService

OPS = ("forward_backward", "forward", "optim_step", "sample", "save_state", "save_weights_for_sampler", "load_state",
       "create_training_run", "delete_training_run", "adapter_layout", "save_weights_external")
PROTOCOLS = ("native", "tinker", "openai", "pytrio", "operator")
CODES = ("200", "400", "401", "403", "404", "409", "413", "415", "429", "500")


def busy_registry(service: WorkerService, tenants: int) -> None:
    """Series as a busy lab's worker holds them, made through the observer's own entry points."""
    usage, rng = service.usage, np.random.default_rng(0)
    for t in range(tenants):
        owner = f"tenant-{t:016x}"
        for kind in OPS:
            job = Job(f"{owner}-{kind}", kind, dict, owner=owner, tokens=int(rng.integers(1, 4000)))
            job.created, job.started = 0.0, float(rng.uniform(0, 2))
            job.status, job.finished = "succeeded", job.started + float(rng.uniform(0, 5))
            result = {"loss_fn_outputs": [{}] * 8} if kind.startswith("forward") else {
                "input_tokens": 150, "output_tokens": 2000, "sequences": [{}] * 8}
            usage.started([job])
            usage.computed(job, result)
            usage.finished(job)
        for code in ("rate_limited", "invalid_request")[:1 + (t % 4 == 0)]:  # a few refusals, more for some keys
            usage.refused(owner, "POST /v1/x", 400, code, "refused")
    for protocol in PROTOCOLS:
        for code in CODES:
            usage.metrics.requests.labels(protocol, code).inc()


def scrape_cost(args, tenants: int) -> dict:
    service = WorkerService({"m": "unused"}, tempfile.mkdtemp(), "cpu", torch.float32)
    busy_registry(service, tenants)
    metrics = service.usage.metrics
    text = metrics.render()
    times, cpu, state_times = [], [], []
    for _ in tqdm(range(args.scrapes), desc=f"scrapes ({tenants} tenants)"):
        started, started_cpu = time.perf_counter(), time.process_time()
        metrics.render()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
        started = time.perf_counter()
        console_state(service)
        state_times.append(time.perf_counter() - started)
    series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
    return {"tenants": tenants, "series": series, "bytes": len(text),
            "scrape_ms_median": 1e3 * statistics.median(times),
            "scrape_ms_p99": 1e3 * sorted(times)[int(0.99 * len(times))],
            "scrape_cpu_ms_median": 1e3 * statistics.median(cpu),
            "us_per_series": 1e6 * statistics.median(times) / series,
            "console_state_ms_median": 1e3 * statistics.median(state_times)}


class Timed:
    """The observer, with the time spent in each of its calls added up."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def _timed(self, name: str, *args) -> None:
        started = time.perf_counter()
        getattr(self.inner, name)(*args)
        self.seconds += time.perf_counter() - started
        self.calls += 1

    def started(self, jobs):
        self._timed("started", jobs)

    def batch(self, jobs):
        self._timed("batch", jobs)

    def computed(self, job, result):
        self._timed("computed", job, result)

    def finished(self, job):
        self._timed("finished", job)


async def step_cost(args) -> dict:
    model = args.model
    if model == "tiny":
        from server_mock.engine.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    service = WorkerService({"m": model}, tempfile.mkdtemp(), "cpu", torch.float32)
    try:
        run = await service.runs.create(CreateTrainingRun(base_model="m", lora=LoraSpec(rank=16)), "bench")
        sampler = await service.samplers.create(CreateSampler(base_model="m"), "bench")
        queue = service.models.queue("m")
        rng = np.random.default_rng(0)
        vocab = service.models.loaded("m").vocab_size
        data = []
        for _ in range(8):
            ids = rng.integers(10, vocab - 1, args.datum_tokens + 1)
            data.append({"tokens": ids[:-1].astype(np.int64), "target_tokens": ids[1:].astype(np.int64)})
        body = SampleRequest(prompt_tokens=rng.integers(10, vocab - 1, 64).tolist(), num_samples=8,
                             sampling_params=WireSamplingParams(max_tokens=args.sample_tokens, seed=1, stop=[]))
        timed = Timed(service.usage)

        async def step() -> float:
            started = time.perf_counter()
            sample = service.samplers.submit(sampler.sampler_id, body, "bench")
            await job_result(sample)
            prepared = await asyncio.to_thread(service.runs.prepare, run, ForwardBatch("cross_entropy", data, True))
            await job_result(service.runs.submit(run.run_id, prepared, "bench", seq_id=None).job)
            await job_result(service.runs.submit(run.run_id, OptimStepOp(adam_params=AdamParams(learning_rate=1e-4)),
                                                 "bench", seq_id=None).job)
            return time.perf_counter() - started

        await step()  # warm-up
        on, off = [], []
        for i in tqdm(range(2 * args.steps), desc="steps (observer on/off)"):
            observed = i % 2 == 0
            queue.observer = timed if observed else _Unobserved()
            (on if observed else off).append(await step())
        queue.observer = service.usage
        step_s = statistics.median(on)
        per_step = timed.seconds / args.steps
        return {"model": args.model, "datums": 8, "datum_tokens": args.datum_tokens, "sample_rows": 8,
                "sample_tokens": args.sample_tokens, "steps_each": args.steps,
                "step_s_observer_on": step_s, "step_s_observer_off": statistics.median(off),
                "step_ratio_on_over_off": step_s / statistics.median(off),
                "observer_us_per_step": 1e6 * per_step, "observer_calls_per_step": timed.calls / args.steps,
                "observer_share_of_step": per_step / step_s, "steps_on": on, "steps_off": off}
    finally:
        service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tenants", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--datum-tokens", type=int, default=128)
    parser.add_argument("--sample-tokens", type=int, default=32)
    args = parser.parse_args()
    try:
        scrape = [scrape_cost(args, tenants) for tenants in args.tenants]
        steps = asyncio.run(step_cost(args))
    except WorkerError as exc:
        sys.exit(exc.message)
    name = "metrics_cost" if args.model == "tiny" else "metrics_cost_" + Path(args.model).name.lower()
    save(name, {"scrape": scrape, "step": steps,
                "targets": {"scrape_ms": 5.0, "observer_share_of_step": 0.01}})


if __name__ == "__main__":
    main()

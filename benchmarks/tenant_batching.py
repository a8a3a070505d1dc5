"""What batching only within a tenant costs: base-model sample requests sent at once by K tenants (one each)
against the same K requests sent at once by one tenant, in the same worker (the same process, model and queue).

The worker decodes queued sample requests for the same weights as one batch, but only a tenant's own: requests of
different tenants are never batched together, so nothing in one tenant's answer (``batch_requests``, timings,
the last bits of its logprobs) depends on another tenant's traffic. One tenant's K requests coalesce into one
batch; K tenants' requests decode as K batches. The ratio is the throughput given up.

    python benchmarks/tenant_batching.py [--tenants 8] [--max-tokens 16] [--rounds 5] [--model PATH]
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

import torch

from pytrio_compat.wire import CreateSampler, SampleRequest, WireSamplingParams
from server_mock.engine.jobs import job_result
from server_mock.service.worker import WorkerService


async def _round(service: WorkerService, samplers: list[tuple[str, str]], body: SampleRequest) -> tuple[float, list]:
    started = time.perf_counter()
    jobs = [service.samplers.submit(sampler_id, body, tenant) for tenant, sampler_id in samplers]
    results = await asyncio.gather(*(job_result(job) for job in jobs))
    return time.perf_counter() - started, [r["metrics"]["batch_requests"] for r in results]


async def main_async(args) -> dict:
    model = args.model
    if model is None:
        from server_mock.engine.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    service = WorkerService({"m": model}, tempfile.mkdtemp(), "cpu", torch.float32)
    try:
        tenants = [f"tenant-{i}" for i in range(args.tenants)]
        many = [(t, (await service.samplers.create(CreateSampler(base_model="m"), t)).sampler_id) for t in tenants]
        one_sampler = (await service.samplers.create(CreateSampler(base_model="m"), "solo")).sampler_id
        one = [("solo", one_sampler)] * args.tenants
        body = SampleRequest(prompt_tokens=list(range(5, 37)), num_samples=4,
                             sampling_params=WireSamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1))
        await _round(service, one, body)  # warm up
        times = {"one tenant": [], "separate tenants": []}
        batches = {}
        for _ in range(args.rounds):  # interleaved, so that load changes hit both alike
            for label, samplers in (("one tenant", one), ("separate tenants", many)):
                seconds, sizes = await _round(service, samplers, body)
                times[label].append(seconds)
                batches[label] = sizes
        one_s, many_s = statistics.median(times["one tenant"]), statistics.median(times["separate tenants"])
        return {"tenants": args.tenants, "median_seconds": {"one tenant": one_s, "separate tenants": many_s},
                "batch_requests_seen": batches, "throughput_ratio": one_s / many_s}
    finally:
        service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", help="a model folder (default: a tiny random model)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = asyncio.run(main_async(args))
    print(f"{out['tenants']} requests at once: one tenant {out['median_seconds']['one tenant']:.3f} s "
          f"(batch_requests {out['batch_requests_seen']['one tenant'][0]:.0f}), separate tenants "
          f"{out['median_seconds']['separate tenants']:.3f} s (batch_requests "
          f"{out['batch_requests_seen']['separate tenants'][0]:.0f}); throughput of separate tenants = "
          f"{out['throughput_ratio']:.2f}x one tenant's")


if __name__ == "__main__":
    main()

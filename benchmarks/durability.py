"""What ``--durability full`` costs: the time of a GRPO-shaped step (a sampler snapshot, seeded group samples, one
forward_backward, one optim_step) through our SDK against a worker in this process with ``full`` and with
``checkpoint-only``, steps interleaved so load changes hit both alike; and how long a worker restarted on the
``full`` storage takes to recover (restore the run from its state file, rerun the pending forward_backward).

    python benchmarks/durability.py [--steps 6] [--model PATH] [--rank 8] [--datums 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import uvicorn

import pytrio_compat as trio
from benchmarks.common import grpo_datums, grpo_step
from server_mock.app import create_app
from server_mock.config import StorageOptions
from server_mock.service.recovery import recover
from server_mock.service.worker import WorkerService


class Worker:
    def __init__(self, model: str, storage: str, durability: str) -> None:
        self.service = WorkerService({"m": model}, storage, "cpu", torch.float32,
                                     storage_options=StorageOptions(durability=durability))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.service), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.client = trio.ServiceClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}")

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", help="a model folder (default: a tiny random model)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--datums", type=int, default=16)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model
    if model is None:
        from server_mock.engine.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    storages = {mode: tempfile.mkdtemp() for mode in ("full", "checkpoint-only")}
    workers = {mode: Worker(model, storage, mode) for mode, storage in storages.items()}
    datums = grpo_datums(trio, args.datums)
    times: dict[str, list[float]] = {mode: [] for mode in workers}
    try:
        runs = {mode: w.client.create_lora_training_client("m", rank=args.rank, seed=1) for mode, w in workers.items()}
        for mode in workers:
            grpo_step(trio, runs[mode], datums, 0)  # warm up
        for index in range(1, args.steps + 1):
            for mode in workers:
                times[mode].append(grpo_step(trio, runs[mode], datums, index))
        runs["full"].forward_backward(datums, loss_fn="importance_sampling").result()  # pending at the "crash"
    finally:
        for w in workers.values():
            w.close()
    full, only = statistics.median(times["full"]), statistics.median(times["checkpoint-only"])

    async def timed_recovery() -> dict:
        service = WorkerService({"m": model}, storages["full"], "cpu", torch.float32)
        try:
            await service.models.host("m")  # the model loads at start whatever the durability; not counted
            started = time.perf_counter()
            counts = await recover(service)
            job = service.requests.new_job("barrier", dict, next(iter(service.runs._runs.values())).tenant)
            service.models.queue("m").put(job)  # behind the replayed forward_backward
            await job.done.wait()
            counts["seconds_until_replayed"] = round(time.perf_counter() - started, 3)
            return counts
        finally:
            service.stop()

    recovery = asyncio.run(timed_recovery())
    out = {"steps": args.steps, "rank": args.rank, "datums": args.datums,
           "median_step_seconds": {"full": full, "checkpoint-only": only},
           "ratio_full_over_checkpoint_only": full / only, "recovery": recovery}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

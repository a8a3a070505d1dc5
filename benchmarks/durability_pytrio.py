"""What ``--durability full`` costs a PyTRIO user: the time of a GRPO-shaped step (``benchmarks.common.grpo_step``:
weights for a sampler, seeded group samples, one forward_backward, one optim_step) through the official, unmodified
``pytrio`` SDK, against a worker process with ``full`` and one with ``checkpoint-only``. Under ``full`` an event is
acknowledged only once it is journaled (api/pytrio/actor.py), so this is the figure that pays for it. Whole SDK runs
alternate between the two workers so that load changes hit both alike; the median step of each is compared.

    python benchmarks/durability_pytrio.py [--steps 6] [--runs 3] [--model PATH] [--rank 8] [--datums 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-key"


def sdk_loop(plan_file: str, out_file: str) -> None:
    """Run in its own process, as a PyTRIO user runs a script: the steps, each timed."""
    import pytrio as trio
    from pytrio import types as T

    from benchmarks.common import grpo_datums, grpo_step

    plan = json.loads(Path(plan_file).read_text())
    datums = grpo_datums(T, plan["datums"])
    tc = trio.ServiceClient().create_lora_training_client("m", rank=plan["rank"], seed=1)
    times = [grpo_step(T, tc, datums, index) for index in range(plan["steps"] + 1)]  # the first one warms up
    Path(out_file).write_text(json.dumps(times[1:]))


def start_worker(model: str, storage: Path, durability: str) -> tuple[subprocess.Popen, str]:
    port_file = storage.parent / f"{durability}.port"
    cmd = [sys.executable, "-m", "server_mock", "serve", "--model", f"m={model}", "--port", "0", "--port-file",
           str(port_file), "--storage", str(storage), "--threads", "1", "--log-level", "WARNING", "--durability",
           durability, "--api-key", KEY]
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (port_file.exists() and port_file.read_text().strip()):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {durability} worker did not start")
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{port_file.read_text().strip()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per SDK run")
    parser.add_argument("--runs", type=int, default=3, help="SDK runs per worker, alternating")
    parser.add_argument("--model", help="a model folder (default: a tiny random model)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--datums", type=int, default=16)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--sdk-loop", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sdk_loop:
        sdk_loop(*args.sdk_loop)
        return
    from tqdm import tqdm

    work = Path(tempfile.mkdtemp())
    model = args.model
    if model is None:
        from server_mock.engine.tiny_model import make_tiny_model

        model = str(make_tiny_model(work / "tiny"))
    workers = {mode: start_worker(model, work / mode / "storage", mode) for mode in ("full", "checkpoint-only")}
    plan = work / "plan.json"
    plan.write_text(json.dumps({"steps": args.steps, "rank": args.rank, "datums": args.datums}))
    times: dict[str, list[float]] = {mode: [] for mode in workers}
    try:
        for run in tqdm(range(args.runs * len(workers)), desc="SDK runs"):
            mode = list(workers)[run % len(workers)]
            out = work / f"times-{run}.json"
            env = {**os.environ, "PYTRIO_BASE_URL": workers[mode][1], "PYTRIO_API_KEY": KEY, "HOME": str(work)}
            subprocess.run([sys.executable, __file__, "--sdk-loop", str(plan), str(out)], env=env, check=True,
                           cwd=work)
            times[mode] += json.loads(out.read_text())
    finally:
        for process, _ in workers.values():
            process.terminate()
            process.wait(timeout=30)
    full, only = statistics.median(times["full"]), statistics.median(times["checkpoint-only"])
    result = {"steps_per_run": args.steps, "runs": args.runs, "rank": args.rank, "datums": args.datums,
              "model": "tiny" if args.model is None else Path(args.model).name,
              "median_step_seconds": {"full": full, "checkpoint-only": only},
              "ratio_full_over_checkpoint_only": full / only}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

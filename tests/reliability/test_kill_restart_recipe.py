"""kill -9 under the async GRPO recipe itself: ``recipes/02-demo-async.py``, unmodified, in its own process as a user
runs it (``python recipes/02-demo-async.py --base-url ...``), against a worker serving the tiny random model that is
killed (at a crash point, or from outside after a seeded random delay) and started again on the same storage. The
recipe must exit 0 and end with the final sampler weights, the run's durable state (weights and AdamW moments) and
the per-step metrics of a run that was never interrupted, bit for bit.

The tiny model never writes a ``\\boxed{}`` answer, so every reward is 0 and the reward-weighted loss is 0; the run
trains through the recipe's KL term instead (``--kl-coef`` with the ``k1`` estimator, whose gradient is not 0 where
the policy equals the base model), so every step changes the weights and the next step samples from them.

The recipe is on-policy: each step awaits its ``forward_backward`` and ``optim_step`` before the next step's sampler
snapshot, and its concurrent ``sample_async`` calls carry one seed per prompt, so nothing it sends depends on timing.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import REPO, WorkerProcess

from server_mock.service.journal import Journal
from server_mock.storage.checkpoints import CheckpointStore, parse_path

from .kill_helpers import Supervised

RECIPE = REPO / "recipes" / "02-demo-async.py"
# 4 steps of 3 prompts x 4 samples (3 concurrent sample requests a step), greedy evaluation of 2 problems at steps
# 0 and 2 and at the end: 4 + 3 sampler snapshots, 12 + 6 sample requests, 4 forward_backward, 4 optim_step, 1 save
ARGS = ["--base-model", "tiny", "--dataset", "arithmetic", "--steps", "4", "--batch-size", "3", "--group-size", "4",
        "--max-tokens", "8", "--lora-rank", "4", "--learning-rate", "1e-2", "--kl-coef", "0.5",
        "--kl-estimator", "k1", "--seed", "3", "--eval-every", "2", "--eval-size", "2"]
FINAL = re.compile(r"^final sampler weights: (trio://\S+)$", re.M)
RECIPE_TIMEOUT = 240  # seconds: a hung recipe fails the test with its output instead of hanging it


def run_recipe(base_url: str, root: Path) -> tuple[subprocess.CompletedProcess, float]:
    """The recipe in its own process against ``base_url``; its completed process and wall time."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTRIO_BASE_URL", "PYTRIO_API_KEY")}
    env["PYTRIO_COMPAT_CACHE"] = str(root / "client-cache")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(RECIPE), "--base-url", base_url, "--log-dir", str(root / "log"), *ARGS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=RECIPE_TIMEOUT)
    return proc, time.monotonic() - started


def outcome(storage: Path, root: Path, proc: subprocess.CompletedProcess, context: str = "") -> dict:
    """What the run ended with: the final sampler checkpoint's tensors, the run's newest durable state (weights,
    AdamW moments and step counts, as raw bytes), and the per-step metrics without the timings."""
    assert proc.returncode == 0, (f"{context}: the recipe exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-6000:]}")
    paths = FINAL.findall(proc.stdout)
    assert len(paths) == 1, proc.stdout[-3000:]
    ref = parse_path(paths[0])
    adapter = CheckpointStore(storage).read_tensors(ref, "adapter_model.safetensors")
    journal = Journal(storage, result_ttl=3600)
    try:
        (row,) = [row for row in journal.runs() if row.run_id == ref.run_id]
        seq, state = journal.read_state(row)
    finally:
        journal.close()
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "worker/"))}
               for line in (root / "log" / "metrics.jsonl").read_text().splitlines()]
    return {"final": {name: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for name, t in adapter.items()},
            "state": {f"{part}:{name}": array.tobytes() for part in ("weights", "optimizer")
                      for name, array in state[part].items()},
            "state_seq": seq, "optim_steps": int(state["optimizer"]["optim_steps"][0]), "metrics": metrics}


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe-uninterrupted")
    worker = WorkerProcess(tiny_model_dir, root / "storage").start()
    try:
        proc, seconds = run_recipe(worker.base_url, root)
    finally:
        worker.stop()
    result = outcome(root / "storage", root, proc)
    result["seconds"] = seconds
    return result


def run_killed(tiny_model_dir, root: Path, context: str, crash_at: str = "", kill_after: float | None = None):
    """The recipe against a ``Supervised`` worker killed at ``crash_at`` or ``kill_after`` seconds after the recipe
    process starts; its outcome, the number of restarts, and ``context`` with the recovery times and wall time."""
    supervised = Supervised(tiny_model_dir, root / "storage", crash_at=crash_at)
    try:
        if kill_after is not None:
            supervised.kill_after(kill_after)
        proc, seconds = run_recipe(supervised.base_url, root)
    finally:
        supervised.stop()
    context = (f"{context}; restarts {supervised.restarts}, worker back in "
               f"{[round(s, 2) for s in supervised.recovery_seconds]} s, recipe took {seconds:.1f} s")
    print(context)
    return outcome(root / "storage", root, proc, context), supervised.restarts, context


def assert_same_run(result: dict, expected: dict, context: str) -> None:
    assert result["metrics"] == expected["metrics"], context
    assert result["final"].keys() == expected["final"].keys(), context
    assert result["final"] == expected["final"], context
    assert result["state"].keys() == expected["state"].keys(), context
    assert result["state"] == expected["state"], context
    # (the run's ``version``, a counter of weight changes that signed download URLs name, is left out: a restore
    # bumps it on purpose, service/runs.py)
    assert result["state_seq"] == expected["state_seq"], context


def test_uninterrupted_run_trains_every_step(uninterrupted):
    # the comparison means something only if the run trains: every step has datums and a gradient, the weights
    # move (the final adapter is not the initial one: lora_B starts at 0), Adam took one step a step
    metrics = uninterrupted["metrics"]
    assert [row["step"] for row in metrics] == [0, 1, 2, 3, 4]
    assert all(row["datums"] == 12 and row["optim/grad_norm"] > 0 for row in metrics[:4])
    assert uninterrupted["optim_steps"] == 4
    assert any(name.startswith("weights:") and "lora_B" in name and any(uninterrupted["state"][name])
               for name in uninterrupted["state"])


@pytest.mark.timeout(300)
def test_recipe_survives_kill_during_forward_backward(uninterrupted, tiny_model_dir, tmp_path):
    # the 2nd forward_backward, its gradients accumulated and nothing answered; the recipe sends its optim_step
    # right behind it, so the restarted worker runs both again in seq_id order
    crash_at = "forward_backward:2"
    result, restarts, context = run_killed(tiny_model_dir, tmp_path, crash_at, crash_at=crash_at)
    assert restarts == 1, context
    assert_same_run(result, uninterrupted, context)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash_at", ["forward_backward:1", "forward_backward:4", "optim_step:1", "optim_step:3",
                                      "sample:1", "sample:8", "sample:17", "save_weights:1", "state_write:2",
                                      "state_write:4"])
def test_recipe_survives_kill_at_each_point(crash_at, uninterrupted, tiny_model_dir, tmp_path):
    result, restarts, context = run_killed(tiny_model_dir, tmp_path, crash_at, crash_at=crash_at)
    assert restarts == 1, context
    assert_same_run(result, uninterrupted, context)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(8))
def test_recipe_survives_kill_at_a_random_moment(seed, uninterrupted, tiny_model_dir, tmp_path):
    # SIGKILL from outside, a delay after the recipe process starts drawn from [0, 0.8 x the uninterrupted run's
    # wall time): anywhere from its imports to its final save. The restarted worker runs no crash points, so it is
    # killed once; the margin keeps the kill before the recipe's end.
    fraction = random.Random(seed).uniform(0.0, 0.8)
    delay = fraction * uninterrupted["seconds"]
    context = (f"seed {seed}: SIGKILL {delay:.2f} s after the recipe started ({fraction:.3f} of the uninterrupted "
               f"run's {uninterrupted['seconds']:.1f} s)")
    result, restarts, context = run_killed(tiny_model_dir, tmp_path, context, kill_after=delay)
    assert restarts == 1, context
    assert_same_run(result, uninterrupted, context)

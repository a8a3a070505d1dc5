"""kill -9 under the async GRPO recipe itself (``recipes/02-demo-async.py``, unmodified, in its own process as a
user runs it): the recipe run against a worker, against a supervised worker killed at a crash point or at a
moment, and what a run ended with (final sampler weights, durable state, per-step metrics), compared bit for
bit. The tests: test_kill_restart_recipe.py (the tiny model) and test_kill_restart_recipe_smollm2.py."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from support import REPO, WorkerProcess

from server_mock.service.journal import Journal
from server_mock.storage.checkpoints import CheckpointStore, parse_path

from .kill_helpers import Supervised

RECIPE = REPO / "recipes" / "02-demo-async.py"
# 4 steps of 3 prompts x 4 samples (3 concurrent sample requests a step), greedy evaluation of 2 problems at steps
# 0 and 2 and at the end: 4 + 3 sampler snapshots, 12 + 6 sample requests, 4 forward_backward, 4 optim_step, 1 save
TINY_ARGS = ["--base-model", "tiny", "--dataset", "arithmetic", "--steps", "4", "--batch-size", "3",
             "--group-size", "4", "--max-tokens", "8", "--lora-rank", "4", "--learning-rate", "1e-2",
             "--kl-coef", "0.5", "--kl-estimator", "k1", "--seed", "3", "--eval-every", "2", "--eval-size", "2"]
# the recipe's arithmetic defaults (lr 2e-4, LoRA on the output head too), smaller: 2 steps of 2 prompts x 4 samples;
# seed 0's groups are mixed (rewards 0.5 and 0.25 on SmolLM2-135M-Instruct), so both steps train on advantages
SMOL_ARGS = ["--base-model", "smol", "--dataset", "arithmetic", "--steps", "2", "--batch-size", "2",
             "--group-size", "4", "--max-tokens", "24", "--lora-rank", "4", "--seed", "0", "--eval-every", "0"]
FINAL = re.compile(r"^final sampler weights: (trio://\S+)$", re.M)
STARTS = " steps, logging to "  # the recipe prints this line just before it creates its service client
RECIPE_TIMEOUT = 240  # seconds: a hung recipe fails the test with its output instead of hanging it


@dataclass
class Recipe:
    """A finished recipe process: exit status, output, wall time, and when (seconds after its start) it printed
    the line before its first call to the worker and the line after its last one (the final save)."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    first_call: float | None
    last_call: float | None


def run_recipe(base_url: str, root: Path, args: list[str], on_first_call: Callable[[], None] | None = None) -> Recipe:
    """The recipe in its own process against ``base_url``, as a user starts it; ``on_first_call`` runs when it
    reaches the line before its first call to the worker."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTRIO_BASE_URL", "PYTRIO_API_KEY")}
    env |= {"PYTRIO_COMPAT_CACHE": str(root / "client-cache"), "PYTHONUNBUFFERED": "1"}  # lines as printed
    cmd = [sys.executable, str(RECIPE), "--base-url", base_url, "--log-dir", str(root / "log"), *args]
    lines, first_call, last_call = [], None, None
    with open(root / "recipe.stderr", "w+") as stderr:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        timer = threading.Timer(RECIPE_TIMEOUT, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                lines.append(line)
                if first_call is None and STARTS in line:
                    first_call = time.monotonic() - started
                    if on_first_call is not None:
                        on_first_call()
                if FINAL.match(line):
                    last_call = time.monotonic() - started
            returncode = proc.wait()
        finally:
            timer.cancel()
        seconds = time.monotonic() - started
        stderr.seek(0)
        return Recipe(returncode, "".join(lines), stderr.read(), seconds, first_call, last_call)


def outcome(storage: Path, root: Path, proc: Recipe, context: str = "") -> dict:
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


@dataclass(frozen=True)
class Setup:
    """The model a worker serves (folder, name) and the recipe's command line."""

    model_dir: Path
    model_name: str
    args: list[str]


def run_uninterrupted(setup: Setup, root: Path) -> dict:
    worker = WorkerProcess(setup.model_dir, root / "storage", model_name=setup.model_name).start()
    try:
        proc = run_recipe(worker.base_url, root, setup.args)
    finally:
        worker.stop()
    result = outcome(root / "storage", root, proc, "uninterrupted")
    result["recipe"] = proc
    return result


def run_killed(setup: Setup, root: Path, context: str, crash_at: str = "", kill_after: float | None = None):
    """The recipe against a ``Supervised`` worker killed at ``crash_at`` or ``kill_after`` seconds after the recipe
    reaches its first call to the worker; its outcome, the number of restarts, and ``context`` with the recovery
    times and the recipe's timings."""
    supervised = Supervised(setup.model_dir, root / "storage", crash_at=crash_at, model_name=setup.model_name)
    try:
        proc = run_recipe(supervised.base_url, root, setup.args,
                          None if kill_after is None else lambda: supervised.kill_after(kill_after))
    finally:
        supervised.stop()
    context = (f"{context}; restarts {supervised.restarts}, worker back in "
               f"{[round(s, 2) for s in supervised.recovery_seconds]} s, recipe took {proc.seconds:.1f} s "
               f"(calls from {proc.first_call or float('nan'):.1f} s to {proc.last_call or float('nan'):.1f} s)")
    if kill_after is not None and proc.first_call is not None and proc.last_call is not None:
        landed = proc.first_call + kill_after
        when = "before" if landed < proc.last_call else "after"
        context += f", killed at {landed:.1f} s: {when} the final save returned"
    print(context)
    return outcome(root / "storage", root, proc, context), supervised.restarts, context


def random_kill(seed: int, expected: dict) -> tuple[float, str]:
    """A SIGKILL delay after the recipe's first call to the worker, drawn with ``seed`` from the first 80% of the
    span of its calls in the uninterrupted run (first call to final save: a killed run's span before the kill varies
    by about 20% on a shared machine), and the words that name it."""
    recipe = expected["recipe"]
    span = recipe.last_call - recipe.first_call
    fraction = random.Random(seed).uniform(0.0, 0.8)
    return fraction * span, (f"seed {seed}: SIGKILL {fraction * span:.2f} s after the recipe's first call "
                             f"({fraction:.3f} of the uninterrupted run's {span:.2f} s of calls)")


def assert_same_run(result: dict, expected: dict, context: str) -> None:
    assert result["metrics"] == expected["metrics"], context
    assert result["final"].keys() == expected["final"].keys(), context
    assert result["final"] == expected["final"], context
    assert result["state"].keys() == expected["state"].keys(), context
    assert result["state"] == expected["state"], context
    # (the run's ``version``, a counter of weight changes that signed download URLs name, is left out: a restore
    # bumps it on purpose, service/restore.py)
    assert result["state_seq"] == expected["state_seq"], context

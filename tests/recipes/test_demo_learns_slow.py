"""The README's main job really learns: GRPO on SmolLM2-135M-Instruct raises held-out greedy accuracy.

Slow (4.3 minutes measured on 2 idle CPU cores): run with `-m slow`. Uses the embedded worker,
as the demo does.
"""

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


def test_arithmetic_demo_raises_heldout_accuracy(load_demo, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "recipes"))
    monkeypatch.delenv("PYTRIO_BASE_URL", raising=False)
    demo = load_demo("02-demo-async.py")
    # what scripts/demo.sh runs: the recipe's defaults for --dataset arithmetic (200 held-out problems, evaluated
    # at the start and the end), each step's samples drawn while the step before trains
    summary = demo.main(["--dataset", "arithmetic", "--max-steps-off-policy", "1", "--seed", "0",
                         "--log-dir", str(tmp_path / "run")])
    assert summary["history"][-1]["step"] == 20
    history = summary["history"]
    accuracy = [row["eval/accuracy"] for row in history if "eval/accuracy" in row]
    rewards = [row["reward"] for row in history if "reward" in row]
    before, after = accuracy[0], accuracy[-1]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"held-out greedy accuracy: {before:.2f} -> {after:.2f}; sampled reward {early:.2f} -> {late:.2f}")
    # Measured on 200 held-out problems (docs/benchmarks.md): seeds 0, 1, 2 gained +0.265, +0.25, +0.305
    # (mean +0.273 +- 0.028); seed 0's sampled reward went 0.24 -> 0.57. A machine whose float rounding differs
    # draws other samples, so its run is a fresh draw; one 200-problem before/after difference has a standard
    # error of about 0.05, and +0.12 sits about 2.5 of them below the smallest seed's gain. The sampled reward
    # (32 samples a step) is no test of learning for one run: seed 1's went 0.49 -> 0.43 while its held-out
    # accuracy rose by 0.25, so it is printed, not asserted.
    # One step off-policy with bf16 autocast training (what the demo runs now): seeds 0, 1, 2 gained +0.275, +0.31,
    # +0.275 (float32 training: +0.32, +0.325, +0.275).
    assert after - before >= 0.12, accuracy
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0

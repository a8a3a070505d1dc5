"""The README's main job really learns: GRPO on SmolLM2-135M-Instruct raises held-out greedy accuracy.

Slow (about 12 minutes on 2 idle CPU cores): run with `-m slow`. Uses the embedded worker, as the demo does.
"""

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


def test_arithmetic_demo_raises_heldout_accuracy(load_demo, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "recipes"))
    monkeypatch.delenv("PYTRIO_BASE_URL", raising=False)
    demo = load_demo("02-demo-async.py")
    # what scripts/demo.sh runs: the recipe's defaults for --dataset arithmetic (200 held-out problems),
    # evaluated at the start and the end only
    summary = demo.main(["--dataset", "arithmetic", "--eval-every", "20", "--seed", "0",
                         "--log-dir", str(tmp_path / "run")])
    assert summary["history"][-1]["step"] == 20
    history = summary["history"]
    accuracy = [row["eval/accuracy"] for row in history if "eval/accuracy" in row]
    rewards = [row["reward"] for row in history if "reward" in row]
    before, after = accuracy[0], accuracy[-1]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"held-out greedy accuracy: {before:.2f} -> {after:.2f}; sampled reward {early:.2f} -> {late:.2f}")
    # Measured (seed 0): reward 0.24 -> 0.57 and accuracy 0.52 -> 0.60 on the earlier 50-problem set; on the
    # 200-problem set seed 0 went 0.43 -> 0.695 (+0.265) and reward 0.24 -> 0.57 (docs/benchmarks.md). The
    # accuracy margin leaves about three standard errors (0.05) of a 200-problem difference below that.
    assert late - early >= 0.15, rewards
    assert after - before >= 0.12, accuracy
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0

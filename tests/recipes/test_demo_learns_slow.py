"""The README's main job really learns: GRPO on SmolLM2-135M-Instruct raises held-out greedy accuracy.

Slow (about 10 minutes on 2 CPU cores): run with `-m slow`. Uses the embedded worker, as the demo does.
"""

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


def test_arithmetic_demo_raises_heldout_accuracy(load_demo, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "recipes"))
    monkeypatch.delenv("PYTRIO_BASE_URL", raising=False)
    demo = load_demo("02-demo-async.py")
    summary = demo.main([
        "--base-model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--dataset", "arithmetic", "--steps", "20",
        "--batch-size", "4", "--group-size", "8", "--max-tokens", "40", "--learning-rate", "2e-4",
        "--lora-rank", "16", "--eval-every", "20", "--eval-size", "50", "--seed", "0",
        "--log-dir", str(tmp_path / "run"),
    ])
    history = summary["history"]
    accuracy = [row["eval/accuracy"] for row in history if "eval/accuracy" in row]
    rewards = [row["reward"] for row in history if "reward" in row]
    before, after = accuracy[0], accuracy[-1]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"held-out greedy accuracy: {before:.2f} -> {after:.2f}; sampled reward {early:.2f} -> {late:.2f}")
    # Measured on 2 CPU cores with this configuration: accuracy 0.52 -> 0.60, reward 0.24 -> 0.57.
    assert late - early >= 0.15, rewards
    assert after - before >= 0.05, accuracy
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0

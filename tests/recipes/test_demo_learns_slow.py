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
    accuracy = [row["eval/accuracy"] for row in summary["history"] if "eval/accuracy" in row]
    before, after = accuracy[0], accuracy[-1]
    print(f"held-out greedy accuracy: {before:.2f} -> {after:.2f}")
    assert after - before >= 0.15, accuracy
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0

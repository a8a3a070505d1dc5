"""Both demos against a real worker serving the tiny random model (the `worker` fixture of tests/conftest.py).

The tiny model never answers an addition right, so the demo's reward is replaced by one that alternates
1, 0, 1, 0 within each group: every group is mixed and every step trains, which exercises the whole path
(sampler snapshot, sampling, datums, forward_backward / forward_backward_custom, optim_step, final save)."""

import json
import math
from pathlib import Path

import pytest

FIXTURE = str(Path(__file__).resolve().parent / "fixtures" / "gsm8k_tiny.jsonl")


@pytest.mark.parametrize(
    "script, loss_fn, data",
    [("01-demo-sync.py", "importance_sampling", ["--dataset", "arithmetic"]),
     ("02-demo-async.py", "ppo", ["--dataset", "arithmetic"]),
     ("02-demo-async.py", "cispo", ["--dataset", "arithmetic"]),
     ("01-demo-sync.py", "cispo", ["--dataset", "arithmetic", "--custom-cispo"]),
     ("01-demo-sync.py", "importance_sampling", ["--dataset", "gsm8k", "--data-file", FIXTURE, "--test-file", FIXTURE]),
     ("02-demo-async.py", "importance_sampling", ["--dataset", "gsm8k", "--data-file", FIXTURE,
                                                 "--test-file", FIXTURE])],
)
def test_demo_trains_against_worker(script, loss_fn, data, demo_on_worker, tmp_path):
    summary, calls = demo_on_worker(script, *data, "--steps", "2", "--learning-rate", "1e-3", "--loss-fn", loss_fn,
                                    "--eval-every", "2", "--eval-size", "2")

    history = summary["history"]
    assert [row["step"] for row in history] == [0, 1, 2]
    assert len(calls) == 2 * 2 * 4
    for row in history[:2]:
        assert row["datums"] == 8 and row["frac_degenerate"] == 0.0 and row["reward"] == 0.5
        assert row["train_tokens"] > 0 and math.isfinite(row["loss_mean"])
        # sampler and trainer compute the same policy: their logprobs agree on the sampled tokens
        assert abs(row["kl_sample_train"]) < 1e-3
        if loss_fn == "cispo":
            assert 0.0 <= row["cispo/clip_fraction"] <= 1.0
    assert "eval/accuracy" in history[0] and "eval/accuracy" in history[2]
    assert summary["final_path"].startswith("trio://")
    assert [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == history
    datum = summary["first_step_datums"][0]
    n = len(datum.model_input.to_ints())
    assert all(len(t.data) == n for t in datum.loss_fn_inputs.values())

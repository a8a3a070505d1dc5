"""MetricsLogger: config.json, metrics.jsonl, console line, SwanLab files, curves.png; and the log-dir default."""

import json
from pathlib import Path

import pytest

from recipes.grpo_lib import REWARD_WINDOW, MetricsLogger, curve_lines, moving_average, plot_curves, resolve_log_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

STEPS = [
    {"reward": 0.25, "frac_degenerate": 0.5, "datums": 8.0, "train_tokens": 120.0, "loss_mean": -0.01,
     "kl_sample_train": 0.002, "time/step": 1.5, "eval/accuracy": 0.3},
    {"reward": 0.5, "frac_degenerate": 0.25, "datums": 12.0, "train_tokens": 200.0, "loss_mean": -0.02,
     "kl_sample_train": -0.001, "time/step": 1.4},
    {"reward": 0.0, "frac_degenerate": 1.0, "datums": 0.0, "train_tokens": 0.0, "time/step": 0.9},
]


def test_metrics_rows_config_and_plot(tmp_path, capsys):
    config = {"base_model": "tiny", "seed": 3, "learning_rate": 4e-5, "log_dir": tmp_path}
    logger = MetricsLogger(tmp_path / "run", config)
    for step, metrics in enumerate(STEPS):
        logger.log(metrics, step=step)
    curves = logger.close()

    saved_config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved_config == {**config, "log_dir": str(tmp_path)}  # non-JSON values stored as text

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert rows == [{"step": i, **m} for i, m in enumerate(STEPS)]
    assert logger.history == rows

    out = capsys.readouterr().out.splitlines()
    summary = [line for line in out if line.startswith("step")]
    assert len(summary) == 3
    assert "reward 0.250" in summary[0] and "eval_acc 0.300" in summary[0] and "loss_mean -0.0100" in summary[0]
    assert "loss_mean" not in summary[2] and "datums 0" in summary[2]

    assert curves == tmp_path / "run" / "curves.png"
    data = curves.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_metrics_file_restarts_for_a_new_logger(tmp_path):
    first = MetricsLogger(tmp_path, {})
    first.log({"reward": 1.0}, step=0)
    first.close()
    second = MetricsLogger(tmp_path, {})
    second.log({"reward": 0.5}, step=0)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "reward": 0.5}]
    second.close()


def test_plot_without_any_data_still_writes_png(tmp_path):
    path = plot_curves([], tmp_path / "empty.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_logger_is_a_context_manager(tmp_path):
    with MetricsLogger(tmp_path, {"a": 1}) as logger:
        logger.log({"reward": 0.1}, step=0)
    assert (tmp_path / "curves.png").exists()


def test_invalid_swanlab_mode(tmp_path):
    with pytest.raises(ValueError, match="swanlab_mode"):
        MetricsLogger(tmp_path, {}, swanlab_mode="cloud")


@pytest.mark.parametrize("mode", ["local", "offline"])
def test_swanlab_writes_its_run_folder(tmp_path, mode, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything swanlab drops into the working directory stays in tmp
    logger = MetricsLogger(tmp_path / "run", {"seed": 0}, swanlab_mode=mode, swanlab_project="test-recipes")
    logger.log({"reward": 0.5, "loss_mean": 0.1}, step=0)
    logger.log({"reward": 0.75}, step=1)
    logger.close()
    swanlog = tmp_path / "run" / "swanlog"
    runs = [p for p in swanlog.iterdir() if p.is_dir() and p.name.startswith("run-")]
    assert len(runs) == 1
    assert list(runs[0].glob("*.swanlab")), f"no .swanlab record in {runs[0]}"
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2


def test_resolve_log_dir(tmp_path, monkeypatch):
    assert resolve_log_dir(str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.chdir(tmp_path)
    first = resolve_log_dir(None)
    assert first.parent == Path("runs") and first.name[:8].isdigit()
    first.mkdir(parents=True)
    second = resolve_log_dir(None)
    assert second != first and not second.exists()


def test_moving_average_matches_numpy():
    import numpy as np

    values = list(np.random.default_rng(0).uniform(0, 1, 23))
    for window in (1, 3, 5, 30):
        expected = [np.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
        assert moving_average(values, window) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="window"):
        moving_average(values, 0)


def test_reward_panel_draws_raw_values_and_their_moving_average():
    history = [{"step": i, "reward": r} for i, r in enumerate([0.0, 1.0, 0.5, 0.25, 0.75, 1.0, 0.0])]
    history.append({"step": 7, "eval/accuracy": 0.4})
    panels = curve_lines(history)
    (raw_label, xs, raw), (avg_label, xs2, avg) = panels["reward"]
    assert xs == xs2 == list(range(7)) and raw == [row["reward"] for row in history[:7]]
    assert avg == pytest.approx([sum(raw[max(0, i - REWARD_WINDOW + 1):i + 1]) / min(i + 1, REWARD_WINDOW)
                                 for i in range(7)])
    assert "moving average" in avg_label and raw_label == "per step"
    assert panels["eval/accuracy"] == [("per step", [7], [0.4])] and panels["loss_mean"] == []

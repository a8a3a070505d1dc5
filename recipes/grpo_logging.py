"""Step metrics and logging: metrics.jsonl, console lines, SwanLab, curves.png."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import statistics

from grpo_datums import (
    count_train_tokens,
    is_degenerate,
    kl_sample_train,
    logprob_gap_max,
    ppo_clip_fraction,
    ratio_clip_fraction,
)
from grpo_options import SWANLAB_MODES

import pytrio_compat as trio


class StepStats:
    """Collects what one GRPO step produced and turns it into the logged metrics."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.rewards: list[float] = []
        self.gen_lens: list[int] = []
        self.n_truncated = 0
        self.n_groups = 0
        self.n_degenerate = 0
        self.group_stds: list[float] = []
        self.scores: list[Any] = []  # countdown: each completion's CountdownScore (format_ok, correct)
        self.times: dict[str, float] = {}

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Adds the time spent in the block to `name` (e.g. "time/sample")."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def add_group(self, rewards: Sequence[float], sequences: Sequence[Any],
                  worker_metrics: dict[str, float] | None = None, scores: Sequence[Any] | None = None) -> None:
        """Record one prompt's rewards, its sampled sequences (`tokens`, `stop_reason`) and the worker's
        timings for the request (a batch's time is shared by the requests decoded in it); `scores`: the reward's
        parts per completion (objects with `format_ok` and `correct`)."""
        metrics = worker_metrics or {}
        share = 1.0 / max(1.0, float(metrics.get("batch_requests", 1.0)))
        for key, name in (("time/queue", "worker/queue"), ("time/prefill", "worker/prefill"),
                          ("time/decode", "worker/decode")):
            if key in metrics:
                self.times[name] = self.times.get(name, 0.0) + float(metrics[key]) * share
        self.rewards.extend(float(r) for r in rewards)
        self.gen_lens.extend(len(s.tokens) for s in sequences)
        self.n_truncated += sum(1 for s in sequences if getattr(s, "stop_reason", None) == "length")
        self.n_groups += 1
        self.n_degenerate += int(is_degenerate(rewards))
        self.group_stds.append(statistics.stdev(rewards) if len(rewards) > 1 else 0.0)
        self.scores.extend(scores or [])

    def metrics(
        self, datums: Sequence[trio.Datum], fb_output: Any = None, optim_output: Any = None,
        cispo_bounds: tuple[float, float] | None = None, ppo_bounds: tuple[float, float] | None = None,
    ) -> dict[str, float]:
        """reward, reward/std (mean of the groups' sample std), frac_degenerate (= frac_reward_zero_std),
        rollout/*, datums, train_tokens, loss_mean, kl_sample_train and logprob_gap/max (sampler vs trainer),
        time/*; with the worker's kl / entropy means `kl` / `entropy`; with countdown scores reward/format and
        reward/correct; with `cispo_bounds` cispo/clip_fraction (computed here when the loss did not report it)
        and clip_frac; with `ppo_bounds` clip_frac (where ppo's clip binds)."""
        n = len(self.gen_lens)
        frac_zero_std = self.n_degenerate / self.n_groups if self.n_groups else 0.0
        out: dict[str, float] = {
            "reward": sum(self.rewards) / len(self.rewards) if self.rewards else 0.0,
            "reward/std": sum(self.group_stds) / len(self.group_stds) if self.group_stds else 0.0,
            "frac_degenerate": frac_zero_std,
            "frac_reward_zero_std": frac_zero_std,
            "rollout/avg_gen_len": sum(self.gen_lens) / n if n else 0.0,
            "rollout/max_gen_len": float(max(self.gen_lens)) if n else 0.0,
            "rollout/frac_truncated": self.n_truncated / n if n else 0.0,
            "datums": float(len(datums)),
            "train_tokens": float(count_train_tokens(datums)),
        }
        if self.scores:
            out["reward/format"] = sum(float(s.format_ok) for s in self.scores) / len(self.scores)
            out["reward/correct"] = sum(float(s.correct) for s in self.scores) / len(self.scores)
        if fb_output is not None:
            fb_metrics = dict(getattr(fb_output, "metrics", {}) or {})
            if "loss_mean" in fb_metrics:
                out["loss_mean"] = float(fb_metrics["loss_mean"])
            out.update({k: float(v) for k, v in fb_metrics.items() if k.startswith("cispo/")})
            if cispo_bounds is not None and "cispo/clip_fraction" not in out:
                clipped = ratio_clip_fraction(datums, fb_output, *cispo_bounds)
                if clipped is not None:
                    out["cispo/clip_fraction"] = clipped
            if cispo_bounds is not None and "cispo/clip_fraction" in out:
                out["clip_frac"] = out["cispo/clip_fraction"]
            if ppo_bounds is not None:
                clipped = ppo_clip_fraction(datums, fb_output, *ppo_bounds)
                if clipped is not None:
                    out["clip_frac"] = clipped
            kl = kl_sample_train(datums, fb_output)
            if kl is not None:
                out["kl_sample_train"] = kl
            gap = logprob_gap_max(datums, fb_output)
            if gap is not None:
                out["logprob_gap/max"] = gap
            for key, name in (("kl_mean", "kl"), ("kl_sum", "kl/sum"), ("entropy_mean", "entropy")):
                if key in fb_metrics:
                    out[name] = float(fb_metrics[key])
        for output, name in ((fb_output, "worker/forward_backward"), (optim_output, "worker/optim")):
            worker = dict(getattr(output, "metrics", {}) or {}) if output is not None else {}
            if "time/run" in worker:
                self.times[name] = float(worker["time/run"])
                if output is fb_output:  # optim_step queues behind its own forward_backward: not a wait
                    queued = float(worker.get("time/queue", 0))
                    self.times["worker/queue"] = self.times.get("worker/queue", 0.0) + queued
        if optim_output is not None:
            for key in ("grad_norm", "optim/grad_norm", "gradient_norm"):
                value = (getattr(optim_output, "metrics", {}) or {}).get(key)
                if value is not None:
                    out["optim/grad_norm"] = float(value)
                    break
        for key in ("time/sync", "time/sample", "time/train"):
            out[key] = self.times.get(key, 0.0)
        out.update({k: v for k, v in self.times.items() if k not in out})
        out["time/step"] = time.perf_counter() - self.started
        worker_busy = sum(v for k, v in self.times.items() if k.startswith("worker/") and k != "worker/queue")
        if worker_busy:
            # what the worker did not account for: HTTP, encoding, polling and this script's own work
            out["time/client_and_transport"] = max(0.0, out["time/step"] - worker_busy
                                                   - self.times.get("worker/queue", 0.0) - out["time/sync"])
        return out


_SUMMARY_KEYS = (
    ("reward", "reward {:.3f}"), ("frac_degenerate", "degenerate {:.0%}"), ("datums", "datums {:.0f}"),
    ("train_tokens", "train_tokens {:.0f}"), ("rollout/avg_gen_len", "gen_len {:.1f}"),
    ("loss_mean", "loss_mean {:.4f}"), ("kl_sample_train", "kl {:+.2e}"), ("kl", "kl_ref {:.2e}"),
    ("entropy", "entropy {:.3f}"), ("eval/accuracy", "eval_acc {:.3f}"),
    ("time/step", "{:.1f}s"),
)
PLOTTED = ("reward", "loss_mean", "kl_sample_train", "eval/accuracy")


def _swanlab_has_dashboard() -> bool:
    try:
        import swanboard  # noqa: F401
    except ImportError:
        return False
    return True


class MetricsLogger:
    """Writes `config.json`, appends one `metrics.jsonl` row per `log()`, prints a one-line summary,
    mirrors the metrics to SwanLab (unless disabled) and draws `curves.png` on `close()`."""

    def __init__(
        self,
        log_dir: str | os.PathLike,
        config: dict,
        swanlab_mode: str = "disabled",
        swanlab_project: str = "pytrio-compat-grpo",
        run_name: str | None = None,
    ) -> None:
        if swanlab_mode not in SWANLAB_MODES:
            raise ValueError(f"swanlab_mode must be one of {SWANLAB_MODES}, got {swanlab_mode!r}")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.history: list[dict[str, float]] = []
        self.metrics_path = self.log_dir / "metrics.jsonl"
        self.metrics_path.write_text("")
        (self.log_dir / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        self._swanlab = None
        if swanlab_mode != "disabled":
            import swanlab

            mode = swanlab_mode
            if mode == "local" and not _swanlab_has_dashboard():
                # "local" only differs from "offline" in starting the swanboard dashboard hook, which is an
                # optional extra; the run files are the same.
                print("swanlab: 'swanlab[dashboard]' is not installed; writing the run in offline format "
                      f"under {self.log_dir / 'swanlog'}", file=sys.stderr)
                mode = "offline"
            self._swanlab = swanlab
            swanlab.init(project=swanlab_project, experiment_name=run_name, mode=mode,
                         logdir=str(self.log_dir / "swanlog"), config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        self.history.append(row)
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        parts = [fmt.format(metrics[key]) for key, fmt in _SUMMARY_KEYS if key in metrics]
        print(f"step {step:4d} | " + " | ".join(parts), flush=True)
        if self._swanlab is not None:
            self._swanlab.log(dict(metrics), step=step)

    def close(self) -> Path:
        """Finish SwanLab and write `curves.png`; returns its path."""
        if self._swanlab is not None:
            self._swanlab.finish()
            self._swanlab = None
        return plot_curves(self.history, self.log_dir / "curves.png")

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


REWARD_WINDOW = 5  # steps in the moving average drawn over the per-step reward


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start): one output per input."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def curve_lines(history: Sequence[dict]) -> dict[str, list[tuple[str, list[float], list[float]]]]:
    """What each panel of curves.png draws: (label, steps, values) per line. The reward, noisy from step to
    step with few prompts, gets its moving average beside the raw values."""
    panels: dict[str, list[tuple[str, list[float], list[float]]]] = {}
    for key in PLOTTED:
        points = [(row["step"], row[key]) for row in history if key in row]
        if not points:
            panels[key] = []
            continue
        xs, ys = (list(v) for v in zip(*points))
        panels[key] = [("per step", xs, ys)]
        if key == "reward":
            panels[key].append((f"moving average ({REWARD_WINDOW} steps)", xs, moving_average(ys, REWARD_WINDOW)))
    return panels


def plot_curves(history: Sequence[dict], path: str | os.PathLike) -> Path:
    """One panel per metric in PLOTTED (value vs step); the reward panel adds its moving average."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, lines) in zip(axes.flat, curve_lines(history).items()):
        for i, (label, xs, ys) in enumerate(lines):
            if i == 0 and len(lines) > 1:  # the raw values under their smoothed line
                ax.plot(xs, ys, marker="o", markersize=3, alpha=0.35, linewidth=1, label=label)
            else:
                ax.plot(xs, ys, marker="o" if len(lines) == 1 else None, markersize=3, linewidth=2, label=label)
        if not lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        elif len(lines) > 1:
            ax.legend(fontsize=8)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""GRPO variants on the CPU demo: the KL penalty to the base model and std-normalised advantages, measured.

Each arm is the async recipe (`recipes/02-demo-async.py --dataset arithmetic`, the demo's settings:
SmolLM2-135M-Instruct, 20 steps of 4 prompts x 8 samples, <= 40 new tokens, greedy accuracy on 200 held-out
additions at steps 0, 10 and 20) with a few flags added; every arm reports the exact KL to the base model
(`--kl-coef 0` measures it without adding it to the loss) and the policy's entropy (`--log-entropy`):

    baseline    --kl-coef 0                      (the demo's loss: token-sum, mean advantages)
    kl0.05      --kl-coef 0.05                   (beta = 0.05, k3)
    std         --kl-coef 0 --advantage std      ((r - mean) / (std + 1e-6))

    python benchmarks/grpo_variants.py --arms baseline kl0.05 std --seeds 0 1 2   # ~10 min per run on 2 cores
    python benchmarks/grpo_variants.py --report                                  # the plot and the table again

Each finished run's metrics.jsonl stays under --runs; the report reads whatever is there, so a sweep can be
stopped and resumed, and reports the seeds it found; every run's rows also go to
results/grpo_variants_curves.json. Error bars: the standard deviation across seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, save  # noqa: E402

ARMS: dict[str, list[str]] = {
    "baseline": ["--kl-coef", "0"],
    "kl0.05": ["--kl-coef", "0.05"],
    "std": ["--kl-coef", "0", "--advantage", "std"],
}
COMMON = ["--dataset", "arithmetic", "--log-entropy", "--swanlab-mode", "disabled"]
PANELS = (("reward", "reward (train, per step)"), ("eval/accuracy", "greedy accuracy (200 held-out)"),
          ("kl", "KL to the base model (k3, mean per token)"), ("entropy", "entropy (nats per token)"))
DEFAULT_RUNS = RESULTS / "grpo_variants_runs"


def run_arm(arm: str, seed: int, runs: Path) -> Path:
    log_dir = runs / f"{arm}-seed{seed}"
    if (log_dir / "done.json").exists():
        return log_dir
    cmd = [sys.executable, str(ROOT / "recipes" / "02-demo-async.py"), *COMMON, *ARMS[arm], "--seed", str(seed),
           "--log-dir", str(log_dir)]
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    (log_dir / "done.json").write_text(json.dumps({"seconds": time.perf_counter() - started, "cmd": cmd[1:]}))
    return log_dir


def load_runs(runs: Path) -> dict[str, dict[int, list[dict]]]:
    """arm -> seed -> metrics rows, for every finished run under `runs`."""
    out: dict[str, dict[int, list[dict]]] = {}
    for done in sorted(runs.glob("*-seed*/done.json")):
        arm, seed = done.parent.name.rsplit("-seed", 1)
        rows = [json.loads(x) for x in (done.parent / "metrics.jsonl").read_text().splitlines() if x]
        out.setdefault(arm, {})[int(seed)] = rows
    return out


def curve(rows_by_seed: dict[int, list[dict]], key: str) -> tuple[list[int], list[float], list[float]]:
    """Steps where every seed has `key`, the mean across seeds and their standard deviation (0 for one seed)."""
    per_seed = [{r["step"]: r[key] for r in rows if key in r} for rows in rows_by_seed.values()]
    steps = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    means, stds = [], []
    for step in steps:
        values = [s[step] for s in per_seed]
        means.append(statistics.fmean(values))
        stds.append(statistics.stdev(values) if len(values) > 1 else 0.0)
    return steps, means, stds


def summary(data: dict[str, dict[int, list[dict]]]) -> dict:
    """Per arm: the seeds, final accuracy, the mean reward over the last 5 steps, KL and entropy at the end."""
    out = {}
    for arm, by_seed in data.items():
        def final(key, last=1, by_seed=by_seed):
            values = []
            for rows in by_seed.values():
                points = [r[key] for r in rows if key in r]
                if points:
                    values.append(statistics.fmean(points[-last:]))
            return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                    "per_seed": values} if values else None
        out[arm] = {"seeds": sorted(by_seed), "final_eval_accuracy": final("eval/accuracy"),
                    "reward_last5": final("reward", 5), "kl_last5": final("kl", 5),
                    "entropy_last5": final("entropy", 5), "step_s": final("time/step", 20)}
    return out


def plot(data: dict[str, dict[int, list[dict]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for arm, by_seed in data.items():
            steps, means, stds = curve(by_seed, key)
            if steps:
                ax.errorbar(steps, means, yerr=stds, marker="o", markersize=3, capsize=2, linewidth=1.5,
                            label=f"{arm} ({len(by_seed)} seed{'s' if len(by_seed) > 1 else ''})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("GRPO variants, SmolLM2-135M on 2-digit addition (CPU demo); mean ± std across seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--runs", type=Path, default=DEFAULT_RUNS)
    p.add_argument("--report", action="store_true", help="only the plot and the table from the runs so far")
    args = p.parse_args()
    if not args.report:
        for seed in args.seeds:  # one seed of every arm before the next seed: a stopped sweep stays balanced
            for arm in args.arms:
                print(f"{arm} seed {seed}: {run_arm(arm, seed, args.runs)}", flush=True)
    data = load_runs(args.runs)
    (RESULTS / "grpo_variants_curves.json").write_text(json.dumps(data))  # every run's metrics rows (the runs
    # folder itself is not kept in the repository)
    path = plot(data, RESULTS / "grpo_variants.png")
    save("grpo_variants", {"arms": {a: ARMS[a] for a in data}, "common": COMMON, "summary": summary(data),
                           "plot": str(path.relative_to(ROOT))})


if __name__ == "__main__":
    main()

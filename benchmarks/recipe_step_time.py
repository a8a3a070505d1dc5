"""Step time of the sync recipe vs the async recipe on the same configuration (batch 4 x group 8).

Both run against a worker started for this process; the async recipe's concurrent sample requests are
decoded as one batch by the worker, the sync recipe's one after the other. Medians over steps 1.. (step 0
includes loading the model).

    python benchmarks/recipe_step_time.py [--steps 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))
from benchmarks.common import RESULTS, SMOLLM2, median, save  # noqa: E402


def run(script: str, args) -> list[dict]:
    spec = importlib.util.spec_from_file_location(script.replace("-", "_"), ROOT / "recipes" / script)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    summary = demo.main([
        "--base-model", args.model, "--dataset", "arithmetic", "--steps", str(args.steps), "--batch-size", "4",
        "--group-size", "8", "--max-tokens", "40", "--learning-rate", "2e-4", "--lora-rank", "16",
        "--seed", "0", "--log-dir", str(RESULTS / f"steps-{script}"),
    ])
    return summary["history"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    sync = run("01-demo-sync.py", args)
    async_ = run("02-demo-async.py", args)
    keys = sorted({k for row in sync + async_ for k in row if k.startswith(("time/", "worker/"))})

    def split(history):
        return {k: median([row.get(k, 0.0) for row in history[1:]]) for k in keys}

    result = {"sync": split(sync), "async": split(async_),
              "async_over_sync_step_time": split(async_)["time/step"] / split(sync)["time/step"],
              "async_over_sync_sample_time": split(async_)["time/sample"] / split(sync)["time/sample"]}
    save("recipe_step_time", result)
    return result


if __name__ == "__main__":
    main()

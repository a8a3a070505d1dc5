"""Step time of the sync recipe vs the async recipe on the same configuration (batch 4 x group 8), with the
worker's prefix-shared training on (its default) and off, or (``--settings full,checkpoint-only``) with its
``--durability`` full (the default) and checkpoint-only.

Each recipe runs against a worker started for this process (one per setting, so both recipes see the same
worker; each recipe runs on every setting before the next recipe starts); the async recipe's concurrent sample
requests are decoded as one batch by the worker, the sync recipe's one after the other. Medians over steps 1..
(step 0 includes loading the model).

    python benchmarks/recipe_step_time.py [--steps 4] [--settings shared,unshared] [--recipes sync,async,async-ahead]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))
from benchmarks.common import SMOLLM2, median, save  # noqa: E402

SETTINGS = {"shared": (), "unshared": ("--prefix-share-min-tokens", "0"),  # worker options per setting
            "full": ("--durability", "full"), "checkpoint-only": ("--durability", "checkpoint-only")}
# name -> (script, its extra options); "async-ahead" samples the next step while this one trains
RECIPES = {"sync": ("01-demo-sync.py", ()), "async": ("02-demo-async.py", ()),
           "async-ahead": ("02-demo-async.py", ("--max-steps-off-policy", "1"))}
DEFAULT_RECIPES = "sync,async"


def run(recipe: tuple[str, tuple[str, ...]], args, worker, tag: str) -> list[dict]:
    script, extra = recipe
    spec = importlib.util.spec_from_file_location(script.replace("-", "_"), ROOT / "recipes" / script)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    summary = demo.main([
        "--base-model", args.model, "--dataset", "arithmetic", "--steps", str(args.steps), "--batch-size", "4",
        "--group-size", "8", "--max-tokens", "40", "--learning-rate", "2e-4", "--lora-rank", "16",
        "--seed", "0", "--eval-every", "0", "--swanlab-mode", "disabled",
        "--base-url", worker.base_url, "--api-key", worker.api_key,
        "--log-dir", str(Path(args.log_root) / f"steps-{tag}-{script}-{len(extra)}"), *extra,
    ])
    return summary["history"]


def split(history: list[dict]) -> dict[str, float]:
    keys = sorted({k for row in history for k in row if k.startswith(("time/", "worker/"))})
    return {k: median([row.get(k, 0.0) for row in history[1:]]) for k in keys}


def main(argv=None) -> dict:
    from pytrio_compat.embedded import EmbeddedWorker

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--settings", default="shared,unshared", help=f"comma-separated, from {sorted(SETTINGS)}")
    parser.add_argument("--log-root", default="/tmp/recipe_step_time")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES, help=f"comma-separated, from {sorted(RECIPES)} "
                        "(with async-ahead the results go to recipe_step_time_off_policy.json)")
    args = parser.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(settings) - set(SETTINGS))
    names = [name for name in args.recipes.split(",") if name]
    if sorted(set(names) - set(RECIPES)) or "sync" not in names:
        parser.error(f"--recipes: names from {sorted(RECIPES)}, sync among them (the baseline of the ratios)")
    recipes = {name: RECIPES[name] for name in names}
    if unknown or args.steps < 2:
        parser.error(f"unknown settings {unknown}" if unknown else "--steps must be >= 2 (step 0 is not timed)")
    result: dict = {setting: {} for setting in settings}
    workers = {}
    try:  # one worker per setting, all up at once; each recipe runs on every setting in turn, so load hits alike
        for setting in settings:
            workers[setting] = EmbeddedWorker(SETTINGS[setting])
        for name, recipe in recipes.items():
            for setting in settings:
                result[setting][name] = split(run(recipe, args, workers[setting], setting))
    finally:
        for worker in workers.values():
            worker.stop()
    for setting in settings:
        one = result[setting]
        for name in recipes:
            if name != "sync":
                key = name.replace("-", "_")
                one[f"{key}_over_sync_step_time"] = one[name]["time/step"] / one["sync"]["time/step"]
                one[f"{key}_over_sync_sample_time"] = one[name]["time/sample"] / one["sync"]["time/sample"]
        print(f"{setting}: " + ", ".join(f"{name} step {one[name]['time/step']:.1f} s (sample "
                                         f"{one[name]['time/sample']:.1f}, train {one[name]['time/train']:.1f})"
                                         for name in recipes), flush=True)
    if {"shared", "unshared"} <= set(result):
        result["shared_over_unshared"] = {
            f"{name}/{key}": result["shared"][name][key] / result["unshared"][name][key]
            for name in recipes for key in ("time/step", "time/train")}
    if {"full", "checkpoint-only"} <= set(result):
        result["full_over_checkpoint_only"] = {
            f"{name}/{key}": result["full"][name][key] / result["checkpoint-only"][name][key]
            for name in recipes for key in ("time/step", "time/train", "time/sample")}
    name = "recipe_step_time_durability" if "full" in result else "recipe_step_time"
    save(name + ("_off_policy" if "async-ahead" in recipes else ""), result)
    return result


if __name__ == "__main__":
    main()

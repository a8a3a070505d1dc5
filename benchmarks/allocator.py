"""The same workload under each heap allocator: glibc's malloc, tcmalloc and jemalloc (server_mock/allocator.py).

A process picks its allocator when it starts, so each run is a child process of this one with
``PYTRIO_WORKER_ALLOCATOR`` (and ``LD_PRELOAD``) set, in turn, ``--rounds`` times. The workload is the demo's
200-problem greedy evaluation (benchmarks/eval_batching.py, every prompt at once, on a worker inside the child) or
one command of your own after ``--``. Reports each run's wall, user and system seconds (the allocator's work shows
as system time: page faults of freshly mapped buffers), the workload's own seconds where it writes them, the
ratio to glibc's median, and whether the evaluation's greedy tokens were the same under each.

    python benchmarks/allocator.py [--rounds 1] [--allocators system,tcmalloc,jemalloc] [-- CMD ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, machine, median, save  # noqa: E402
from server_mock.allocator import ENV, find_tcmalloc  # noqa: E402

JEMALLOC = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
            "/usr/lib64/libjemalloc.so.2", "/usr/local/lib/libjemalloc.so.2")


def _library(name: str) -> str | None:
    if name == "system":
        return "system"
    if name == "tcmalloc":
        return find_tcmalloc()
    if name == "jemalloc":
        return next((path for path in JEMALLOC if Path(path).is_file()), None)
    return name if Path(name).is_file() else None


def run_once(cmd: list[str], library: str, result_name: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env[ENV] = library  # the child itself preloads it (or not: "system") through restart_with_allocator
    if library != "system":
        env["LD_PRELOAD"] = library
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = {"wall_s": round(wall, 2), "user_s": round(after.ru_utime - before.ru_utime, 2),
           "sys_s": round(after.ru_stime - before.ru_stime, 2),
           "minor_faults": after.ru_minflt - before.ru_minflt}
    if result_name:
        result = json.loads((RESULTS / f"{result_name}.json").read_text())["runs"][0]
        row.update(workload_s=round(result["seconds"], 2), accuracy=result["accuracy"],
                   same_tokens=result["same_tokens"])
    return row


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--allocators", default="system,tcmalloc,jemalloc",
                   help="comma-separated: system, tcmalloc, jemalloc or a library path")
    p.add_argument("--problems", type=int, default=200, help="evaluation problems (the default workload)")
    p.add_argument("--name", default="allocator")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    result_name = None if own else f"{args.name}_eval"
    cmd = own or [sys.executable, "benchmarks/eval_batching.py", "--problems", str(args.problems),
                  "--runs", "on:256", "--name", result_name]
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for name in args.allocators.split(","):
            library = _library(name)
            if library is None:
                print(f"{name}: not installed, skipped")
                continue
            row = run_once(cmd, library, result_name)
            runs.setdefault(name, []).append(row)
            print(f"round {round_} {name}: {row}", flush=True)
    key = "workload_s" if result_name else "wall_s"
    base = median([r[key] for r in runs.get("system", [])]) if runs.get("system") else None
    summary = {name: {"median_" + key: median([r[key] for r in rows]),
                      "ratio_to_system": (round(median([r[key] for r in rows]) / base, 3) if base else None)}
               for name, rows in runs.items()}
    payload = {"command": cmd, "runs": runs, "summary": summary, "load_average": os.getloadavg(),
               "machine": machine()}
    print(json.dumps(summary, indent=1))
    save(args.name, payload)
    return payload


if __name__ == "__main__":
    main()

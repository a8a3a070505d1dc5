"""Run every benchmark in turn (results land in benchmarks/results/*.json); see docs/benchmarks.md.

    python benchmarks/run_all.py            # roofline, sampling, training, overheads, recipe steps, KL cost
    python benchmarks/run_all.py --with-trl # also GRPO vs TRL (trl is in the dev extra)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["roofline.py", "sampling_throughput.py", "train_throughput.py", "sync_and_client_overhead.py",
           "recipe_step_time.py", "reference_pass_cost.py"]  # grpo_variants.py (learning runs, ~10 min each) runs alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--with-trl", action="store_true")
    args = parser.parse_args()
    scripts = SCRIPTS + (["grpo_vs_trl.py"] if args.with_trl else [])
    for script in scripts:
        print(f"== {script}", flush=True)
        subprocess.run([sys.executable, str(HERE / script)], check=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The main job: install, then a short GRPO run of SmolLM2-135M-Instruct on few-shot two-digit addition,
# against a worker the SDK starts for this process. Extra arguments go to the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
# The hyperparameters are the recipe's defaults for --dataset arithmetic (recipes/grpo_options.py,
# DATASET_DEFAULTS): 20 steps of 4 prompts x 8 samples, <= 40 new tokens, lr 2e-4, LoRA rank 16, greedy accuracy
# on 200 held-out additions at steps 0 and 20. Each step's samples are drawn while the step before trains
# (--max-steps-off-policy 1: one update old at most).
exec python recipes/02-demo-async.py --dataset arithmetic --max-steps-off-policy 1 --log-dir runs/demo \
    --swanlab-mode local "$@"

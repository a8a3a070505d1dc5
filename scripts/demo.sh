#!/usr/bin/env bash
# The main job: install, then a short GRPO run of SmolLM2-135M-Instruct on few-shot two-digit addition,
# against a worker the SDK starts for this process. Extra arguments go to the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python recipes/02-demo-async.py --base-model HuggingFaceTB/SmolLM2-135M-Instruct --dataset arithmetic \
  --steps 20 --batch-size 4 --group-size 8 --max-tokens 40 --learning-rate 2e-4 --lora-rank 16 \
  --eval-every 10 --eval-size 50 --log-dir runs/demo --swanlab-mode local "$@"

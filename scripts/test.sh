#!/usr/bin/env bash
# Install what the tests need, then run them. Extra arguments go to pytest (e.g. -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python -m pytest "$@"

#!/usr/bin/env bash
# Install what the tests need, then run them. Extra arguments go to pytest (e.g. -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
# every extra is installed: a test that would skip for a missing one fails the run instead (tests/conftest.py)
export PYTRIO_REQUIRE_EXTRAS=1
exec python -m pytest "$@"

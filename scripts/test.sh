#!/usr/bin/env bash
# Install what the tests need, then run them. Extra arguments go to pytest (e.g. -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
# every extra is installed: a test that would skip for a missing one fails the run instead (tests/conftest.py)
export PYTRIO_REQUIRE_EXTRAS=1
# Two test processes by default (PYTEST_WORKERS=N to change it; a later -n in the arguments wins, -n 0 runs in this
# one); a file's tests stay in one process (--dist loadfile), so module fixtures and shared workers are made once.
exec python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"

#!/usr/bin/env bash
# Install what the tests need, then run them. Extra arguments go to pytest (e.g. -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
# every extra is installed: a test that would skip for a missing one fails the run instead (tests/conftest.py)
export PYTRIO_REQUIRE_EXTRAS=1
# compiled modules and pytest's rewritten test modules are kept (__pycache__, ignored by git) where the environment
# says not to write them: every worker the tests start imports the project again
unset PYTHONDONTWRITEBYTECODE
# Three test processes by default (PYTEST_WORKERS=N to change it; a later -n in the arguments wins, -n 0 runs in
# this one), each with torch on its share of the cores (tests/conftest.py): on the 2-core machine a third process
# runs while the others wait for their workers. A file's tests stay in one process (--dist loadfile), so module
# fixtures and shared workers are made once; the longest files go first (tests/durations.json).
exec python -m pytest -n "${PYTEST_WORKERS:-3}" --dist loadfile "$@"

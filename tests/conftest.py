"""Shared fixtures: one tiny random model on disk and its tokenizer, the session's workers (one per set of flags,
``worker_factory``), and the keyless worker serving the tiny model over HTTP (``worker``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist each test process takes its share of the cores for torch's intra-op threads (read when torch
# is imported, which is after this file): processes that each run torch on every core oversubscribe the machine,
# their OpenMP threads spinning while they wait for each other (tests/worker/ on two processes of a 2-core machine:
# 151 s with torch's default threads, 42 s with one each, in one pair of runs). The workers that they start inherit it.
_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _PROCESSES > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _PROCESSES)))

# Property tests draw the same examples on every run so a test run is repeatable; set
# HYPOTHESIS_PROFILE=explore to draw fresh ones (and keep any input it finds as a regression test).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# Tests that need an optional install (the Ray cluster, the official clients) skip without it. Where every extra
# is installed (scripts/test.sh, hence CI), a missing one must fail the run instead of shrinking it silently.
REQUIRED_WITH_EXTRAS = ("ray", "tinker", "openai", "grpc_tools", "pytrio", "trio_cookbook", "tinker_cookbook")


# The seconds each test file took in a recorded run (``--record-durations tests/durations.json``), one table per
# ``-m`` expression (the default job's "not slow", the slow job's "slow": a file's slow tests are not its fast ones).
# With ``--dist loadfile`` the test processes take whole files from one queue; pytest-xdist orders it by the number
# of tests in a file, so a long file with few tests (the Ray cluster's, the demo's) started last and ran alone at
# the end. The queue is put in order of these seconds instead, the longest first (a file not recorded counts 0.3 s
# a test).
DURATIONS = Path(__file__).resolve().parent / "durations.json"
_UNRECORDED_SECONDS_A_TEST = 0.3


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write the seconds each test file took (setup, call and teardown) to PATH as JSON, under "
                          "this run's -m expression; tests/durations.json orders the files for the test processes")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    if config.getoption("dist") != "loadfile":
        return None
    recorded = _recorded(DURATIONS).get(config.getoption("markexpr"), {})

    class LongestFileFirst(LoadFileScheduling):
        """``--dist loadfile`` whose queue of files starts with the longest (by ``tests/durations.json``)."""

        _ordered = False

        def _assign_work_unit(self, node):
            if not self._ordered:  # the queue is complete before the first file is handed out
                def seconds(scope: str) -> float:
                    return recorded.get(scope, _UNRECORDED_SECONDS_A_TEST * len(self.workqueue[scope]))

                for scope in sorted(self.workqueue, key=seconds, reverse=True):
                    self.workqueue.move_to_end(scope)
                self._ordered = True
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


def _recorded(path: Path) -> dict[str, dict[str, float]]:
    return json.loads(path.read_text()) if path.exists() else {}


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("record_durations")
    if path and not hasattr(session.config, "workerinput"):  # the controller (or the only process) writes it
        tables = _recorded(Path(path))  # the other -m expressions' tables are kept
        tables[session.config.getoption("markexpr")] = {f: round(s, 2) for f, s in sorted(_FILE_SECONDS.items())}
        Path(path).write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")


def pytest_sessionstart(session):
    if os.environ.get("PYTRIO_REQUIRE_EXTRAS") == "1":
        import importlib.util

        missing = [name for name in REQUIRED_WITH_EXTRAS if importlib.util.find_spec(name) is None]
        if missing:
            raise pytest.UsageError(f"PYTRIO_REQUIRE_EXTRAS=1 but {', '.join(missing)} is not installed: "
                                    "run bash scripts/setup_env.sh (it installs every extra)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from server_mock.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tiny models' tokenizer (``build_tiny_tokenizer``: 512 tokens, ChatML), built once per session. Shared:
    a test that changes it (its chat template, its special tokens) works on a copy."""
    from server_mock.engine.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def worker_factory(tiny_model_dir, tmp_path_factory):
    """``worker_factory(*flags, api_keys=..., process=False)``: a worker of the tiny model with those flags, shared
    by every test of the session that asks for the same ones (``support.WorkerFactory``)."""
    from support import WorkerFactory

    factory = WorkerFactory(tiny_model_dir, tmp_path_factory.mktemp("workers"))
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def worker(tiny_model_dir, tmp_path_factory):
    from support import running_worker

    with running_worker(tiny_model_dir, tmp_path_factory.mktemp("worker")) as proc:
        yield proc


@pytest.fixture()
def service(worker, tmp_path, monkeypatch):
    from support import sdk_service

    with sdk_service(worker.base_url, tmp_path / "cache", monkeypatch) as client:
        yield client

"""A worker that is killed with SIGKILL and started again on the same storage and port, for the kill tests.

The kill comes from the worker itself at a crash point (``PYTRIO_WORKER_CRASH_AT``, server_mock/storage/crash_points.py:
the exact moment, e.g. halfway through a forward_backward) or from the test after a random delay; a watcher thread
starts the worker again (without crash points) as soon as the process is gone, as a supervisor would.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from support import WorkerProcess, environment


class Supervised:
    """A worker on ``storage``, restarted on the same port whenever it dies, until ``stop``."""

    def __init__(self, model_dir: Path, storage: Path, *extra: str, crash_at: str = "", **options) -> None:
        self.model_dir, self.storage, self.extra = model_dir, storage, extra
        self.options = options  # WorkerProcess's keyword arguments (api_keys, model_name)
        self.restarts = 0
        self.recovery_seconds: list[float] = []
        self._stop = threading.Event()
        env = {"PYTRIO_WORKER_FAULT_INJECTION": "1", "PYTRIO_WORKER_CRASH_AT": crash_at}
        self.worker = self._start(0, env)
        self.port = self.worker.port
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _start(self, port: int, env: dict[str, str]) -> WorkerProcess:
        with environment(env):
            return WorkerProcess(self.model_dir, self.storage, *self.extra, **self.options).start(port)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _watch(self) -> None:
        while not self._stop.is_set():
            if not self.worker.alive():
                self.restarts += 1  # counted as the death is seen: a client may finish before the restart returns
                self.worker.stop()
                started = time.monotonic()
                self.worker = self._start(self.port, {"PYTRIO_WORKER_CRASH_AT": ""})
                self.recovery_seconds.append(time.monotonic() - started)
            time.sleep(0.05)

    def kill_after(self, seconds: float) -> None:
        """SIGKILL the worker from outside after ``seconds`` (in a thread)."""
        def kill() -> None:
            time.sleep(seconds)
            if self.worker.alive():
                os.kill(self.worker.process.pid, signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=10)
        self.worker.stop()

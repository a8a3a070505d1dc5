"""A worker started for this process when no base URL is configured: a child on a free loopback port."""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("pytrio_compat")


def _die_with_parent() -> None:  # runs in the child before exec (Linux only)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the worker goes when we go, even on SIGKILL
    except OSError:
        pass


class EmbeddedWorker:
    def __init__(self, extra_args: tuple[str, ...] = (), startup_timeout: float = 300.0) -> None:
        self.api_key = secrets.token_hex(16)
        self._dir = tempfile.mkdtemp(prefix="pytrio-worker-")
        port_file = Path(self._dir) / "port"
        self.log_path = Path(self._dir) / "worker.log"
        storage = os.environ.get("PYTRIO_EMBEDDED_STORAGE") or str(Path(self._dir) / "storage")
        cmd = [
            # one user's own worker, behind its own random key: it may load any model that user names
            sys.executable, "-m", "server_mock", "serve", "--lazy-models", "--lazy-model-allow", "*",
            "--host", "127.0.0.1", "--port", "0",
            "--port-file", str(port_file), "--storage", storage, *extra_args,
        ]
        env = {**os.environ, "PYTRIO_WORKER_API_KEYS": self.api_key}
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + startup_timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if self.process.poll() is not None:
                raise RuntimeError(f"the embedded worker exited at start-up; log:\n{self.log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the embedded worker did not start within {startup_timeout:.0f}s")
            time.sleep(0.05)
        self.port = int(port_file.read_text().strip())
        self.base_url = f"http://127.0.0.1:{self.port}"
        logger.info("no base_url configured: started a local worker at %s (log: %s)", self.base_url, self.log_path)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

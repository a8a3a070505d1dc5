"""Test helpers: a real worker in a child process, on a free loopback port; an SDK client of it; a trained run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

import pytrio_compat as trio

REPO = Path(__file__).resolve().parents[1]


class WorkerProcess:
    def __init__(self, model_dir: Path, storage: Path, *extra: str, api_keys: list[str] | None = None,
                 model_name: str = "tiny") -> None:
        self.model_dir, self.storage, self.extra = model_dir, storage, extra
        self.api_keys = api_keys or []
        self.model_name = model_name
        self.process: subprocess.Popen | None = None
        self.base_url = ""

    def start(self, port: int = 0) -> "WorkerProcess":
        port_file = self.storage.parent / f"port-{os.getpid()}-{time.monotonic_ns()}"
        cmd = [sys.executable, "-m", "server_mock", "serve", "--model", f"{self.model_name}={self.model_dir}",
               "--port", str(port), "--port-file", str(port_file), "--storage", str(self.storage),
               "--threads", "1", "--log-level", "WARNING", *self.extra]
        for key in self.api_keys:
            cmd += ["--api-key", key]
        self.log = open(self.storage.parent / "worker.log", "ab")
        self.process = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not start: " + (self.storage.parent / "worker.log").read_text()[-3000:])
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.base_url = f"http://127.0.0.1:{self.port}"
        while True:  # wait until it answers
            try:
                httpx.get(self.base_url + "/v1/health", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if hasattr(self, "log"):
            self.log.close()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@contextmanager
def running_worker(model_dir: Path, root: Path, *extra: str, **kwargs) -> Iterator[WorkerProcess]:
    """A worker (``WorkerProcess`` arguments) keeping its storage and log under ``root``, stopped after the block."""
    proc = WorkerProcess(model_dir, root / "storage", *extra, **kwargs).start()
    try:
        yield proc
    finally:
        proc.stop()


@contextmanager
def sdk_service(base_url: str, cache_dir: Path, monkeypatch) -> Iterator[trio.ServiceClient]:
    """An SDK ServiceClient of the worker at ``base_url``, with its local cache in ``cache_dir`` (set for this
    test only through ``monkeypatch``), closed after the block."""
    monkeypatch.setenv("PYTRIO_COMPAT_CACHE", str(cache_dir))
    client = trio.ServiceClient(base_url=base_url)
    try:
        yield client
    finally:
        client.close()


def moved_state(service) -> tuple[str, object]:
    """A run moved away from its initial weights (LoRA B != 0), saved with save_state: its path, and the
    tokenizer. The e2e reference checks start from it, on the local and on the Ray worker."""
    tc = service.create_lora_training_client("tiny", rank=8, seed=7)
    tok = tc.get_tokenizer()
    ids = tok.encode("1 + 1 = 2. 2 + 2 = 4.")
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    for _ in range(3):
        tc.forward_backward([datum]).result()
        tc.optim_step(trio.AdamParams(learning_rate=5e-3)).result()
    return tc.save_state("moved").result().path, tok

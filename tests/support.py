"""Test helpers: a real worker, in a child process or in this process, on a free loopback port; workers shared by
flags (``WorkerFactory``); an SDK client of a worker; a trained run."""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

import pytrio_compat as trio

REPO = Path(__file__).resolve().parents[1]

# The fork server: an interpreter that imports the libraries the worker needs once, never the worker itself
# (server_mock reads PYTRIO_WORKER_CRASH_AT and the fault switch when it is imported), then forks one child per line
# on stdin, {"id", "argv", "env", "log", "stdout"?}: the child takes the whole environment and the log file as its
# output (its standard output in the file "stdout" where that is given) and runs the CLI. The server answers
# "pid ID PID" for each child and "exit PID CODE" when one ends (it reaps them).
# One thread only: nothing but this loop runs when it forks.
_FORK_SERVER = """
import torch, transformers, peft, uvicorn, starlette.applications, safetensors.torch, numpy, pydantic, msgpack
from transformers import AutoModelForCausalLM, AutoTokenizer
import json, os, select, sys
children, pending = set(), b""
def say(line):
    os.write(1, (line + "\\n").encode())
while True:
    ready = select.select([0], [], [], 0.02)[0]
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        children.discard(pid)
        say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
    if not ready:
        continue
    chunk = os.read(0, 1 << 16)
    if not chunk:
        break
    pending += chunk
    while b"\\n" in pending:
        line, pending = pending.split(b"\\n", 1)
        message = json.loads(line)
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_RDONLY)
            log = os.open(message["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            out = os.open(message["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND) if message.get("stdout") else log
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(log, 2)
            for fd in {null, log, out}:
                os.close(fd)
            os.environ.clear()
            os.environ.update(message["env"])
            from server_mock.cli import main
            sys.exit(main(message["argv"]))
        children.add(pid)
        say(f"pid {message['id']} {pid}")
"""


class _ForkedChild:
    """A worker forked by the fork server, with the part of ``subprocess.Popen`` the tests use: ``pid``, ``poll``,
    ``wait``, ``send_signal``, ``kill``, ``returncode`` (reported by the server, which reaps it)."""

    def __init__(self, server: "_WarmChildren", pid: int, argv: list[str]) -> None:
        self.pid, self.args = pid, argv
        self._server = server
        self._ended = server.ended(pid)

    @property
    def returncode(self) -> int | None:
        return self._server.exit_codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _WarmChildren:
    """Worker processes forked from one interpreter that imported the libraries once (``_FORK_SERVER``), so that
    a ``warm`` worker neither waits for nor spends the ~4 s of CPU a cold ``python -m server_mock`` takes to import
    torch and transformers on a 2-core machine. Each is still its own process (its own pid, SIGKILL, a fresh
    import of the worker). Environment variables that a library reads when it is imported (OMP_NUM_THREADS) come
    from when the server was started. The server starts with the first warm worker of the test process."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._replies: dict[int, int] = {}
        self._reply = threading.Condition(self._lock)
        self._ends: dict[int, threading.Event] = {}
        self.exit_codes: dict[int, int] = {}
        self._next_id = 0

    def _start(self) -> subprocess.Popen:
        server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], cwd=REPO, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        threading.Thread(target=self._read, args=(server,), daemon=True, name="fork-server").start()
        return server

    def _read(self, server: subprocess.Popen) -> None:
        for line in server.stdout:
            kind, first, second = line.decode().split()
            with self._lock:
                if kind == "pid":
                    self._replies[int(first)] = int(second)
                    self._reply.notify_all()
                else:
                    self.exit_codes[int(first)] = int(second)
                    self._ends.setdefault(int(first), threading.Event()).set()
        with self._lock:  # the server is gone: wake a start that waits for it
            self._reply.notify_all()

    def ended(self, pid: int) -> threading.Event:
        with self._lock:
            return self._ends.setdefault(pid, threading.Event())

    def run(self, argv: list[str], env: dict[str, str], log: Path, stdout: Path | None = None) -> _ForkedChild:
        with self._lock:
            if self._server is None or self._server.poll() is not None:
                self._server = self._start()
            self._next_id += 1
            ask = self._next_id
            message = {"id": ask, "argv": argv, "env": env, "log": str(log), "stdout": str(stdout) if stdout else None}
            self._server.stdin.write((json.dumps(message) + "\n").encode())
            self._server.stdin.flush()
            while ask not in self._replies:
                if self._server.poll() is not None:
                    raise RuntimeError("the fork server of warm workers exited")
                self._reply.wait(1.0)
            pid = self._replies.pop(ask)
        return _ForkedChild(self, pid, argv)

    def prepare(self) -> None:
        """Start the fork server now (it imports the libraries while the caller goes on)."""
        with self._lock:
            if self._server is None or self._server.poll() is not None:
                self._server = self._start()

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stdin.close()  # end of input: the server exits (its children are stopped by their tests)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


WARM_CHILDREN = _WarmChildren()
atexit.register(WARM_CHILDREN.close)


def run_cli(argv: list[str], folder: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """``pytrio-worker`` with ``argv`` until it exits, forked warm (``_WarmChildren``: without importing torch and
    transformers again), its output in files of ``folder``: its exit code, standard output and standard error, as
    ``subprocess.run(..., capture_output=True, text=True)`` answers them. Killed after ``timeout`` seconds
    (``subprocess.TimeoutExpired``)."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    out, err = folder / f"cli-{stamp}.out", folder / f"cli-{stamp}.err"
    child = WARM_CHILDREN.run(argv, dict(os.environ), err, stdout=out)
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(30)
        raise
    return subprocess.CompletedProcess(argv, code, out.read_text() if out.exists() else "",
                                       err.read_text() if err.exists() else "")


class WorkerProcess:
    """A worker in a child process: ``pytrio-worker serve`` with these arguments. By default (``warm=True``) the
    child is forked from an interpreter that imported the libraries once (``_WarmChildren``): the same worker and
    the same process semantics (its own pid, SIGKILL, a fresh import of the worker), without importing torch and
    transformers again, but its command line shows none of the arguments, so a test that reads
    /proc/PID/cmdline starts it cold (``warm=False``: ``python -m server_mock serve ...``)."""

    def __init__(self, model_dir: Path, storage: Path, *extra: str, api_keys: list[str] | None = None,
                 model_name: str = "tiny", env: dict[str, str] | None = None, warm: bool = True) -> None:
        self.model_dir, self.storage, self.extra = model_dir, storage, extra
        self.api_keys = api_keys or []
        self.model_name = model_name
        self.env = env or {}
        self.warm = warm
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
        if self.warm:
            self.process = WARM_CHILDREN.run(cmd[3:], {**os.environ, **self.env}, self.storage.parent / "worker.log")
        else:
            self.process = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.env} if self.env else None)
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
        if self.warm:
            WARM_CHILDREN.prepare()
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


def serve_argv(model_dir: Path, storage: Path, extra: tuple[str, ...], api_keys: list[str],
               model_name: str, port: int = 0) -> list[str]:
    """``pytrio-worker serve`` arguments for a worker of ``model_dir`` (as ``model_name``) on ``port`` (0: a free
    one)."""
    argv = ["serve", "--model", f"{model_name}={model_dir}", "--port", str(port), "--storage", str(storage),
            "--log-level", "WARNING", *extra]
    for key in api_keys:
        argv += ["--api-key", key]
    return argv


class InProcessWorker:
    """A worker in this process, with ``WorkerProcess``'s arguments: the CLI's own server (``build_server``, so the
    same flags, keys and limits) run by uvicorn on a thread, on a free loopback port, over real HTTP. It starts in
    a fraction of a second where a child process first imports torch and transformers again (about 4 s on a
    2-core machine), so it is the worker for every test where a separate process is not the point; a test that
    kills the worker, reads its memory or its process list uses ``WorkerProcess``. ``env`` is set while the
    service is built (``PYTRIO_WORKER_FAULT_INJECTION`` is read then). ``service`` is the WorkerService."""

    def __init__(self, model_dir: Path, storage: Path, *extra: str, api_keys: list[str] | None = None,
                 model_name: str = "tiny", env: dict[str, str] | None = None) -> None:
        self.model_dir, self.storage, self.extra = model_dir, storage, extra
        self.api_keys = api_keys or []
        self.model_name = model_name
        self.env = env or {}
        self.base_url = ""

    def start(self, port: int = 0) -> "InProcessWorker":
        from server_mock.cli import build_parser, build_server

        args = build_parser().parse_args(serve_argv(self.model_dir, self.storage, self.extra, self.api_keys,
                                                    self.model_name, port))
        with environment(self.env):
            self.server, sock = build_server(args)
        self._log_to_file(args.log_level.upper())
        self.service = self.server.config.app.state.service
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name=f"worker-{self.port}")
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"in-process worker on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def _log_to_file(self, level: str) -> None:
        """What the worker logs, in ``worker.log`` beside its storage as a child process's output is. The loggers
        are this process's: a record another in-process worker logs meanwhile lands here too."""
        self._log = logging.FileHandler(self.storage.parent / "worker.log")
        self._log.setLevel(level)
        self._log.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self._loggers = [(logging.getLogger(name), logging.getLogger(name).level) for name in ("", "uvicorn")]
        for logger, _ in self._loggers:
            logger.addHandler(self._log)
        noisy = logging.getLogger("server_mock")
        self._loggers.append((noisy, noisy.level))
        if noisy.getEffectiveLevel() > self._log.level:
            noisy.setLevel(self._log.level)

    def stop(self) -> None:
        if getattr(self, "_thread", None) is not None and self._thread.is_alive():
            self.server.should_exit = True
            self._thread.join(30)
        if getattr(self, "_log", None) is not None:
            for logger, level in self._loggers:
                logger.removeHandler(self._log)
                logger.setLevel(level)
            self._log.close()
            self._log = None

    def alive(self) -> bool:
        return getattr(self, "_thread", None) is not None and self._thread.is_alive()


class WorkerFactory:
    """The workers of a test session, one per set of arguments, started on first use and shared by every test
    that asks for the same ones: ``workers("--max-samplers", "4", api_keys=[KEY_A, KEY_B])``. In this process
    unless ``process=True``. Tests that share a worker isolate their state by tenant (their own API keys) and by
    their own runs and samplers; a test that changes what a worker is (kills it, fills a budget that is not per
    key) starts its own instead."""

    def __init__(self, model_dir: Path, root: Path) -> None:
        self.model_dir, self.root = Path(model_dir), root
        self._workers: dict[tuple, InProcessWorker | WorkerProcess] = {}
        self._started = 0

    def __call__(self, *extra: str, api_keys: list[str] | tuple[str, ...] = (), model_name: str = "tiny",
                 env: dict[str, str] | None = None, process: bool = False,
                 model_dir: Path | None = None) -> InProcessWorker | WorkerProcess:
        model_dir = Path(model_dir or self.model_dir)
        key = (tuple(extra), tuple(api_keys), model_name, tuple(sorted((env or {}).items())), process, model_dir)
        if key not in self._workers:
            self._started += 1
            folder = self.root / f"worker-{self._started}"
            folder.mkdir(parents=True)
            kind = WorkerProcess if process else InProcessWorker
            self._workers[key] = kind(model_dir, folder / "storage", *extra, api_keys=list(api_keys),
                                      model_name=model_name, env=env).start()
        return self._workers[key]

    def close(self) -> None:
        for worker in reversed(list(self._workers.values())):
            worker.stop()
        self._workers.clear()


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in ``os.environ`` for the block; each of its names back to what it was after (unset if it was)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def serve_app(app, **config) -> Iterator[str]:
    """``app`` behind a real uvicorn on a free loopback port of this process (``config``: more of
    ``uvicorn.Config``'s arguments); yields its base URL, the server stopped after the block."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    assert server.started, "the worker did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)


@contextmanager
def running_worker(model_dir: Path, root: Path, *extra: str, in_process: bool = False,
                   **kwargs) -> Iterator[WorkerProcess | InProcessWorker]:
    """A worker (``WorkerProcess`` arguments) keeping its storage and log under ``root``, stopped after the block;
    in this process (``InProcessWorker``) with ``in_process=True``."""
    proc = (InProcessWorker if in_process else WorkerProcess)(model_dir, root / "storage", *extra, **kwargs).start()
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


class FakeClock:
    """A monotonic clock the test moves by hand (``advance``, or ``now = ...``); safe to read from the worker's
    threads."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


"""Clients that never finish a request: without a deadline and connection caps, ~1000 of them, sending half a
request line each (no API key needed), took every file descriptor of a worker and it stopped answering anyone.
Now a request must arrive whole within --request-timeout (408 otherwise), and a connection over --max-connections
(or --max-connections-per-peer) first closes the longest-waiting incomplete one, so the health check answers
throughout; a held long poll is ended early ("poll again") to make room too; only when every connection is busy
with other work is a new one answered 503."""

from __future__ import annotations

import os
import resource
import socket
import time

import httpx
import pytest
from support import WorkerProcess

from .reliability_helpers import KEY_A, datum_wire

FILE_LIMIT = 1024  # the worker's open-file limit in these tests (a common default)
HALF_OPEN = 1100


def _limited_files() -> None:  # in the worker's process, before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))


class LimitedWorker(WorkerProcess):
    """A worker whose open-file limit is FILE_LIMIT (soft and hard), as on many machines."""

    def start(self, port: int = 0) -> "LimitedWorker":
        import subprocess

        real = subprocess.Popen

        def popen(*args, **kwargs):
            return real(*args, preexec_fn=_limited_files, **kwargs)

        subprocess.Popen = popen
        try:
            return super().start(port)
        finally:
            subprocess.Popen = real


@pytest.fixture()
def room_for_sockets():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = HALF_OPEN + 400
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _half_open(port: int, count: int, source: str = "127.0.0.1") -> list[socket.socket]:
    out = []
    for _ in range(count):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(b"POST /v1/training_runs HTTP/1.1\r\nHost: localhost\r\n")  # half a request, never finished
        out.append(s)
    return out


def _answer(s: socket.socket, timeout: float = 15.0) -> bytes:
    s.settimeout(timeout)
    try:
        return s.recv(4096)
    except (socket.timeout, ConnectionResetError):
        return b""


def test_half_open_connections_leave_health_answering(tiny_model_dir, tmp_path, room_for_sockets):
    proc = LimitedWorker(tiny_model_dir, tmp_path / "storage", "--request-timeout", "30").start()
    sockets: list[socket.socket] = []
    try:
        latencies = []
        with httpx.Client(timeout=10) as http:
            for _ in range(11):  # 1100 half-open connections, a health check after every 100
                sockets += _half_open(proc.port, HALF_OPEN // 11)
                started = time.perf_counter()
                assert http.get(proc.base_url + "/v1/health", headers={"Connection": "close"}).status_code == 200
                latencies.append(time.perf_counter() - started)
        fds = _open_fds(proc.process.pid)
        print(f"\n{len(sockets)} half-open connections: health answered every time, max {max(latencies):.3f} s; "
              f"the worker holds {fds} open files (limit {FILE_LIMIT})")
        assert fds < FILE_LIMIT
        assert proc.alive()
        # the oldest were closed to make room (408: they had begun a request), the newest are still open
        assert _answer(sockets[0], 1.0).startswith(b"HTTP/1.1 408")
    finally:
        for s in sockets:
            s.close()
        proc.stop()


def _faulty_worker(tiny_model_dir, tmp_path, *extra: str) -> WorkerProcess:
    """A worker whose requests may ask to be slow (fault injection), with one API key."""
    old = os.environ.get("PYTRIO_WORKER_FAULT_INJECTION")
    os.environ["PYTRIO_WORKER_FAULT_INJECTION"] = "1"
    try:
        return WorkerProcess(tiny_model_dir, tmp_path / "storage", *extra, api_keys=[KEY_A]).start()
    finally:
        if old is None:
            os.environ.pop("PYTRIO_WORKER_FAULT_INJECTION")
        else:
            os.environ["PYTRIO_WORKER_FAULT_INJECTION"] = old


def _slow_op(base_url: str, seconds: float) -> str:
    """The request id of a forward op that runs for ``seconds`` on the model's thread."""
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30) as http:
        run = http.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 2}}).json()
        slow = {"seq_id": 1, "payload": {"op": "forward", "data": [datum_wire()],
                                         "loss_fn_config": {"fault_injection": {"delay_seconds": seconds}}}}
        return http.post(f"/v1/training_runs/{run['training_run_id']}/ops", json=slow).json()["request_id"]


def test_a_request_must_arrive_whole_within_the_deadline(tiny_model_dir, tmp_path):
    proc = _faulty_worker(tiny_model_dir, tmp_path, "--request-timeout", "1.5")
    try:
        port = proc.port
        silent = socket.create_connection(("127.0.0.1", port))  # connects, sends nothing
        headers_only = socket.create_connection(("127.0.0.1", port))
        headers_only.sendall(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n")  # the blank line never comes
        body_short = socket.create_connection(("127.0.0.1", port))
        body_short.sendall(b"POST /v1/training_runs HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                           b"\r\nAuthorization: Bearer " + KEY_A.encode() +
                           b"\r\nContent-Length: 100\r\n\r\n{\"base_model\"")  # 13 of 100 bytes
        started = time.monotonic()
        for s in (headers_only, body_short):
            reply = _answer(s)
            assert reply.startswith(b"HTTP/1.1 408"), reply
            assert b"request_timeout=1.5" in reply, reply
        assert _answer(silent) == b""  # closed without a word: it had not begun a request
        waited = time.monotonic() - started
        assert 1.0 <= waited < 10, waited
        # a request sent whole is served however long its answer takes: this long poll outlives the deadline
        rid = _slow_op(proc.base_url, 2.5)
        with httpx.Client(base_url=proc.base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30) as http:
            status = http.get(f"/v1/requests/{rid}", params={"wait": 20})
            assert status.status_code == 200 and status.json()["status"] == "succeeded", status.text
    finally:
        proc.stop()


def test_connections_over_the_cap_make_room_from_incomplete_requests_and_long_polls(tiny_model_dir, tmp_path):
    proc = _faulty_worker(tiny_model_dir, tmp_path, "--max-connections", "8", "--max-connections-per-peer", "6")
    polls: list[socket.socket] = []
    try:
        rid = _slow_op(proc.base_url, 5)
        # per peer: six long polls (complete requests, busy) from one address; a seventh ends the oldest poll
        # early (it answers the request's status now: "poll again") and is served (before: 503 for everyone)
        for _ in range(6):
            s = socket.create_connection(("127.0.0.1", proc.port))
            s.sendall(f"GET /v1/requests/{rid}?wait=30 HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY_A}"
                      f"\r\n\r\n".encode())
            polls.append(s)
        time.sleep(0.5)
        seventh = socket.create_connection(("127.0.0.1", proc.port))
        seventh.sendall(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert _answer(seventh, 5).startswith(b"HTTP/1.1 200")
        early = _answer(polls[0], 5)
        assert early.startswith(b"HTTP/1.1 200") and b"succeeded" not in early, early
        for s in (seventh, polls.pop(0)):
            s.close()
        # another address still gets in, up to the total cap; then incomplete ones make room for it
        time.sleep(0.2)
        others = _half_open(proc.port, 3, source="127.0.0.2")
        started = time.perf_counter()
        with httpx.Client(timeout=10, transport=httpx.HTTPTransport(local_address="127.0.0.3")) as http:
            assert http.get(proc.base_url + "/v1/health").status_code == 200  # closed one of 127.0.0.2's
        assert time.perf_counter() - started < 5
        assert _answer(others[0], 2).startswith(b"HTTP/1.1 408")
        # the other long polls were never touched: they get their answer
        assert b"succeeded" in _answer(polls[0], 30) + _answer(polls[0], 2)
    finally:
        for s in polls:
            s.close()
        proc.stop()

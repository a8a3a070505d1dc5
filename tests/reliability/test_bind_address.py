"""The worker listens on loopback by default and refuses a network address without an API key."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest
from support import REPO

from server_mock.cli import _is_loopback, build_parser, listening_socket


def test_default_bind_is_loopback():
    args = build_parser().parse_args(["serve", "--model", "tiny=/nowhere"])
    assert args.host == "127.0.0.1" and _is_loopback(args.host)


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.20", False), ("10.0.0.1", False), ("example.com", False),
])
def test_which_addresses_count_as_loopback(host, loopback):
    assert _is_loopback(host) is loopback


def test_non_loopback_bind_without_api_key_exits_with_a_reason(tiny_model_dir, tmp_path):
    # exits before any socket is opened; with --api-key or --insecure it would serve (not tried here)
    result = subprocess.run(
        [sys.executable, "-m", "server_mock", "serve", "--model", f"tiny={tiny_model_dir}", "--host", "0.0.0.0",
         "--port", "0", "--storage", str(tmp_path / "storage")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        env={k: v for k, v in os.environ.items() if k != "PYTRIO_WORKER_API_KEYS"},
    )
    assert result.returncode != 0
    assert "refusing to listen on 0.0.0.0 without --api-key" in result.stderr
    assert "--insecure" in result.stderr


def test_responses_are_not_held_back_by_nagle():
    """Without TCP_NODELAY on accepted connections each response on a kept-alive connection waited ~40 ms for the
    client's delayed ACK; every SDK call makes two requests. The worker's listener, served by asyncio as uvicorn
    serves it, hands out connections with TCP_NODELAY set."""
    sock = listening_socket("127.0.0.1", 0)
    seen: list[int] = []

    async def main() -> None:
        async def handle(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    asyncio.run(main())
    assert seen and seen[0] != 0, seen

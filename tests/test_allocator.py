"""The worker process starts itself again with tcmalloc preloaded (server_mock/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_mock import allocator

ROOT = Path(__file__).resolve().parents[1]
LIB = "/opt/lib/libtcmalloc_minimal.so.4"
MAPS_GLIBC = "7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
MAPS_TC = MAPS_GLIBC + "7f0000002000-7f0000003000 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4\n"


def test_auto_preloads_tcmalloc_first_and_keeps_the_callers_preload():
    env = allocator.restart_env({"LD_PRELOAD": "/x/libother.so", "PATH": "/bin"}, None, lambda: LIB)
    assert env["LD_PRELOAD"] == f"{LIB}:/x/libother.so"
    assert env["PATH"] == "/bin" and env[allocator._RESTARTED] == "1"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    assert allocator.restart_env({}, None, lambda: LIB)["LD_PRELOAD"] == LIB


@pytest.mark.parametrize("env, loaded, found", [
    ({}, None, None),  # nothing installed: the system malloc
    ({allocator.ENV: "system"}, None, LIB),  # asked for the system malloc
    ({}, "/usr/lib/libtcmalloc.so.4", LIB),  # already preloaded
    ({allocator._RESTARTED: "1"}, None, LIB),  # restarted once and the library did not load: never loop
])
def test_no_restart(env, loaded, found):
    def find():
        if env.get(allocator.ENV) == "system" or loaded or env.get(allocator._RESTARTED):
            raise AssertionError("looked for tcmalloc where nothing would be preloaded")
        return found

    assert allocator.restart_env(env, loaded, find) is None


def test_a_named_library_is_preloaded_and_a_missing_one_is_refused(tmp_path):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    assert allocator.restart_env({allocator.ENV: str(lib)}, None, lambda: None)["LD_PRELOAD"] == str(lib)
    with pytest.raises(SystemExit, match=f"{allocator.ENV}=.*no such library file.*'system'"):
        allocator.restart_env({allocator.ENV: str(tmp_path / "missing.so")}, None, lambda: LIB)


def test_loaded_allocator_reads_the_maps():
    assert allocator.loaded_allocator(MAPS_GLIBC) is None
    assert allocator.loaded_allocator(MAPS_TC) == "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"


def test_find_tcmalloc_looks_in_the_library_folders(tmp_path):
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert allocator.find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc_minimal.so.4")


def _child(extra_env: dict[str, str]) -> str:
    """What a process that calls restart_with_allocator first reports as its allocator."""
    code = ("from server_mock.allocator import restart_with_allocator, loaded_allocator\n"
            "restart_with_allocator()\nprint(loaded_allocator(), flush=True)")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV, allocator._RESTARTED)}
    env.update(extra_env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="tcmalloc is not installed (libtcmalloc-minimal4)")
def test_a_process_restarts_with_tcmalloc_unless_told_otherwise():
    assert "tcmalloc" in _child({})
    assert _child({allocator.ENV: "system"}) == "None"

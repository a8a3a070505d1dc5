"""The heap allocator the worker process runs with: tcmalloc where it is installed, else the system's malloc.

On a CPU, every prefill and decode step allocates and frees tensor buffers of megabytes. glibc's malloc hands
buffers that large out as fresh memory mappings and unmaps them when they are freed, so each step faults its pages
in again and the kernel zeroes them; tcmalloc keeps freed memory for the next step. On the 2-core CPU machine the
demo's 200-problem evaluation took 0.81x the time with tcmalloc and the whole demo 0.82x, with the same results
(docs/benchmarks.md, "Heap allocator"); jemalloc measured no faster than glibc there.

A process picks its allocator when it starts (``LD_PRELOAD``), so ``pytrio-worker`` and ``python -m server_mock``
start themselves once more with the library preloaded, before anything heavy is imported. No package does this
preload for a process, hence this module. ``PYTRIO_WORKER_ALLOCATOR`` chooses:

- ``auto`` (default): tcmalloc if found (Debian/Ubuntu package ``libtcmalloc-minimal4``), else the system malloc;
- ``system``: the system malloc, no restart;
- a path to a shared library (e.g. jemalloc's): preload that one.

``python -m server_mock.allocator`` prints the library ``auto`` would preload (exit status 1 when there is none):
scripts/setup_env.sh asks it whether tcmalloc is installed, and benchmarks can preload the same library.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

ENV = "PYTRIO_WORKER_ALLOCATOR"
_RESTARTED = "PYTRIO_WORKER_ALLOCATOR_RESTARTED"  # set in the restarted process: never restart twice
_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_KNOWN = ("tcmalloc", "jemalloc", "mimalloc")
# tcmalloc reports every allocation above 1 GiB on stderr by default; a worker makes such buffers routinely
_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


def find_tcmalloc(dirs: tuple[str, ...] = _LIB_DIRS) -> str | None:
    """The path of an installed tcmalloc, or None."""
    for directory in (str(Path(sys.prefix) / "lib"), *dirs):
        for name in _TCMALLOC_NAMES:
            path = Path(directory) / name
            if path.is_file():
                return str(path)
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return found or None  # a bare soname: the dynamic loader finds it in its own search path


def loaded_allocator(maps: str | None = None) -> str | None:
    """The preloaded allocator library this process runs with (from /proc/self/maps), or None."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    for line in maps.splitlines():
        fields = line.split()
        if fields and any(name in Path(fields[-1]).name for name in _KNOWN):
            return fields[-1]
    return None


def restart_env(env: Mapping[str, str], loaded: str | None,
                find: Callable[[], str | None] = find_tcmalloc) -> dict[str, str] | None:
    """The environment to start this process again with, or None to go on as it is.

    ``loaded``: the allocator already mapped into this process; ``find``: where tcmalloc is (``find_tcmalloc``),
    asked only when ``auto`` has to look (its fallback, ``ctypes.util.find_library``, runs ldconfig)."""
    choice = env.get(ENV, "auto").strip() or "auto"
    if choice == "system" or loaded is not None or env.get(_RESTARTED):
        return None
    if choice == "auto":
        library = find()
        if library is None:
            return None
    else:
        library = choice
        if not Path(library).is_file():
            raise SystemExit(f"{ENV}={choice!r}: no such library file; give the path of a shared library to "
                             f"preload, or 'auto' (tcmalloc when installed) or 'system'")
    new = dict(env)
    new["LD_PRELOAD"] = ":".join(filter(None, (library, env.get("LD_PRELOAD", ""))))
    new[_RESTARTED] = "1"
    for key, value in _QUIET.items():
        new.setdefault(key, value)
    return new


def restart_with_allocator() -> None:
    """Start this process again (same pid, same arguments) with the allocator ``PYTRIO_WORKER_ALLOCATOR`` names
    preloaded, unless it is already there; returns where there is nothing to do. Call it first in a process
    entry point, never in a library function (it replaces the running program)."""
    if not sys.platform.startswith("linux"):
        return
    env = restart_env(os.environ, loaded_allocator())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe() -> str:
    """One line for the start-up log: which allocator this process runs with."""
    loaded = loaded_allocator()
    if loaded is not None:
        return f"heap allocator: {loaded}"
    return ("heap allocator: the system malloc (install tcmalloc, e.g. Debian's libtcmalloc-minimal4, for faster "
            f"CPU steps; {ENV}=system keeps this one)")


if __name__ == "__main__":
    library = find_tcmalloc()
    if library is None:
        sys.exit(1)
    print(library)

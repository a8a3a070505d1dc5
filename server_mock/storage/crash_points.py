"""Crash points for kill tests: the worker sends itself ``SIGKILL`` at a named moment, so a test can kill it exactly
there (in the middle of a forward_backward, as an optim_step starts, halfway through writing a checkpoint, while
sampling) and check what a restart on the same storage recovers.

Off unless the worker starts with ``PYTRIO_WORKER_FAULT_INJECTION=1`` and ``PYTRIO_WORKER_CRASH_AT`` names points:
``point:n[,point:n...]`` kills the process the ``n``-th time (counted from 1, in this process) it reaches ``point``.
The points: ``forward_backward`` (after the gradients were
accumulated, before anything is answered), ``optim_step`` (before the step), ``save_state`` / ``save_weights``
(after the tensor files of a state / sampler checkpoint on disk are written, before its folder is renamed into
place), ``sample`` (after the tokens were generated, before anything is answered), ``state_write`` (after a run's
state file is written, before the database names it), ``init_run`` (a PyTRIO ``trainer.init_run`` acknowledged,
before its adapter is made).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

ENV_VAR = "PYTRIO_WORKER_CRASH_AT"
POINTS = ("forward_backward", "optim_step", "save_state", "save_weights", "sample", "state_write", "init_run")

_counts: dict[str, int] = {}
_lock = threading.Lock()


def _armed() -> dict[str, int]:
    if os.environ.get("PYTRIO_WORKER_FAULT_INJECTION", "").strip().lower() not in ("1", "true", "yes", "on"):
        return {}
    armed = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV_VAR, "").split(","))):
        point, _, nth = item.partition(":")
        if point not in POINTS or not nth.isdigit():
            raise ValueError(f"{ENV_VAR}: {item!r} is not point:n with point one of {', '.join(POINTS)}")
        armed[point] = int(nth)
    return armed


_ARMED = _armed()
if _ARMED:
    logging.getLogger("server_mock").warning("crash points armed (%s): this worker will kill itself", _ARMED)


def reached(point: str) -> None:
    """Kill this process with SIGKILL if ``point`` is armed and reached for the n-th time."""
    if point not in _ARMED:
        return
    with _lock:
        _counts[point] = _counts.get(point, 0) + 1
        hit = _counts[point] == _ARMED[point]
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)

"""Peak memory of a block of code: a background thread samples a reading and keeps its highest value."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Callable


class PeakSampler:
    """Samples ``read()`` (bytes) every ``interval`` seconds while the ``with`` block runs; ``rise_mb`` is the peak
    minus the reading at the start."""

    def __init__(self, read: Callable[[], int], interval: float) -> None:
        self._read, self._interval = read, interval
        self.start = self.peak = read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read())
            time.sleep(self._interval)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def rise_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def PeakRSS(pid: int) -> PeakSampler:  # noqa: N802 - used like a class
    """The resident set of process ``pid``, every 20 ms."""
    import psutil

    proc = psutil.Process(pid)
    return PeakSampler(lambda: proc.memory_info().rss, 0.02)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def PeakHeap() -> PeakSampler:  # noqa: N802 - used like a class
    """Bytes this process's C allocator has handed out and not taken back (glibc ``mallinfo2``: heap + mmapped
    blocks), every 5 ms: what a call holds at its height, whatever the allocator keeps cached or how fragmented its
    arenas are (which the resident set also counts)."""
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return PeakSampler(in_use, 0.005)

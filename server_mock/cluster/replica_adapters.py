"""``ReplicaAdapters``: the sampler replicas' adapter pool entries, charged to the worker's adapter budget.

A replica builds a pool entry for each snapshot of a call that decodes on its mixed decoder (``sample_groups``);
those bytes count against ``--max-adapter-bytes-total`` as the local host's pool entries do. The budget lives in
the front end, the entries in the replicas' processes, so the front end keeps the books:

- before a call goes to a replica, the snapshots that replica does not hold charged yet are charged at the size
  their entries will take (``adapter_pool.entry_nbytes``), and every snapshot of the call is pinned (it is not
  evicted while the call runs);
- where the budget cannot hold them, the least recently used unpinned entries of any replica are dropped there
  first (``drop``); where even that would not make room, the call is refused with an error naming the flag, and
  nothing is dropped or charged;
- after each call a replica reports what its pool holds (``Report``); a charged entry that is neither reported nor
  pinned is given back (the replica dropped it: its ``--adapter-pool-bytes``, its snapshot count, or the call did
  not decode mixed and built none).

The replica's pool is the one record of what is resident, the budget the one record of what is charged; the books
here only map one onto the other. The budget may also ask for bytes back (``reclaim``: a training run needs them).
"""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

from server_mock.errors import WorkerError

__all__ = ["ReplicaAdapters", "ReplicaBudget", "Report"]


class ReplicaBudget(Protocol):
    """The worker's adapter budget as the replicas' books use it (service/quotas.py's ``PoolCharge``)."""

    total: int

    def charge(self, key: str, size: int) -> None:
        """Count ``size`` bytes for ``key``, or raise (changing nothing) where they do not fit."""

    def release(self, key: str) -> None:
        """``key``'s bytes no longer count."""

    def room(self) -> int:
        """The bytes the budget can still hold."""


class Report(NamedTuple):
    """What a replica's adapter pool holds after one of its calls: its process, the call's number there (calls run
    one at a time, in order) and each resident entry's bytes."""

    pid: int
    seq: int
    resident: dict[str, int]


@dataclass
class _Charge:
    key: str  # the budget's key for this charge (unique: a snapshot charged again gets a new one)
    nbytes: int
    used: int  # when a call last used it (the books' own clock)


class ReplicaAdapters:
    """The books of the replicas' pool entries (see the module docstring). ``drop(replica, snapshot ids)`` asks a
    replica to drop snapshots (it need not wait for the replica). Thread-safe: calls to different replicas reserve
    and settle at the same time, a training run's request may reclaim."""

    def __init__(self, budget: ReplicaBudget | None, drop: Callable[[int, list[str]], None]) -> None:
        self.budget = budget
        self._drop = drop
        self._charged: dict[int, dict[str, _Charge]] = collections.defaultdict(dict)
        self._pins: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._seen: dict[int, tuple[int, int]] = {}  # replica -> (pid, seq) of the last report taken
        self._resident: dict[int, set[str]] = collections.defaultdict(set)
        self._clock = itertools.count()
        self._keys = itertools.count()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The bytes charged for the replicas' entries."""
        with self._lock:
            return sum(c.nbytes for charged in self._charged.values() for c in charged.values())

    def charged(self, replica: int) -> dict[str, int]:
        """The snapshots charged on ``replica`` and their bytes."""
        with self._lock:
            return {sid: c.nbytes for sid, c in self._charged[replica].items()}

    def reserve(self, replica: int, sizes: dict[str, int], pooled: bool) -> None:
        """Pin the call's snapshots (``sizes``: each one's entry bytes) on ``replica``; where the call decodes on
        the pool (``pooled``), charge those not charged there yet, dropping least recently used entries first. A
        call refused leaves everything as it was (unless another charge took the room between the check and the charge:
        the entries dropped for it stay dropped). Every ``reserve`` that returns is followed by one ``settle``."""
        with self._lock:
            now = next(self._clock)
            new = {sid: size for sid, size in sizes.items() if pooled and sid not in self._charged[replica]}
            need = sum(new.values())
            victims: list[tuple[int, str, _Charge]] = []
            refused = None
            if self.budget is not None and need:
                missing = need - self.budget.room()
                if missing > 0:
                    victims = self._victims(missing, exclude=(replica, set(sizes)))
                    freed = sum(c.nbytes for _, _, c in victims)
                    if freed < missing:
                        raise self._refusal(replica, new, freed)
                self._release(victims)
                taken: list[str] = []
                try:
                    for sid, size in new.items():
                        key = f"replica\x00{replica}\x00{sid}\x00{next(self._keys)}"
                        self.budget.charge(key, size)
                        taken.append(key)
                        self._charged[replica][sid] = _Charge(key, size, now)
                except WorkerError:  # another's charge took the room meanwhile: this call's charges go back
                    for sid, key in zip(new, taken):
                        self.budget.release(key)
                        del self._charged[replica][sid]
                    refused = self._refusal(replica, new, 0)
            if refused is None:
                for sid in sizes:
                    self._pins[replica][sid] += 1
                    charge = self._charged[replica].get(sid)
                    if charge is not None:
                        charge.used = now
        self._send_drops(victims)  # given back already: dropped where they are
        if refused is not None:
            raise refused

    def settle(self, replica: int, sizes: dict[str, int], report: Report | None, lost: bool = False) -> None:
        """A call reserved with ``sizes`` is over: unpin its snapshots and take the replica's report (None: the call
        failed without one, its snapshots are taken as resident until the next report; ``lost``: the replica died,
        its pool with it)."""
        with self._lock:
            pins = self._pins[replica]
            for sid in sizes:
                pins[sid] -= 1
                if pins[sid] <= 0:
                    del pins[sid]
            if lost:
                self._seen.pop(replica, None)
                self._resident[replica] = set()
            elif report is None:
                self._resident[replica] |= set(sizes)
            else:
                last = self._seen.get(replica)
                if last is None or last[0] != report.pid or report.seq > last[1]:  # a report older than one taken
                    self._seen[replica] = (report.pid, report.seq)  # is stale (a restarted replica counts anew)
                    self._resident[replica] = set(report.resident)
            gone = [
                (replica, sid, c)
                for sid, c in self._charged[replica].items()
                if sid not in pins and sid not in self._resident[replica]
            ]
            self._release(gone)

    def reclaim(self, size: int) -> int:
        """Drop least recently used unpinned entries until ``size`` bytes are freed (or none is left); the bytes
        freed (the budget's reclaimer, when a training run needs the room)."""
        with self._lock:
            victims = self._victims(size)
            self._release(victims)
        self._send_drops(victims)
        return sum(c.nbytes for _, _, c in victims)

    def forget(self) -> None:
        """Give every charge back (the replicas are gone)."""
        with self._lock:
            self._release([(r, sid, c) for r, charged in self._charged.items() for sid, c in charged.items()])

    def _victims(self, size: int, exclude: tuple[int, set[str]] | None = None) -> list[tuple[int, str, _Charge]]:
        """The least recently used unpinned charges (not ``exclude``'s snapshots on its replica) that free ``size``
        bytes, or all of them where they free less."""
        candidates = sorted(
            (
                (c.used, replica, sid, c)
                for replica, charged in self._charged.items()
                for sid, c in charged.items()
                if sid not in self._pins[replica]
                and not (exclude is not None and replica == exclude[0] and sid in exclude[1])
            ),
            key=lambda item: item[0],
        )
        out, freed = [], 0
        for _, replica, sid, charge in candidates:
            if freed >= size:
                break
            out.append((replica, sid, charge))
            freed += charge.nbytes
        return out

    def _release(self, charges: list[tuple[int, str, _Charge]]) -> None:
        for replica, sid, charge in charges:
            del self._charged[replica][sid]
            if self.budget is not None:
                self.budget.release(charge.key)

    def _send_drops(self, victims: list[tuple[int, str, _Charge]]) -> None:
        by_replica: dict[int, list[str]] = collections.defaultdict(list)
        for replica, sid, _ in victims:
            by_replica[replica].append(sid)
        for replica, sids in by_replica.items():
            self._drop(replica, sids)

    def _refusal(self, replica: int, new: dict[str, int], freed: int) -> WorkerError:
        need, room = sum(new.values()), self.budget.room()
        return WorkerError(
            429,
            "memory_budget_exceeded",
            f"lora: a batch on sampler replica {replica} needs {need} bytes of adapter pool for "
            f"{len(new)} adapter(s) it does not hold; the worker's adapter memory has {max(0, room)} "
            f"bytes free of --max-adapter-bytes-total={self.budget.total}, and dropping the other "
            f"resident sampler adapters not in use would free {freed} more (the rest is training "
            "runs' adapters and adapters of running batches); raise --max-adapter-bytes-total, or "
            "retry when fewer adapters sample at once",
            "lora",
        )

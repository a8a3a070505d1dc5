"""``AdapterPool``: sampler snapshots' LoRA weights kept ready for mixed-adapter decoding, within a byte budget.

A pool entry is one snapshot's LoRA in the layout the decode step multiplies with: per adapted layer ``A``
transposed to (in, rank) and ``B`` transposed to (rank, out) with the LoRA scale (``alpha / rank``) folded in,
both zero-padded to the rank's bucket (8, 16, 32, ... ``RANK_BUCKETS``) in the model's dtype on its device. A
running batch copies an entry into one of its own batch slots once, when the first request for that snapshot
joins (engine/mixed_lora.py), so the decode steps themselves never copy adapter weights.

Entries are kept most recently used last; adding one past ``max_bytes`` evicts the least recently used. An
evicted entry's weights stay where the service keeps the snapshot (host memory, or the checkpoint store on disk)
and are prepared again on the next request for them (``load_seconds`` records how long each load took).

The resident entries also count against the worker's adapter memory (``--max-adapter-bytes-total``, which the
training runs' adapters share) through ``budget``: an entry is charged when it is loaded and given back when it is
evicted. A load that the budget refuses evicts this pool's least recently used entries first and fails only when
none is left; the budget can ask the pool to free bytes (``reclaim``) when a training run needs them.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from server_mock.lora import LORA_ALPHA, Snapshot

__all__ = ["AdapterPool", "PoolBudget", "PoolEntry", "RANK_BUCKETS", "entry_nbytes", "rank_bucket"]

RANK_BUCKETS = (8, 16, 32, 64, 128, 256)


def rank_bucket(rank: int) -> int:
    """The padded rank a LoRA of ``rank`` is stored at: the smallest bucket that holds it."""
    for bucket in RANK_BUCKETS:
        if rank <= bucket:
            return bucket
    raise ValueError(f"lora rank {rank} is above the largest rank bucket {RANK_BUCKETS[-1]} (lower the rank)")


@dataclass
class PoolEntry:
    """One snapshot's LoRA, ready to copy into a batch slot: ``layers[module] = (A^T, scale * B^T)``, padded."""

    key: str
    rank: int
    bucket: int
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    nbytes: int


class PoolBudget(Protocol):
    """Where a pool's resident bytes are counted beside other adapter memory (service/quotas.py's ``PoolCharge``)."""

    def charge(self, key: str, size: int) -> None:
        """Count ``size`` bytes for the entry ``key``, or raise (changing nothing) where they do not fit."""

    def release(self, key: str) -> None:
        """The entry ``key`` is gone: its bytes no longer count."""


@dataclass
class PoolStats:
    loads: int = 0
    hits: int = 0
    evictions: int = 0
    load_seconds: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1024))  # recent loads


def _module_of(key: str) -> tuple[str, str] | None:
    """(module name, "A" or "B") of a PEFT state-dict key (``base_model.model.<module>.lora_A.weight``)."""
    prefix, suffix_a, suffix_b = "base_model.model.", ".lora_A.weight", ".lora_B.weight"
    if not key.startswith(prefix):
        return None
    for suffix, which in ((suffix_a, "A"), (suffix_b, "B")):
        if key.endswith(suffix):
            return key[len(prefix):-len(suffix)], which
    return None


def _halves(snapshot: Snapshot) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Each adapted layer's ``{"A": lora_A, "B": lora_B}``, by module name."""
    halves: dict[str, dict[str, torch.Tensor]] = collections.defaultdict(dict)
    for key, tensor in snapshot.tensors.items():
        where = _module_of(key)
        if where is not None:
            halves[where[0]][where[1]] = tensor
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"snapshot {snapshot.snapshot_id}: layer {module} lacks lora_A or lora_B")
    return sorted(halves.items())


def entry_nbytes(snapshot: Snapshot, dtype: torch.dtype) -> int:
    """The bytes ``prepare`` gives the snapshot's entry (from the tensors' shapes, nothing allocated): where the
    entry is built elsewhere (a sampler replica), what it will take there."""
    bucket = rank_bucket(int(snapshot.spec.rank))
    size = torch.empty((), dtype=dtype).element_size()
    return sum((ab["A"].shape[1] + ab["B"].shape[0]) * bucket * size for _, ab in _halves(snapshot))


def prepare(snapshot: Snapshot, dtype: torch.dtype, device) -> PoolEntry:
    """A snapshot's LoRA in the pool's layout (see the module docstring)."""
    rank = int(snapshot.spec.rank)
    bucket = rank_bucket(rank)
    scale = LORA_ALPHA / rank
    layers, nbytes = {}, 0
    for module, ab in _halves(snapshot):
        a, b = ab["A"].to(device=device, dtype=torch.float32), ab["B"].to(device=device, dtype=torch.float32)
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"snapshot {snapshot.snapshot_id}: layer {module} is not rank {rank}")
        at = torch.zeros((a.shape[1], bucket), dtype=dtype, device=device)
        bt = torch.zeros((bucket, b.shape[0]), dtype=dtype, device=device)
        at[:, :rank] = a.t().to(dtype)
        bt[:rank] = (b.t() * scale).to(dtype)
        layers[module] = (at, bt)
        nbytes += at.numel() * at.element_size() + bt.numel() * bt.element_size()
    return PoolEntry(snapshot.snapshot_id, rank, bucket, layers, nbytes)


class AdapterPool:
    """Snapshots' LoRA weights resident for mixed decoding, least recently used evicted past ``max_bytes`` (and
    where ``budget`` cannot hold another entry). Thread-safe: the model's thread loads, a training run's request
    may reclaim."""

    def __init__(self, max_bytes: int, dtype: torch.dtype, device, budget: PoolBudget | None = None) -> None:
        if max_bytes < 1:
            raise ValueError("adapter_pool_bytes must be at least 1 (raise --adapter-pool-bytes)")
        self.max_bytes, self.dtype, self.device = max_bytes, dtype, device
        self.budget = budget
        self._entries: collections.OrderedDict[str, PoolEntry] = collections.OrderedDict()
        self._lock = threading.RLock()
        self.stats = PoolStats()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def resident(self) -> dict[str, int]:
        """Each resident entry's bytes, least recently used first."""
        with self._lock:
            return {key: entry.nbytes for key, entry in self._entries.items()}

    def keys(self) -> list[str]:
        """Resident snapshot ids, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, snapshot: Snapshot) -> PoolEntry:
        """The snapshot's entry, loaded (and the least recently used evicted) if it is not resident. An entry
        larger than the whole pool is refused with a ValueError naming the option; one that the budget cannot hold
        even with the pool empty, with the budget's error (naming its flag)."""
        with self._lock:
            entry = self._entries.pop(snapshot.snapshot_id, None)
            if entry is not None:
                self.stats.hits += 1
                self._entries[snapshot.snapshot_id] = entry
                return entry
            started = time.perf_counter()
            entry = prepare(snapshot, self.dtype, self.device)
            if entry.nbytes > self.max_bytes:
                raise ValueError(f"a rank-{entry.rank} LoRA takes {entry.nbytes} bytes in the adapter pool, more "
                                 f"than adapter_pool_bytes={self.max_bytes} (raise --adapter-pool-bytes)")
            while self._entries and self.nbytes + entry.nbytes > self.max_bytes:
                self._evict_oldest()
            while self.budget is not None:
                try:
                    self.budget.charge(entry.key, entry.nbytes)
                    break
                except Exception:
                    if not self._entries:
                        raise
                    self._evict_oldest()
            self._entries[snapshot.snapshot_id] = entry
            self.stats.loads += 1
            self.stats.load_seconds.append(time.perf_counter() - started)
            return entry

    def reclaim(self, size: int) -> int:
        """Evict least recently used entries until at least ``size`` bytes are freed (or none is left); the bytes
        freed."""
        freed = 0
        with self._lock:
            while self._entries and freed < size:
                freed += self._evict_oldest()
        return freed

    def drop(self, key: str) -> int:
        """Forget the entry of snapshot ``key`` if it is resident (its holder dropped the snapshot); the bytes freed."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return 0
            self.stats.evictions += 1
            if self.budget is not None:
                self.budget.release(key)
            return entry.nbytes

    def _evict_oldest(self) -> int:
        return self.drop(next(iter(self._entries)))

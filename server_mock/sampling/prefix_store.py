"""Prompt prefixes' KV caches kept across sample requests, so that a prefix many prompts share is prefilled once.

An evaluation or a GRPO step sends many prompts that start with the same tokens (a few-shot conversation, a system
prompt) and differ at the end. ``PrefixStore`` keeps the cache of such a prefix (one row, every full-attention
layer's keys and values) under the weights that computed it and the prefix's tokens; ``DecodeBatch`` prefills a
new prompt's remaining tokens against a copy of it (batch_admission.py). How a prefix is found, as vLLM's automatic
prefix caching does but simpler:

- the longest stored prefix of the prompt (shorter than the prompt: at least one token is prefilled anew), at a
  multiple of ``block`` tokens;
- else the longest common prefix with a prompt seen recently under the same weights (or one arriving with it),
  rounded down to ``block`` tokens, if it is at least ``min_tokens`` long: that prefix is prefilled once and stored.

The weights key is the decoding model and the row's tag (``DecodeBatch``'s ``tag``: which snapshot's rows a model
serving several decodes, ``engine/mixed_lora.py``; a sampler slot's model serves many snapshots under one object).
Models are known by a number given the first time they are seen, never reused, and a model's entries go when it
is garbage-collected, so an entry never serves rows of other weights. Entries are evicted least recently used
first past ``max_bytes``; a prefix larger than the whole budget is used for the prompts it was prefilled for and
not kept. Only caches whose every layer is full attention (``cache_rows.full_attention_only``) are kept: a
sliding window or a recurrent state is not a function of the prefix's tokens alone in a form that can be copied.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from dataclasses import dataclass, field

__all__ = ["PrefixEntry", "PrefixStore", "PrefixStats"]

BLOCK = 16
MIN_TOKENS = 32
RECENT_PROMPTS = 32  # prompts remembered per weights key, to find a shared prefix with
RECENT_KEYS = 16  # weights keys whose recent prompts are remembered


@dataclass
class PrefixEntry:
    """A stored prefix: its weights key, its tokens, its one-row cache and that cache's bytes."""

    key: tuple
    tokens: tuple[int, ...]
    cache: object
    nbytes: int
    stored: bool = False


@dataclass
class PrefixStats:
    """What the store did: prompts that found a stored prefix (``hits``) or none (``misses``: some of them then
    stored one), prefix tokens not prefilled again thanks to a stored or shared prefix, entries stored and evicted,
    and prefixes too large to keep."""

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    stored: int = 0
    evicted: int = 0
    too_large: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Recent:
    prompts: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_PROMPTS))


def cache_bytes(cache) -> int:
    """Bytes of a cache's keys and values."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def _common_length(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixStore:
    """Prefix caches within a byte budget (see the module docstring). One thread uses it (the model's)."""

    def __init__(self, max_bytes: int, block: int = BLOCK, min_tokens: int = MIN_TOKENS) -> None:
        if max_bytes < 1:
            raise ValueError("prefix_cache_bytes must be at least 1 to keep prefixes (0 turns prefix reuse off: "
                             "pass --prefix-cache-bytes 0 instead of making a store)")
        if block < 1 or min_tokens < block:
            raise ValueError("a prefix store needs block >= 1 and min_tokens >= block")
        self.max_bytes, self.block, self.min_tokens = max_bytes, block, min_tokens
        self.bytes = 0
        self.stats = PrefixStats()
        self._entries: collections.OrderedDict[tuple, PrefixEntry] = collections.OrderedDict()  # LRU last
        self._recent: collections.OrderedDict[tuple, _Recent] = collections.OrderedDict()
        self._numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._count = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    # --- keys ----------------------------------------------------------------------------------------------

    def weights_key(self, model, tag: str) -> tuple:
        """The key of the weights a row decodes with: the model (a number of its own) and the row's tag."""
        number = self._numbers.get(model)
        if number is None:
            number = next(self._count)
            self._numbers[model] = number
            weakref.finalize(model, self._forget, number)
        return (number, tag)

    def _forget(self, number: int) -> None:
        for key in [k for k in self._entries if k[0][0] == number]:
            self.bytes -= self._entries.pop(key).nbytes
        for key in [k for k in self._recent if k[0] == number]:
            del self._recent[key]

    # --- finding a prefix ----------------------------------------------------------------------------------

    def _usable(self, n: int, prompt_len: int) -> int:
        """``n`` rounded down to a block and below the prompt's length; 0 if shorter than ``min_tokens``."""
        n = min(n, prompt_len - 1) // self.block * self.block
        return n if n >= self.min_tokens else 0

    def lookup(self, key: tuple, prompt: list[int]) -> PrefixEntry | None:
        """The longest stored prefix of ``prompt`` under ``key`` (None if none); counts a hit or a miss."""
        longest = self._usable(len(prompt), len(prompt))
        for n in range(longest, self.min_tokens - 1, -self.block):
            entry = self._entries.get((key, tuple(prompt[:n])))
            if entry is not None:
                self._entries.move_to_end(entry_key(entry))
                self.stats.hits += 1
                self.stats.tokens_reused += n
                return entry
        self.stats.misses += 1
        return None

    def shared_length(self, key: tuple, prompt: list[int], arriving=()) -> int:
        """The length of the prefix ``prompt`` shares with a recent prompt of ``key`` or one of ``arriving`` (the
        prompts prefilled with it), rounded down to a block; 0 when under ``min_tokens``."""
        recent = self._recent.get(key)
        others = itertools.chain(recent.prompts if recent else (), arriving)
        best = max((_common_length(prompt, other) for other in others if other is not prompt), default=0)
        return self._usable(best, len(prompt))

    def remember(self, key: tuple, prompt: list[int]) -> None:
        """Keep ``prompt`` among ``key``'s recent prompts (the last ``RECENT_PROMPTS`` of the last ``RECENT_KEYS``
        keys)."""
        recent = self._recent.pop(key, None) or _Recent()
        recent.prompts.append(list(prompt))
        self._recent[key] = recent
        while len(self._recent) > RECENT_KEYS:
            self._recent.popitem(last=False)

    # --- storing -------------------------------------------------------------------------------------------

    def put(self, key: tuple, tokens: list[int], cache) -> PrefixEntry:
        """Keep a prefix's one-row cache (evicting the least recently used past the budget); the entry, stored or
        not (a prefix larger than the whole budget is handed back unstored)."""
        entry = PrefixEntry(key, tuple(tokens), cache, cache_bytes(cache))
        if entry.nbytes > self.max_bytes:
            self.stats.too_large += 1
            return entry
        old = self._entries.pop(entry_key(entry), None)
        if old is not None:
            self.bytes -= old.nbytes
        while self._entries and self.bytes + entry.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.nbytes
            self.stats.evicted += 1
        self._entries[entry_key(entry)] = entry
        self.bytes += entry.nbytes
        entry.stored = True
        self.stats.stored += 1
        return entry

    def entries(self) -> list[PrefixEntry]:
        """The stored entries, least recently used first."""
        return list(self._entries.values())


def entry_key(entry: PrefixEntry) -> tuple:
    return (entry.key, entry.tokens)

"""How a forward/backward call's datums are batched within the token budget: micro-batches of whole datums, and
which datums share a prompt prefix and how their prefix and remainder passes are batched."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Plan", "PrefixBatch", "PrefixGroup", "batch_groups", "chunk_batch", "find_groups", "micro_batches", "plan",
           "shared_budget"]


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group datums of similar length so that (rows x longest) stays within the token budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = max([lengths[i] for i in current] + [lengths[index]])
        if current and longest * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def shared_budget(lengths: list[int], budget: int) -> int:
    """The tokens a prefix-shared pass may hold at once (its prompts plus a chunk of remainders): the padded
    tokens of the largest micro-batch the unshared path would run on the same datums, so sharing never peaks
    higher in memory than running every datum in full."""
    if not lengths:
        return budget
    return max(len(b) * max(lengths[i] for i in b) for b in micro_batches(lengths, budget))


@dataclass(frozen=True)
class PrefixGroup:
    prefix_len: int  # every member has at least one token after the prefix
    members: tuple[int, ...]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays, leaving at least one token of each after it."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return min(int(differ[0]) if len(differ) else m, m - 1)


def find_groups(sequences: list[np.ndarray], min_tokens: int) -> list[PrefixGroup]:
    """Groups of datums whose shared prefix (>= ``min_tokens``) saves the most recomputed tokens.

    Sorted lexicographically, the common prefix of a run of sequences is the minimum of its neighbours' common
    prefixes. Joining neighbours in decreasing order of that value builds the runs bottom-up; each run either
    stays one group (saving ``(size - 1) * prefix`` tokens) or keeps its two halves' best grouping, whichever
    saves more.
    """
    if min_tokens <= 0 or len(sequences) < 2:
        return []
    order = sorted(range(len(sequences)), key=lambda i: sequences[i].tolist())
    lcp = [_common_prefix(sequences[order[k]], sequences[order[k + 1]]) for k in range(len(order) - 1)]
    # run data keyed by its first sorted position: (last position, tokens saved, chosen groups as (prefix, lo, hi))
    runs: dict[int, tuple[int, int, list[tuple[int, int, int]]]] = {k: (k, 0, []) for k in range(len(order))}
    start_of = list(range(len(order)))  # last position of a run -> its first position
    for k in sorted(range(len(lcp)), key=lambda k: -lcp[k]):
        m = lcp[k]
        if m < min_tokens:
            break
        lo = start_of[k]
        _, saved_left, groups_left = runs.pop(lo)
        hi, saved_right, groups_right = runs.pop(k + 1)
        together = (hi - lo) * m
        if together >= saved_left + saved_right:
            runs[lo] = (hi, together, [(m, lo, hi)])
        else:
            runs[lo] = (hi, saved_left + saved_right, groups_left + groups_right)
        start_of[hi] = lo
    groups = [PrefixGroup(m, tuple(order[lo:hi + 1])) for _, _, chosen in runs.values() for m, lo, hi in chosen]
    return sorted(groups, key=lambda g: g.members[0])


@dataclass(frozen=True)
class PrefixBatch:
    """Groups whose prompts run together in one prefix pass, each cut to the same ``prefix_len``."""

    prefix_len: int
    groups: tuple[PrefixGroup, ...]

    def rows(self) -> list[tuple[int, int]]:
        """(datum index, prefix row) of every member."""
        return [(i, row) for row, g in enumerate(self.groups) for i in g.members]


def batch_groups(groups: list[PrefixGroup], budget: int, slack: float = 0.9) -> list[PrefixBatch]:
    """Put groups with prefixes of similar length into one prefix pass of ``rows x prefix_len <= budget``.

    A batch runs every prompt cut to its shortest member's prefix (still shared, so still exact); ``slack`` is the
    shortest prefix a batch accepts relative to its longest (the tokens cut are recomputed by each datum).
    Fewer, larger passes matter most on CPUs and GPUs alike: per-operation overheads do not shrink with the batch.
    """
    batches: list[list[PrefixGroup]] = []
    for group in sorted(groups, key=lambda g: -g.prefix_len):
        current = batches[-1] if batches else None
        if current and group.prefix_len >= slack * current[0].prefix_len and \
                (len(current) + 1) * group.prefix_len <= budget:
            current.append(group)
        else:
            batches.append([group])
    return [PrefixBatch(min(g.prefix_len for g in b), tuple(b)) for b in batches]


def chunk_batch(batch: PrefixBatch, lengths: list[int], budget: int) -> list[list[tuple[int, int]]]:
    """Split a batch's members into chunks whose padded remainders fit ``budget`` minus the prefixes held."""
    capacity = max(budget - len(batch.groups) * batch.prefix_len, 1)
    chunks: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    for index, row in sorted(batch.rows(), key=lambda m: lengths[m[0]]):
        longest = lengths[index] - batch.prefix_len  # sorted: the newcomer is the longest remainder
        if current and longest * (len(current) + 1) > capacity:
            chunks.append(current)
            current = []
        current.append((index, row))
    if current:
        chunks.append(current)
    return chunks



@dataclass(frozen=True)
class Plan:
    """The passes of one forward/backward call: each prefix pass with its chunks of (datum, prefix row), then the
    micro-batches of datums run in full."""

    shared: list[tuple[PrefixBatch, list[list[tuple[int, int]]]]]
    rest: list[list[int]]


def plan(sequences: list[np.ndarray], budget: int, min_tokens: int) -> Plan:
    """How to run ``sequences`` within ``budget`` padded tokens, sharing prefixes of >= ``min_tokens`` (0: never)."""
    lengths = [len(s) for s in sequences]
    groups = find_groups(sequences, min_tokens)
    held = shared_budget(lengths, budget) if groups else budget
    shared = [(batch, chunk_batch(batch, lengths, held)) for batch in batch_groups(groups, held)]
    grouped = {i for g in groups for i in g.members}
    rest = [i for i in range(len(sequences)) if i not in grouped]
    return Plan(shared, [[rest[i] for i in b] for b in micro_batches([lengths[i] for i in rest], budget)])

"""Run a prompt shared by several datums once per forward/backward call, exactly.

In GRPO a batch holds groups of completions of one prompt. Instead of running ``prompt + completion`` for every
datum, the worker runs the shared prefix once (batch 1), keeps each layer's cached states, and runs every datum's
remainder against them (right-padded, explicit positions, an attention mask covering prefix + remainder).

Gradients: the cached states and the prefix logits enter the remainder passes as detached leaves. Each chunk of
remainders backpropagates into the LoRA weights and into those leaves; after the group's last chunk one backward
pass carries the leaves' accumulated gradients through the prefix. The result is the gradient of the unshared
computation (sums in a different order: equal to float rounding).

The cache objects are transformers' ``DynamicCache`` whose layers are made side-effect free: during the prefix
pass they only record what the model hands them, during a remainder pass they return ``prefix ++ new`` without
storing anything. So a layer that activation checkpointing runs twice sees the same states both times, and no
cached tensor is ever written in place (which would break autograd). Layer kinds handled: full attention, sliding
window, linear attention (conv + recurrent states, e.g. Qwen3.5). Any other kind, or a model whose probe
(``probe``) does not reproduce the unshared computation, takes the unshared path.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

logger = logging.getLogger("server_mock")

__all__ = ["PrefixBatch", "PrefixGroup", "SharedPrefix", "batch_groups", "chunk_batch", "find_groups", "probe",
           "supports_cache_layers"]

Forward = Callable[..., torch.Tensor]  # model keyword inputs -> logits [B, T, V]


# --- which datums share a prefix ---------------------------------------------------------------------------------

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


# --- side-effect-free cache layers -----------------------------------------------------------------------------

def _cache_classes():
    from transformers import cache_utils

    return cache_utils


_HANDLED_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer", "DummyLayer",
                   "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer")


def supports_cache_layers(config) -> str | None:
    """None if every layer of this model's ``DynamicCache`` is a kind handled here, else the first one that is not."""
    for layer in _cache_classes().DynamicCache(config=config).layers:
        if type(layer).__name__ not in _HANDLED_LAYERS:
            return type(layer).__name__
    return None


def _is_kv(layer) -> bool:
    return isinstance(layer, _cache_classes().DynamicLayer)


def _is_linear(layer) -> bool:
    return isinstance(layer, _cache_classes().LinearAttentionCacheLayerMixin)


# The replacement methods below are closures over plain dicts and tensors, never over the layer itself: a method
# bound to its own layer would make a reference cycle, and the prefix's whole autograd graph would then live until
# Python's cycle collector happened to run.

def _recording_cache(config) -> tuple[object, list[dict]]:
    """A cache for the prefix pass whose layers record the states they are given (returned per layer) and store
    nothing the model reads."""
    cache = _cache_classes().DynamicCache(config=config)
    records: list[dict] = []
    for layer in cache.layers:
        record: dict = {}
        records.append(record)
        if _is_kv(layer):
            layer.update = _recording_kv(record)
        if _is_linear(layer):
            layer.update_conv_state, layer.update_recurrent_state = _recording_linear(record)
    return cache, records


def _recording_kv(record: dict):
    def update(keys, values, *args, **kwargs):
        record["kv"] = (keys, values)
        return keys, values
    return update


def _recording_linear(record: dict):
    def update_conv_state(conv, state_idx=0, conv_kernel_size=None, **kwargs):
        size = conv_kernel_size or conv.shape[-1]
        full = conv if conv.shape[-1] >= size else nn.functional.pad(conv, (size - conv.shape[-1], 0))
        record[("conv", state_idx)] = (full[..., -size:], size)
        return full

    def update_recurrent_state(state, state_idx=0, **kwargs):
        record[("recurrent", state_idx)] = state
        return state
    return update_conv_state, update_recurrent_state


def _select(tensor: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """Row ``which[i]`` of the prefix states for each remainder row (a view when there is one prefix)."""
    if tensor.shape[0] == 1:
        return tensor.expand(len(which), *tensor.shape[1:])
    return tensor.index_select(0, which)


def _replay_cache(config, states: list[dict], prefix_len: int, which: torch.Tensor):
    """A cache holding, for each row, the states of prefix ``which[row]``; updates return ``prefix ++ new`` and
    store nothing."""
    cache = _cache_classes().DynamicCache(config=config)
    for layer, saved in zip(cache.layers, states):
        if "kv" in saved:
            keys, values = (_select(t, which) for t in saved["kv"])
            layer.keys, layer.values, layer.is_initialized = keys, values, True
            layer.device = keys.device
            if isinstance(layer, _cache_classes().DynamicSlidingWindowLayer):
                layer.cumulative_length = prefix_len
            layer.update = _replaying_kv(keys, values)
        if _is_linear(layer):
            layer.record_past = True  # never the single-token path, which updates the conv state in place
            conv: dict[int, torch.Tensor] = {}
            for key, value in saved.items():
                if key == "kv":
                    continue
                kind, idx = key
                if kind == "conv":
                    tensor, size = value
                    conv[idx] = layer.conv_states[idx] = _select(tensor, which)
                    layer.conv_kernel_size[idx] = size
                    layer.is_conv_states_initialized[idx] = True
                    layer.has_previous_state[idx] = True
                    layer.device, layer.dtype = tensor.device, tensor.dtype
                elif kind == "recurrent":
                    layer.recurrent_states[idx] = _select(value, which)
                    layer.is_recurrent_states_initialized[idx] = True
                    layer.has_previous_state[idx] = True
            layer.update_conv_state, layer.update_recurrent_state = _replaying_linear(conv)
    return cache


def _replaying_kv(keys: torch.Tensor, values: torch.Tensor):
    def update(new_keys, new_values, *args, **kwargs):
        return torch.cat([keys, new_keys], dim=-2), torch.cat([values, new_values], dim=-2)
    return update


def _replaying_linear(conv: dict[int, torch.Tensor]):
    def update_conv_state(new_conv, state_idx=0, **kwargs):
        return torch.cat([conv[state_idx], new_conv], dim=-1)

    def update_recurrent_state(state, state_idx=0, **kwargs):
        return state
    return update_conv_state, update_recurrent_state


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; use whichever this model's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"


# --- one shared prefix -------------------------------------------------------------------------------------------

class SharedPrefix:
    """Prefixes [P, L] run once together; ``remainder_logits`` runs rows after them; ``backward`` finishes the
    prefixes' gradient."""

    def __init__(self, forward: Forward, config, cache_kwarg: str, prefix_ids: torch.Tensor):
        self._forward, self._config, self._cache_kwarg = forward, config, cache_kwarg
        self.prefix_len = int(prefix_ids.shape[1])
        self._roots: list[torch.Tensor] = []
        self._leaves: list[torch.Tensor] = []
        cache, records = _recording_cache(config)
        positions = torch.arange(self.prefix_len, device=prefix_ids.device).expand_as(prefix_ids)
        logits = forward(input_ids=prefix_ids, attention_mask=torch.ones_like(prefix_ids),
                         position_ids=positions, use_cache=True, **{cache_kwarg: cache})
        self.logits = self._leaf(logits)  # [P, L, V]
        self._states: list[dict] = []
        for layer, record in zip(cache.layers, records):
            saved: dict = {}
            for key, value in record.items():
                if key == "kv":
                    keys, values = value
                    if isinstance(layer, _cache_classes().DynamicSlidingWindowLayer):
                        keep = layer.sliding_window - 1  # what the layer itself keeps for the next tokens
                        keys, values = keys[:, :, -keep:], values[:, :, -keep:]
                    saved[key] = (self._leaf(keys), self._leaf(values))
                elif key[0] == "conv":
                    saved[key] = (self._leaf(value[0]), value[1])
                else:
                    saved[key] = self._leaf(value)
            self._states.append(saved)

    def _leaf(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.requires_grad:
            return tensor
        leaf = tensor.detach().requires_grad_(True)
        self._roots.append(tensor)
        self._leaves.append(leaf)
        return leaf

    def remainder_logits(self, ids: torch.Tensor, attention: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """Logits [rows, R, V] of right-padded remainders ``ids`` [rows, R] (``attention`` 1 on real tokens), row i
        following prefix ``which[i]``."""
        rows, length = ids.shape
        cache = _replay_cache(self._config, self._states, self.prefix_len, which)
        mask = torch.cat([attention.new_ones((rows, self.prefix_len)), attention], dim=1)
        positions = (torch.arange(length, device=ids.device) + self.prefix_len).expand(rows, length)
        return self._forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self._cache_kwarg: cache})

    def backward(self) -> None:
        """Carry the gradients accumulated on the prefix's states and logits through the prefix pass."""
        # a zero gradient (prompt positions without weight, as in most RL datums) needs no backward pass
        pairs = [(root, leaf.grad) for root, leaf in zip(self._roots, self._leaves)
                 if leaf.grad is not None and bool(leaf.grad.any())]
        if pairs:
            torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        self._roots, self._leaves, self._states = [], [], []


# --- per-model probe ---------------------------------------------------------------------------------------------

# (prefix row, remainder length) per chunk: right padding, two prefixes in one chunk, a one-token remainder alone
_PROBE_LAYOUTS = ((((0, 4), (0, 2)), ((0, 1),)), (((0, 4), (1, 2)), ((1, 1),)))


def probe(model: nn.Module, forward: Forward, token_logprobs, vocab_size: int,
          half_precision: bool = False) -> str | None:
    """None if the shared path reproduces the unshared one on this model (logprobs and input gradients), else why.

    Runs on a few random tokens (milliseconds), with one prefix and with two prefixes in one pass. The prefix is
    longer than a small sliding window, so the window edge is crossed. ``half_precision``: the forward runs under
    bf16 autocast, so the tolerance is bf16's. Parameters are frozen meanwhile; a zero
    offset added to the input embeddings carries the gradient, which must flow through the cached states exactly
    as through the full sequences.
    """
    config = model.config
    unsupported = supports_cache_layers(config)
    if unsupported:
        return f"cache layer {unsupported} is not handled"
    window = getattr(config.get_text_config(), "sliding_window", None) or 0
    prefix_len = min(max(7, window + 3), 64)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    # float32: equal to rounding. bf16 (weights or autocast): the two paths round differently by ~1e-2, while a
    # wrong position, mask or state moves random-token logprobs by far more
    tol = 1e-4 if dtype == torch.float32 and not half_precision else 0.25
    gen = torch.Generator().manual_seed(0)
    low = min(3, vocab_size - 1)
    prefixes = torch.randint(low, vocab_size, (2, prefix_len), generator=gen)
    flags = {p: p.requires_grad for p in model.parameters()}
    offset = torch.zeros(model.get_input_embeddings().embedding_dim, device=device, dtype=dtype, requires_grad=True)
    hook = model.get_input_embeddings().register_forward_hook(lambda mod, args, out: out + offset)
    gaps = []
    try:
        for p in flags:
            p.requires_grad_(False)
        for layout in _PROBE_LAYOUTS:
            chunks = [[(row, torch.randint(low, vocab_size, (n,), generator=gen)) for row, n in chunk]
                      for chunk in layout]
            used = prefixes[:1 + max(row for chunk in layout for row, _ in chunk)]
            shared_lp, shared_grad = _probe_shared(model, forward, token_logprobs, used, chunks, offset, device)
            full_lp, full_grad = _probe_unshared(forward, token_logprobs, used, chunks, offset, device)
            gaps.append((float((shared_lp - full_lp).abs().max()),
                         float((shared_grad - full_grad).abs().max() / full_grad.abs().max().clamp(min=1e-12))))
    except Exception as exc:  # noqa: BLE001 - any failure of the shared path means: do not take it
        return f"{type(exc).__name__}: {exc}"
    finally:
        hook.remove()
        for p, flag in flags.items():
            p.requires_grad_(flag)
    lp_gap, grad_gap = max(g[0] for g in gaps), max(g[1] for g in gaps)
    if lp_gap > tol or grad_gap > tol * 10:
        return f"results differ from the unshared path (logprobs by {lp_gap:.2e}, gradients by {grad_gap:.2e})"
    return None


def _probe_rows(prefixes, chunk):
    """Full sequences of a probe chunk and their targets (each sequence rolled by one: any fixed targets do)."""
    seqs = [torch.cat([prefixes[row], r]) for row, r in chunk]
    return seqs, [torch.roll(s, -1) for s in seqs]


def _padded(rows, device):
    length = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], attention[i, :len(r)] = r, 1
    return ids.to(device), attention.to(device)


def _weighted_sum(rows: list[torch.Tensor]) -> torch.Tensor:
    return sum((row * torch.linspace(0.5, 1.5, len(row)).to(row)).sum() for row in rows)


def _probe_shared(model, forward, token_logprobs, prefixes, chunks, offset, device):
    n = prefixes.shape[1]
    shared = SharedPrefix(forward, model.config, _cache_kwarg(model), prefixes.to(device))
    out = []
    for chunk in chunks:
        seqs, targets = _probe_rows(prefixes, chunk)
        which = torch.tensor([row for row, _ in chunk], device=device)
        ids, attention = _padded([s[n:] for s in seqs], device)
        rest_targets, _ = _padded([t[n:] for t in targets], device)
        prefix_targets = torch.stack([t[:n] for t in targets]).to(device)
        lp = torch.cat([token_logprobs(shared.logits, prefix_targets, which),
                        token_logprobs(shared.remainder_logits(ids, attention, which), rest_targets)], dim=1)
        rows = [lp[i, :len(s)] for i, s in enumerate(seqs)]
        _weighted_sum(rows).backward()
        out.extend(row.detach() for row in rows)
    shared.backward()
    grad = offset.grad.clone()
    offset.grad = None
    return torch.cat(out).float(), grad.float()


def _probe_unshared(forward, token_logprobs, prefixes, chunks, offset, device):
    out = []
    for chunk in chunks:
        seqs, targets = _probe_rows(prefixes, chunk)
        ids, attention = _padded(seqs, device)
        target_ids, _ = _padded(targets, device)
        lp = token_logprobs(forward(input_ids=ids, attention_mask=attention, use_cache=False), target_ids)
        rows = [lp[i, :len(s)] for i, s in enumerate(seqs)]
        _weighted_sum(rows).backward()
        out.extend(row.detach() for row in rows)
    grad = offset.grad.clone()
    offset.grad = None
    return torch.cat(out).float(), grad.float()

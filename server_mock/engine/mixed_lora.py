"""Decoding rows of different LoRA adapters of one base model as one batch.

Every adapted projection computes ``y = x W + (x A_s) (s B_s)`` for each row with the row's adapter ``s``. The
base product ``x W`` runs once over all rows of the batch; the LoRA part runs for all rows at once as two
batched matmuls over the batch's slots: the rows are laid out by slot into a padded ``(slots, rows, in)``
block (one index_select), multiplied by the stacked ``A`` (slots, in, rank) and ``B`` (slots, rank, out) of
``BatchSlots``, and put back in row order (another index_select). The adapter weights are read in place: an
adapter is copied into a batch slot once, when its first request joins (from the ``AdapterPool``'s prepared
entry), and never per step. Ranks are zero-padded to a bucket, so the padded part adds exact zeros.

Where every row of a forward call has one adapter (a prefill, or a batch of one adapter) the LoRA part is the
plain two matmuls on that slot's weights. Rows with no adapter (the base model) use an all-zero slot.

``invariant`` (``--batch-invariant``): every projection, base and LoRA (at the adapter's own rank), runs per
request on that request's rows alone, and so does the attention (torch's CPU attention kernel is not batch
invariant for one-token queries: the call is split by request while such a forward runs on this thread) and the
rotary embedding's cos/sin (computed per row: a vectorised cos of more positions rounds its tail differently), so each
kernel sees the shapes it sees when the request decodes alone, and a request's tokens and logprobs are
bit-identical to decoding it alone on this path (the price: one call per request per layer, docs/benchmarks.md).

The base model is never modified: ``forward`` puts ``_MixedLinear`` modules in place of the adapted layers (the
plain Linear or PEFT's LoRA layer) for one call and puts them back afterwards, also when the call fails, so PEFT's
adapters (training runs, sampler slots) are neither used nor touched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from server_mock.engine.adapter_pool import AdapterPool, PoolEntry

__all__ = ["BatchSlots", "MixedLoraDecoder"]


class BatchSlots:
    """The stacked LoRA weights of one running batch: per adapted layer ``A`` (slots, in, rank) and ``B`` (slots,
    rank, out); a slot per adapter with requests in the batch, reference counted. A freed slot keeps its weights
    until another adapter needs it, so a request for an adapter that just left takes it back without a copy."""

    def __init__(self, shapes: dict[str, tuple[int, int]], dtype: torch.dtype, device) -> None:
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.capacity, self.rank = 0, 0
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        self.key_of: list[str | None] = []  # the adapter whose weights each slot holds ("" for none yet)
        self.refs: list[int] = []
        self.entries: list[PoolEntry | None] = []  # each slot's pool entry (its own rank bucket, unpadded)
        self.copies = 0  # adapters copied into a slot (the decode steps make none)

    def slot(self, key: str) -> int:
        """The slot of an adapter with requests in the batch (KeyError if it has none)."""
        index = self.key_of.index(key)
        if self.refs[index] <= 0:
            raise KeyError(key)
        return index

    def acquire(self, key: str, entry: PoolEntry | None, count: int = 1) -> int:
        """A slot holding ``entry``'s weights (``None``: all zero, the base model) for ``count`` more requests."""
        if key in self.key_of:
            index = self.key_of.index(key)
            self.refs[index] += count
            return index
        bucket = entry.bucket if entry is not None else 8
        free = [i for i, refs in enumerate(self.refs) if refs <= 0]
        if not free:
            self._grow(max(4, 2 * self.capacity), max(self.rank, bucket))
            free = [i for i, refs in enumerate(self.refs) if refs <= 0]
        elif bucket > self.rank:
            self._grow(self.capacity, bucket)
        layers = entry.layers if entry is not None else {}
        for name in layers:
            if name not in self.A:
                self._add_layer(name)
        index = free[0]
        with torch.no_grad():
            for name in self.A:
                a, b = self.A[name][index], self.B[name][index]
                if name in layers:
                    at, bt = layers[name]
                    a[:, :at.shape[1]].copy_(at)
                    a[:, at.shape[1]:].zero_()
                    b[:bt.shape[0]].copy_(bt)
                    b[bt.shape[0]:].zero_()
                else:
                    a.zero_()
                    b.zero_()
        self.copies += 1
        self.key_of[index], self.refs[index], self.entries[index] = key, count, entry
        return index

    def release(self, key: str) -> None:
        """One request for ``key`` has left the batch."""
        index = self.key_of.index(key)
        self.refs[index] -= 1

    @property
    def used(self) -> int:
        return sum(1 for refs in self.refs if refs > 0)

    def _add_layer(self, name: str) -> None:
        n_in, n_out = self.shapes[name]
        self.A[name] = torch.zeros((self.capacity, n_in, self.rank), dtype=self.dtype, device=self.device)
        self.B[name] = torch.zeros((self.capacity, self.rank, n_out), dtype=self.dtype, device=self.device)

    def _grow(self, capacity: int, rank: int) -> None:
        """More slots or a larger rank bucket: one copy of the weights held so far (not per step)."""
        for name in list(self.A):
            n_in, n_out = self.shapes[name]
            a = torch.zeros((capacity, n_in, rank), dtype=self.dtype, device=self.device)
            b = torch.zeros((capacity, rank, n_out), dtype=self.dtype, device=self.device)
            a[:self.capacity, :, :self.rank] = self.A[name]
            b[:self.capacity, :self.rank] = self.B[name]
            self.A[name], self.B[name] = a, b
        self.key_of += [""] * (capacity - self.capacity)
        self.refs += [0] * (capacity - self.capacity)
        self.entries += [None] * (capacity - self.capacity)
        self.capacity, self.rank = capacity, rank


@dataclass
class _Plan:
    """How one forward call's rows map to slots: one slot for all (``one``), per-request segments (invariant),
    or the padded (slots, rows) layout of the batched matmuls, whose index tensors depend on tokens per row."""

    rows: int
    one: int | None = None
    segments: list[tuple[int, int, int]] | None = None
    groups: int = 0
    width: int = 0
    positions: list[int] = field(default_factory=list)  # each row's place in the (groups x width) layout
    in_place: bool = False  # every row already at its place (rows slot after slot, ``width`` each)
    _index: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def index(self, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(gather rows into the padded layout, gather them back) for ``tokens`` tokens per row."""
        if tokens not in self._index:
            pad = [0] * (self.groups * self.width)  # empty places read row 0; their results are never read
            for row, place in enumerate(self.positions):
                pad[place] = row
            step = torch.arange(tokens)
            pad_t = (torch.tensor(pad)[:, None] * tokens + step).flatten()
            unpad_t = (torch.tensor(self.positions)[:, None] * tokens + step).flatten()
            self._index[tokens] = (pad_t.to(device), unpad_t.to(device))
        return self._index[tokens]


_per_request = threading.local()  # the segments of the invariant forward running on this thread, if any
_sdpa = F.scaled_dot_product_attention


def _segmented_attention(query, key, value, attn_mask=None, *args, **kwargs):
    """``scaled_dot_product_attention``, split by request while an invariant forward runs on this thread (the
    same call otherwise)."""
    segments = getattr(_per_request, "segments", None)
    if segments is None or query.dim() != 4 or query.shape[0] != segments[-1][1]:
        return _sdpa(query, key, value, attn_mask, *args, **kwargs)
    parts = []
    for s, e, _ in segments:
        k, v, mask = key[s:e], value[s:e], attn_mask
        if mask is not None and mask.dim() == 4:
            # the columns no row of the request sees (the left padding of a shorter prompt) are dropped, and a mask
            # that then hides nothing with them: the call the request makes alone
            mask = mask[s:e] if mask.shape[0] > 1 else mask
            seen = mask if mask.dtype == torch.bool else mask == 0
            first = int(seen.any(dim=2).any(dim=1).any(dim=0).to(torch.int8).argmax())
            k, v, mask = k[:, :, first:], v[:, :, first:], mask[..., first:]
            if bool(seen[..., first:].all()):
                mask = None
        q = query[s:e]
        if mask is not None or q.shape[1] != k.shape[1] or q.shape[2] == 1 or args or kwargs.get("is_causal"):
            parts.append(_sdpa(q, k, v, mask, *args, **kwargs))
            continue
        # transformers packs a one-token query's head groups (rows, kv heads, group, dim) when it passes a mask;
        # with nothing masked the request alone is called unpacked, with enable_gqa: so is it here
        rows, heads, group, dim = q.shape
        out = _sdpa(q.reshape(rows, heads * group, 1, dim), k, v, None, **{**kwargs, "enable_gqa": True})
        parts.append(out.reshape(rows, heads, group, dim))
    return torch.cat(parts)


def _install_segmented_attention() -> None:
    if F.scaled_dot_product_attention is not _segmented_attention:
        F.scaled_dot_product_attention = _segmented_attention


class _PerRowRotary(nn.Module):
    """A rotary embedding computed one row of positions at a time (its cos/sin have a row's shape, as alone)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, x, position_ids=None, *args, **kwargs):
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] == 1:
            return self.rotary(x, position_ids, *args, **kwargs)
        rows = [self.rotary(x[i:i + 1] if x.shape[0] == position_ids.shape[0] else x, position_ids[i:i + 1],
                            *args, **kwargs) for i in range(position_ids.shape[0])]
        return tuple(torch.cat(parts) for parts in zip(*rows))


class _MixedLinear(nn.Module):
    """An adapted layer for one forward call: the base layer plus each row's slot's LoRA (see the module doc)."""

    def __init__(self, base: nn.Module, name: str, decoder: "MixedLoraDecoder") -> None:
        super().__init__()
        self.base, self.name = base, name
        object.__setattr__(self, "decoder", decoder)  # not a submodule (no cycle in the module tree)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots, plan = self.decoder.slots, self.decoder.plan
        a_all, b_all = slots.A.get(self.name), slots.B.get(self.name)
        if plan.segments is not None:  # per request, each adapter at its own rank: the shapes it has alone
            parts = []
            for s, e, slot in plan.segments:
                part = self.base(x[s:e])
                entry = slots.entries[slot]
                if entry is not None and self.name in entry.layers:
                    a, b = entry.layers[self.name]
                    part = part + _delta(x[s:e], a, b).to(part.dtype)
                parts.append(part)
            return torch.cat(parts)
        y = self.base(x)
        if a_all is None:
            return y
        if plan.one is not None:
            return y + _delta(x, a_all[plan.one], b_all[plan.one]).to(y.dtype)
        if x.shape[0] != plan.rows:
            raise ValueError(f"a mixed-adapter forward got {x.shape[0]} rows for {plan.rows} row adapters")
        flat = x.reshape(-1, x.shape[-1]).to(a_all.dtype)
        if plan.in_place:  # the rows already lie slot after slot, as many for each: a view, no gather
            padded = flat.view(plan.groups, flat.shape[0] // plan.groups, -1)
            delta = torch.bmm(torch.bmm(padded, a_all[:plan.groups]), b_all[:plan.groups])
            return y + delta.view(*y.shape[:-1], -1).to(y.dtype)
        pad, unpad = plan.index(flat.shape[0] // plan.rows, x.device)
        width = pad.shape[0] // plan.groups
        padded = flat.index_select(0, pad).view(plan.groups, width, -1)
        delta = torch.bmm(torch.bmm(padded, a_all[:plan.groups]), b_all[:plan.groups])
        delta = delta.view(plan.groups * width, -1).index_select(0, unpad)
        return y + delta.view(*y.shape[:-1], -1).to(y.dtype)


def _delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The LoRA part for rows of one slot: (x A) (s B), in the slots' dtype."""
    return (x.to(a.dtype) @ a) @ b


class MixedLoraDecoder(nn.Module):
    """The base model with each row's adapter applied from ``BatchSlots`` (see the module docstring). Call
    ``select_rows`` before each forward with the adapter of every row of its batch."""

    def __init__(self, model: nn.Module, layer_names, pool: AdapterPool, invariant: bool = False) -> None:
        super().__init__()
        self.inner = model
        self.pool, self.invariant = pool, invariant
        self._swaps = []
        shapes = {}
        for name in layer_names:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            current = parent._modules[attr]
            base = getattr(current, "base_layer", current)
            shapes[name] = (int(base.in_features), int(base.out_features))
            self._swaps.append((parent, attr, _MixedLinear(base, name, self)))
        weight = next(model.parameters())
        self.slots = BatchSlots(shapes, weight.dtype, weight.device)
        self.plan = _Plan(rows=0)
        self.config = model.config
        if invariant:
            _install_segmented_attention()
            for name, module in model.named_modules():
                if type(module).__name__.endswith("RotaryEmbedding") and name:
                    parent_name, _, attr = name.rpartition(".")
                    parent = model.get_submodule(parent_name) if parent_name else model
                    self._swaps.append((parent, attr, _PerRowRotary(module)))

    # --- which adapters are in the batch ----------------------------------------------------------------

    def join(self, key: str, snapshot, count: int = 1) -> None:
        """``count`` requests of ``snapshot`` (None: the base model) join the batch under ``key``."""
        entry = None if snapshot is None else self.pool.get(snapshot)
        self.slots.acquire(key, entry, count)

    def leave(self, key: str) -> None:
        self.slots.release(key)

    def select_rows(self, adapters: list[str], groups: list[int]) -> None:
        """The next forward's rows: each row's adapter key and its request (-1: a row whose output is unread)."""
        live = [self.slots.slot(a) for a, g in zip(adapters, groups) if g >= 0]
        # a row whose output is unread (it stopped) takes any slot: the first live row's, so it splits nothing
        slots = [self.slots.slot(a) if g >= 0 else (live[0] if live else 0) for a, g in zip(adapters, groups)]
        if len(slots) == 0:
            raise ValueError("a mixed-adapter forward needs at least one row")
        if self.invariant:
            segments, start = [], 0
            for i in range(1, len(slots) + 1):
                if i == len(slots) or groups[i] != groups[start] or slots[i] != slots[start]:
                    segments.append((start, i, slots[start]))
                    start = i
            self.plan = _Plan(rows=len(slots), segments=segments)
            return
        if len(set(slots)) == 1:
            self.plan = _Plan(rows=len(slots), one=slots[0])
            return
        counts = [0] * (max(slots) + 1)
        for slot in slots:
            counts[slot] += 1
        width, seen, positions = max(counts), [0] * len(counts), []
        for slot in slots:
            positions.append(slot * width + seen[slot])
            seen[slot] += 1
        self.plan = _Plan(rows=len(slots), groups=len(counts), width=width, positions=positions,
                          in_place=positions == list(range(len(slots))) and len(counts) * width == len(slots))

    # --- the forward call ----------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        saved = []
        try:
            for parent, attr, mixed in self._swaps:
                saved.append((parent, attr, parent._modules[attr]))
                parent._modules[attr] = mixed
            _per_request.segments = self.plan.segments
            return self.inner(*args, **kwargs)
        finally:
            _per_request.segments = None
            for parent, attr, module in saved:
                parent._modules[attr] = module

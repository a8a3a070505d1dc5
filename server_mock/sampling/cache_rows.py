"""Row and column operations on a transformers cache for the decode loop: room to append in place, keeping or
repeating rows, and stacking a newly prefilled batch under a running one.

transformers' ``DynamicLayer`` appends a token with ``torch.cat``, which copies the layer's whole key/value
history at every step (and allocates it anew: on a CPU much of that time is page faults). Here a full-attention
layer's keys and values live in a buffer with room for the rest of the decode; a step writes one column in place
and the layer hands the model a view of the filled part, so the numbers the model sees are the same.

``stack`` is what continuous admission needs: the rows of requests prefilled while a batch decodes join it, their
columns right-aligned under the running batch's (the shorter side left-padded, as a padded prefill would be; the
attention mask hides the padding). It knows the layer kinds transformers uses for full attention, sliding windows,
linear attention / short convolutions and their hybrids; ``stackable`` says whether a cache has only those (the
load-time probe then checks the result against a plain decode, ``engine/support.py``).
"""

from __future__ import annotations

import torch
from transformers import cache_utils
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

__all__ = ["full_attention_only", "give_room", "keep_rows", "repeated", "stack", "stackable"]


class _Room:
    """Methods of a full-attention layer whose keys and values live in a buffer with free columns, appended in
    place. ``_room_class`` makes them a subclass of the layer's own class (single inheritance, so a live layer's
    class can be swapped: a mixin base would change the instance layout)."""

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None
    _room_hint = 0
    _plain: type = DynamicLayer  # the layer class this one extends

    def _in_buffer(self) -> bool:
        kbuf = self._kbuf
        return (kbuf is not None and self.keys is not None and self.keys.data_ptr() == kbuf.data_ptr()
                and self.keys.shape[:2] == kbuf.shape[:2] and self.keys.stride() == kbuf.stride())

    def _rebuffer(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        """Copy ``keys``/``values`` into fresh buffers with ``room`` free columns."""
        n = keys.shape[-2]
        self._kbuf = keys.new_empty((*keys.shape[:2], n + room, keys.shape[-1]))
        self._vbuf = values.new_empty((*values.shape[:2], n + room, values.shape[-1]))
        self._kbuf[:, :, :n].copy_(keys)
        self._vbuf[:, :, :n].copy_(values)
        self.keys, self.values = self._kbuf[:, :, :n], self._vbuf[:, :, :n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return self._plain.update(self, key_states, value_states, *args, **kwargs)
        n, m = self.keys.shape[-2], key_states.shape[-2]
        if not self._in_buffer() or n + m > self._kbuf.shape[-2]:
            # someone replaced the tensors (a transformers method) or the room ran out: regrow, amortised
            self._rebuffer(self.keys, self.values, max(m, self._room_hint, 64, n // 4))
        self._kbuf[:, :, n:n + m].copy_(key_states)
        self._vbuf[:, :, n:n + m].copy_(value_states)
        self.keys, self.values = self._kbuf[:, :, :n + m], self._vbuf[:, :, :n + m]
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self._in_buffer():
            return self._plain.reorder_cache(self, beam_idx)
        n = self.keys.shape[-2]
        idx = beam_idx.to(self.keys.device)
        # one copy: the selected rows of the whole buffer (its free columns too) become the new buffer
        self._kbuf, self._vbuf = self._kbuf.index_select(0, idx), self._vbuf.index_select(0, idx)
        self.keys, self.values = self._kbuf[:, :, :n], self._vbuf[:, :, :n]
        if isinstance(self, LinearAttentionCacheLayerMixin):  # a hybrid layer: its recurrent states too
            LinearAttentionCacheLayerMixin.reorder_cache(self, beam_idx)


_ROOM_METHODS = {name: _Room.__dict__[name] for name in
                 ("_kbuf", "_vbuf", "_room_hint", "_in_buffer", "_rebuffer", "update", "reorder_cache")}
_ROOM_CLASSES: dict[type, type] = {}


def _room_class(cls: type) -> type:
    if getattr(cls, "_in_place", False):
        return cls
    if cls not in _ROOM_CLASSES:
        _ROOM_CLASSES[cls] = type(f"InPlace{cls.__name__}", (cls,),
                                  {**_ROOM_METHODS, "_plain": cls, "_in_place": True, "__module__": __name__})
    return _ROOM_CLASSES[cls]


def _full_attention(layer) -> bool:
    """A layer that keeps every column (full attention), stored as transformers' DynamicLayer does."""
    return isinstance(layer, DynamicLayer) and not isinstance(
        layer, (DynamicSlidingWindowLayer, cache_utils.DynamicIndexedLayer))


def give_room(cache, columns: int) -> None:
    """Let every full-attention layer append its next ``columns`` tokens in place (one copy now, none later)."""
    for layer in cache.layers:
        if not _full_attention(layer) or not layer.is_initialized or layer.keys is None:
            continue
        layer.__class__ = _room_class(type(layer))
        layer._room_hint = columns
        have = layer._kbuf.shape[-2] - layer.keys.shape[-2] if layer._in_buffer() else -1
        if have < columns:
            layer._rebuffer(layer.keys, layer.values, columns)


def keep_rows(cache, index: torch.Tensor) -> None:
    """Keep cache rows ``index`` (in that order; a repeated index repeats a row), every layer kind."""
    cache.reorder_cache(index)


# --- a stored prefix's cache, copied for the rows that continue it (prefix_store.py) --------------------------


def full_attention_only(cache) -> bool:
    """Whether every layer of the cache is an initialized full-attention layer (keys and values of every column,
    nothing else): such a cache is a function of its tokens alone and can be copied for other rows."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(
        _full_attention(layer) and not isinstance(layer, LinearAttentionCacheLayerMixin)
        and not getattr(layer, "record_past", False) and layer.is_initialized and layer.keys is not None
        and layer.keys.numel() > 0 for layer in layers)


def repeated(cache, rows: int) -> cache_utils.DynamicCache:
    """A new cache holding ``rows`` copies of a one-row full-attention cache (``full_attention_only``); the
    original is left as it is, so it can be copied again."""
    return cache_utils.DynamicCache(ddp_cache_data=[
        (layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1)) for layer in cache.layers])


# --- stacking a newly prefilled batch under a running one ----------------------------------------------------

_STACKABLE = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin, DummyLayer)


def stackable(cache) -> bool:
    """Whether ``stack`` knows every layer of this cache (full, sliding, linear attention, conv, hybrids)."""
    for layer in cache.layers:
        if isinstance(layer, cache_utils.DynamicIndexedLayer) or not isinstance(layer, _STACKABLE):
            return False
        if isinstance(layer, (cache_utils.StaticLayer, cache_utils.QuantizedLayer)):
            return False
        if getattr(layer, "record_past", False):
            return False
    return True


def _pad_left(t: torch.Tensor, columns: int) -> torch.Tensor:
    """``t`` (rows, heads, n, dim) left-padded with zeros to ``columns`` columns (n <= columns)."""
    n = t.shape[-2]
    if n == columns:
        return t
    out = t.new_zeros((*t.shape[:2], columns, t.shape[-1]))
    out[:, :, columns - n:] = t
    return out


def stack(cache, other, columns: int, room: int) -> None:
    """Append ``other``'s rows below ``cache``'s, in place; both caches' columns right-aligned to ``columns``
    (the longer side's length). Full-attention layers get ``room`` free columns. Raises ``ValueError`` for a
    layer kind it does not know (``stackable``)."""
    if not (stackable(cache) and stackable(other)) or len(cache.layers) != len(other.layers):
        raise ValueError("this cache cannot be stacked")
    for a, b in zip(cache.layers, other.layers):
        if isinstance(a, LinearAttentionCacheLayerMixin):
            for i in range(a.number_of_states):
                for states, flag in ((a.conv_states, a.is_conv_states_initialized),
                                     (a.recurrent_states, a.is_recurrent_states_initialized)):
                    if flag[i]:
                        other_states = b.conv_states if states is a.conv_states else b.recurrent_states
                        states[i] = torch.cat([states[i], other_states[i]], dim=0)
        if isinstance(a, DummyLayer) or not isinstance(a, DynamicLayer) or not a.is_initialized:
            continue
        if isinstance(a, DynamicSlidingWindowLayer):
            kept = min(columns, a.sliding_window - 1)
            a.keys = torch.cat([_pad_left(a.keys, kept), _pad_left(b.keys, kept)], dim=0)
            a.values = torch.cat([_pad_left(a.values, kept), _pad_left(b.values, kept)], dim=0)
            a.cumulative_length = columns
            continue
        keys = torch.cat([_pad_left(a.keys, columns), _pad_left(b.keys, columns)], dim=0)
        values = torch.cat([_pad_left(a.values, columns), _pad_left(b.values, columns)], dim=0)
        if getattr(a, "_in_place", False):
            a._rebuffer(keys, values, room)
        else:
            a.keys, a.values = keys, values

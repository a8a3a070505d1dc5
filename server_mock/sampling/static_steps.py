"""Decode steps on fixed shapes, so that a GPU can replay them as CUDA graphs.

An eager decode step on a GPU is bound by kernel launches (hundreds per step for a small model); serving
engines capture the step once as a CUDA graph and replay it. That needs every tensor of the step at a fixed
shape and address: here the batch's rows are padded to a bucket (1, 2, 4, ... 256), the cache is transformers'
``StaticCache`` preallocated to a column capacity (a multiple of 256) and written in place at the step's column,
and the step's inputs (token ids, attention mask, positions) live in buffers updated in place. On CUDA the
forward is ``torch.compile(mode="reduce-overhead")``, which captures one graph per bucket (compile time paid once
per bucket and kept) and replays it; elsewhere the same fixed-shape step runs eagerly, which is how the CPU tests
check that it gives the dynamic path's tokens and logprobs.

``DecodeBatch`` moves its state in (``load``) after a prefill, a join or a compaction, and out (``unload``) before
the next one; rows never change inside a bucket's run. Padding rows attend to zeros and are never read. Only
caches of full-attention and linear-attention / conv layers are taken (``supports``); others (sliding windows)
decode on the dynamic path.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    StaticCache,
)

from server_mock.sampling import cache_rows

__all__ = ["StaticSteps", "bucket_columns", "bucket_rows"]

COLUMN_STEP = 256
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KEPT_BUCKETS = 4  # static caches kept for reuse (each holds its compiled graph's addresses)


def bucket_rows(n: int) -> int:
    return next((b for b in ROW_BUCKETS if b >= n), -(-n // ROW_BUCKETS[-1]) * ROW_BUCKETS[-1])


def bucket_columns(n: int) -> int:
    return -(-n // COLUMN_STEP) * COLUMN_STEP


class _Bucket:
    """One shape's static state: the cache and the step's input buffers."""

    def __init__(self, model, rows: int, columns: int, like) -> None:
        device = like.device
        self.rows, self.columns = rows, columns
        self.cache = StaticCache(config=model.config, max_cache_len=columns)
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((rows, columns), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.filled = 0  # columns written
        self.used = 0  # real rows
        self.step_fn = None


class StaticSteps:
    """Fixed-shape decode steps for one model (see the module docstring). ``compile`` defaults to "on CUDA"."""

    def __init__(self, model, compile: bool | None = None) -> None:
        self.model = model
        device = next(model.parameters()).device
        self.compile = device.type == "cuda" if compile is None else compile
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self.active: _Bucket | None = None

    @staticmethod
    def supports(cache) -> bool:
        for layer in cache.layers:
            if isinstance(layer, DummyLayer):
                continue
            if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(
                    layer, (DynamicLayer, LinearAttentionCacheLayerMixin)):
                return False
            if isinstance(layer, LinearAttentionCacheLayerMixin) and isinstance(layer, DynamicLayer):
                return False  # hybrid layers in one: not taken
            if isinstance(layer, LinearAttentionCacheLayerMixin) and type(layer) is not LinearAttentionLayer:
                return False
        return True

    def _bucket(self, rows: int, columns: int, like) -> _Bucket:
        key = (bucket_rows(rows), bucket_columns(columns))
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            bucket = _Bucket(self.model, *key, like)
            while len(self._buckets) >= KEPT_BUCKETS:
                self._buckets.pop(next(iter(self._buckets)))
        self._buckets[key] = bucket  # most recently used last
        return bucket

    def load(self, cache, mask, positions, columns: int, room: int) -> None:
        """Copy a dynamic state (rows x ``columns``, ``mask``/``positions`` None when unpadded) into a bucket with
        room for ``room`` more columns."""
        rows = next(len_ for len_ in _row_counts(cache))
        like = next(_tensors(cache))
        bucket = self._bucket(rows, columns + room, like)
        bucket.used, bucket.filled = rows, columns
        for dyn, static in zip(cache.layers, bucket.cache.layers):
            if isinstance(dyn, DummyLayer):
                continue
            if isinstance(dyn, LinearAttentionCacheLayerMixin):
                for i in range(dyn.number_of_states):
                    for states, flag, kind in ((dyn.conv_states, dyn.is_conv_states_initialized, "conv"),
                                               (dyn.recurrent_states, dyn.is_recurrent_states_initialized, "rec")):
                        if not flag[i]:
                            continue
                        padded = states[i].new_zeros((bucket.rows, *states[i].shape[1:]))
                        padded[:rows] = states[i]
                        target = static.conv_states if kind == "conv" else static.recurrent_states
                        if target[i] is None or target[i].shape != padded.shape:
                            if kind == "conv":
                                static.lazy_initialization(conv_states=padded, state_idx=i,
                                                           conv_kernel_size=padded.shape[-1])
                            else:
                                static.lazy_initialization(recurrent_states=padded, state_idx=i)
                        target[i].copy_(padded)
                        static.has_previous_state[i] = True
                continue
            keys, values = dyn.keys, dyn.values
            if not static.is_initialized:
                shape = (bucket.rows, *keys.shape[1:2], 1, keys.shape[-1])
                static.lazy_initialization(keys.new_zeros(shape), values.new_zeros((*shape[:3], values.shape[-1])))
            static.keys.zero_()
            static.values.zero_()
            static.keys[:rows, :, :columns].copy_(keys)
            static.values[:rows, :, :columns].copy_(values)
            static.cumulative_length.fill_(columns)
        bucket.mask.zero_()
        bucket.mask[:rows, :columns] = 1 if mask is None else mask
        bucket.mask[rows:, :columns] = 1  # padding rows see their (zero) keys: finite, never read
        bucket.positions.zero_()
        bucket.positions[:rows, 0] = columns if positions is None else positions
        self.active = bucket

    def step(self, feed: torch.Tensor) -> torch.Tensor:
        """One decode step for the real rows (``feed``: their next tokens); their next-token logits, float32."""
        bucket = self.active
        n = bucket.filled
        bucket.ids[:bucket.used, 0].copy_(feed)
        bucket.mask[:, n] = 1
        if bucket.step_fn is None:
            bucket.step_fn = self._step_fn(bucket)
        logits = bucket.step_fn(bucket.ids, bucket.mask, bucket.positions)
        out = logits[:bucket.used, -1, :].float()
        bucket.filled += 1
        bucket.positions += 1
        return out

    def _step_fn(self, bucket: _Bucket):
        model, cache = self.model, bucket.cache

        def step(ids, mask, positions):
            return model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=1).logits

        if not self.compile:
            return step
        return torch.compile(step, mode="reduce-overhead", dynamic=False)  # pragma: no cover - CUDA only

    def unload(self, cache, room: int) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """Copy the active bucket's state back into ``cache`` (the dynamic one it was loaded from); the mask,
        positions and column count of the real rows."""
        bucket, self.active = self.active, None
        rows, columns = bucket.used, bucket.filled
        for dyn, static in zip(cache.layers, bucket.cache.layers):
            if isinstance(dyn, DummyLayer):
                continue
            if isinstance(dyn, LinearAttentionCacheLayerMixin):
                for i in range(dyn.number_of_states):
                    if dyn.is_conv_states_initialized[i]:
                        dyn.conv_states[i] = static.conv_states[i][:rows].clone()
                    if dyn.is_recurrent_states_initialized[i]:
                        dyn.recurrent_states[i] = static.recurrent_states[i][:rows].clone()
                continue
            dyn.keys = static.keys[:rows, :, :columns].clone()
            dyn.values = static.values[:rows, :, :columns].clone()
        cache_rows.give_room(cache, room)
        return bucket.mask[:rows, :columns].clone(), bucket.positions[:rows, 0].clone(), columns


def _tensors(cache):
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for states in (layer.conv_states, layer.recurrent_states):
                for t in states.values():
                    if t is not None:
                        yield t
        if isinstance(layer, DynamicLayer) and layer.keys is not None:
            yield layer.keys


def _row_counts(cache):
    for t in _tensors(cache):
        yield t.shape[0]

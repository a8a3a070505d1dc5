"""Side-effect-free ``DynamicCache`` layers for prefix sharing: one that records the prefix pass's states, one that
replays them before each remainder."""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["cache_classes", "cache_kwarg", "recording_cache", "replay_cache", "supports_cache_layers"]


def cache_classes():
    from transformers import cache_utils

    return cache_utils


_HANDLED_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer", "DummyLayer",
                   "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer")


def supports_cache_layers(config) -> str | None:
    """None if every layer of this model's ``DynamicCache`` is a kind handled here, else the first one that is not."""
    for layer in cache_classes().DynamicCache(config=config).layers:
        if type(layer).__name__ not in _HANDLED_LAYERS:
            return type(layer).__name__
    return None


def _is_kv(layer) -> bool:
    return isinstance(layer, cache_classes().DynamicLayer)


def _is_linear(layer) -> bool:
    return isinstance(layer, cache_classes().LinearAttentionCacheLayerMixin)


# The replacement methods below are closures over plain dicts and tensors, never over the layer itself: a method
# bound to its own layer would make a reference cycle, and the prefix's whole autograd graph would then live until
# Python's cycle collector happened to run.

def recording_cache(config) -> tuple[object, list[dict]]:
    """A cache for the prefix pass whose layers record the states they are given (returned per layer) and store
    nothing the model reads."""
    cache = cache_classes().DynamicCache(config=config)
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


def replay_cache(config, states: list[dict], prefix_len: int, which: torch.Tensor):
    """A cache holding, for each row, the states of prefix ``which[row]``; updates return ``prefix ++ new`` and
    store nothing."""
    cache = cache_classes().DynamicCache(config=config)
    for layer, saved in zip(cache.layers, states):
        if "kv" in saved:
            keys, values = (_select(t, which) for t in saved["kv"])
            layer.keys, layer.values, layer.is_initialized = keys, values, True
            layer.device = keys.device
            if isinstance(layer, cache_classes().DynamicSlidingWindowLayer):
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


def cache_kwarg(model: nn.Module) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; use whichever this model's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"


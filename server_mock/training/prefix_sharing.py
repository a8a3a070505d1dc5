"""Run a prompt shared by several datums once per forward/backward call, exactly.

In GRPO a batch holds groups of completions of one prompt. Instead of running ``prompt + completion`` for every
datum, the worker runs the shared prefix once (batch 1), keeps each layer's cached states, and runs every datum's
remainder against them (right-padded, explicit positions, an attention mask covering prefix + remainder).

Gradients: the cached states and the prefix logits enter the remainder passes as detached leaves. Each chunk of
remainders backpropagates into the LoRA weights and into those leaves; after the group's last chunk one backward
pass carries the leaves' accumulated gradients through the prefix. The result is the gradient of the unshared
computation (sums in a different order: equal to float rounding).

The cache objects (prefix_cache.py) are transformers' ``DynamicCache`` whose layers are made side-effect free:
during the prefix pass they only record what the model hands them, during a remainder pass they return
``prefix ++ new`` without storing anything. So a layer that activation checkpointing runs twice sees the same
states both times, and no cached tensor is ever written in place (which would break autograd). Layer kinds
handled: full attention, sliding window, linear attention (conv + recurrent states, e.g. Qwen3.5). Any other
kind, or a model whose probe (``probe``) does not reproduce the unshared computation, takes the unshared path.
Which datums share a prefix, and how the passes are batched: prefix_planning.py.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from server_mock.training import prefix_cache

logger = logging.getLogger("server_mock")

__all__ = ["SharedPrefix", "probe"]

Forward = Callable[..., torch.Tensor]  # model keyword inputs -> logits [B, T, V]


# --- one shared prefix -------------------------------------------------------------------------------------------

class SharedPrefix:
    """Prefixes [P, L] run once together; ``remainder_logits`` runs rows after them; ``backward`` finishes the
    prefixes' gradient."""

    def __init__(self, forward: Forward, config, cache_kwarg: str, prefix_ids: torch.Tensor):
        self._forward, self._config, self._cache_kwarg = forward, config, cache_kwarg
        self.prefix_len = int(prefix_ids.shape[1])
        self._roots: list[torch.Tensor] = []
        self._leaves: list[torch.Tensor] = []
        cache, records = prefix_cache.recording_cache(config)
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
                    if isinstance(layer, prefix_cache.cache_classes().DynamicSlidingWindowLayer):
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
        cache = prefix_cache.replay_cache(self._config, self._states, self.prefix_len, which)
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
    unsupported = prefix_cache.supports_cache_layers(config)
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
    shared = SharedPrefix(forward, model.config, prefix_cache.cache_kwarg(model), prefixes.to(device))
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

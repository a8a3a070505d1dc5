"""Decoding from a snapshot with its LoRA merged into a copy of the adapted weights (float32 models only).

Unmerged, every adapted projection runs its base matmul, two thin LoRA matmuls, a scale and an add, plus PEFT's
own bookkeeping, at every decode step; at the 8-32 rows of a GRPO batch on a CPU that is a few percent of a step
at 32 rows and about a tenth at 8 (``benchmarks/decode_profile.py``). Merged, each adapted layer is a plain
``Linear`` on ``W + (alpha / r) B A`` (PEFT's ``get_delta_weight``), computed once per snapshot (tens of ms for
SmolLM2), at the price of a copy of the adapted weights (``merged_bytes``; the cache of them is bounded by
``--merge-lora-bytes``).

The base model is never modified: ``MergedDecoder`` puts its plain layers in place of PEFT's LoRA layers for the
duration of one forward call and puts PEFT's back afterwards (also when the call fails), so a training op that runs
between two decode slices sees the model exactly as it was. In float32 the merged product rounds differently from
the two-path one by about one float32 ulp per output (logprobs move by ~1e-7, far inside the 1e-5 the sampler
matches the trainer to); in bfloat16 merging would round the LoRA delta itself away, so bf16 models are never
merged.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MergedDecoder", "merged_bytes"]


def _lora_layers(peft, adapter: str):
    """(parent module, attribute, PEFT LoRA layer) of every layer that carries ``adapter`` on a Linear."""
    for parent in peft.modules():
        for name, child in parent.named_children():
            base = getattr(child, "base_layer", None)
            if isinstance(base, nn.Linear) and adapter in getattr(child, "lora_A", {}):
                yield parent, name, child


def merged_bytes(peft, adapter: str) -> int:
    """Bytes a merged copy of ``adapter``'s layers takes."""
    return sum(child.base_layer.weight.numel() * child.base_layer.weight.element_size()
               for _, _, child in _lora_layers(peft, adapter))


def _plain_like(base: nn.Linear, weight: torch.Tensor) -> nn.Linear:
    """A module of ``base``'s class (Linear, or the float32 head) with ``weight`` and ``base``'s bias."""
    layer = base.__class__.__new__(base.__class__)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = base.in_features, base.out_features
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = base.bias
    return layer


class MergedDecoder(nn.Module):
    """The PEFT model with ``adapter`` merged into plain layers for each forward call (see the module docstring)."""

    def __init__(self, peft, adapter: str) -> None:
        super().__init__()
        self.inner = peft
        self._swaps = []
        with torch.no_grad():
            for parent, name, child in _lora_layers(peft, adapter):
                base = child.base_layer
                merged = base.weight + child.get_delta_weight(adapter).to(base.weight.dtype)
                self._swaps.append((parent, name, child, _plain_like(base, merged)))
        self.config = peft.config

    def forward(self, *args, **kwargs):
        try:
            for parent, name, _, plain in self._swaps:
                parent._modules[name] = plain
            return self.inner.get_base_model()(*args, **kwargs)
        finally:
            for parent, name, lora, _ in self._swaps:
                parent._modules[name] = lora

"""Prompts with images in the decode loop (``decode_batch.DecodeBatch``): the prefill takes the images' pixel inputs
(the vision encoder runs once per prefilled prompt, however many samples share it); every later step is text only
and passes no image inputs (a decoded token is text: the placeholder is never drawn, and it attends causally
whatever the type ids say; Gemma 3's both-ways attention is among an image's own tokens, already in the cache).

What the model needs beside the token ids comes from the served model's image processing (``vision``, an
``engine.vision.ImageProcessing``): the pixel inputs and image-token type ids of the prefill, and for the Qwen
families the 3-D M-RoPE positions. Those are passed explicitly at every step: the text after an image continues
at ``its length + delta`` (the offset the image's grid leaves, per row), the same positions a full forward pass
over prompt and completion gives it, so the sampler's logprobs match the trainer's. Positions never come from
what transformers caches on the model between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ImagePrefill", "prefill"]


@dataclass
class ImagePrefill:
    """The image side of one decoding batch."""

    vision: Any
    prefill_inputs: dict[str, Any]  # the prefill's image kwargs and position_ids
    next_positions: torch.Tensor | None  # (B,) the position of each prefill row's next token (None: the cache's)


def prefill(vision, specs: list, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None,
            lengths: list[int]) -> ImagePrefill | None:
    """The image side of a batch whose prefill rows are ``specs`` (left-padded to ``ids`` under ``mask``, with the
    text path's ``positions``); None when no prompt holds an image (the text path runs exactly as before)."""
    if not any(spec.images for spec in specs):
        return None
    images = [span.image for spec in specs for span in spec.images]
    inputs = vision.forward_inputs(ids, images, ids.device)
    mrope, delta = vision.positions(ids, images, mask)
    length = torch.tensor(lengths, device=ids.device)
    if mrope is not None:
        inputs["position_ids"] = mrope
        next_positions = length + delta.reshape(-1).to(length.dtype)
    else:  # plain positions: the text path's (None when unpadded, the cache's length then)
        if positions is not None:
            inputs["position_ids"] = positions
        next_positions = length if positions is not None else None
    return ImagePrefill(vision, inputs, next_positions)

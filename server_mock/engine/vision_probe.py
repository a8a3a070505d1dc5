"""Whether an image-text model's generate-free forward handles images the way the sampler and trainer need:
checked once when the model loads, on one small synthetic image and a few random tokens (milliseconds).

Three ways of computing the logits of ``text, image, text, follow`` must agree:

1. one full forward pass with the pixels (the trainer's view);
2. the prompt (``text, image, text``) prefilled into the KV cache with the pixels, then ``follow`` decoded one
   token at a time with no image input (the sampler's view);
3. one full forward pass with the vision tower's output computed beforehand and passed as ``mm_encoder_outputs``
   (how a request runs the vision encoder once per distinct image).

Positions are passed explicitly (M-RoPE for Qwen, from ``ImageProcessing.positions``), so no call depends on the
position offsets transformers keeps on the model between calls; those are cleared afterwards all the same.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from PIL import Image

from server_mock.engine.images import DecodedImage
from server_mock.engine.vision import ImageProcessing, PreparedImage

logger = logging.getLogger("server_mock")

__all__ = ["ImageLogits", "image_logits", "probe_image_decoding", "probe_image", "probe_tokens"]

_PROBE_TEXT = (5, 4, 3)  # tokens before the image, between it and the follow, and followed (decoded one by one)


def probe_image(width: int = 64, height: int = 48) -> DecodedImage:
    """A deterministic RGB gradient with a few edges (so a vision tower sees structure, not a flat field)."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 255) // max(1, width - 1), (y * 255) // max(1, height - 1), ((x // 8 + y // 8) % 2) * 200],
                   axis=-1).astype(np.uint8)
    return DecodedImage("probe", Image.fromarray(rgb, "RGB"), width, height)


def _special_ids(config) -> set[int]:
    ids = set()
    for cfg in (config, config.get_text_config()):
        for key, value in vars(cfg).items():
            if isinstance(value, int) and (key.endswith("_token_id") or key.endswith("_token_index")):
                ids.add(value)
    return ids


def probe_tokens(vision: ImageProcessing, vocab_size: int, seed: int = 0) -> tuple[list[int], list[int], list[int]]:
    """Random text ids (before the image, after it, the decoded follow) avoiding every image-related id."""
    avoid = _special_ids(vision.config) | {int(t) for t in vision.tokenizer.all_special_ids}
    allowed = np.array([i for i in range(min(vocab_size, 4096)) if i not in avoid])
    rng = np.random.default_rng(seed)
    return tuple(rng.choice(allowed, n).tolist() for n in _PROBE_TEXT)


class ImageLogits:
    """The logits of one sequence with images, computed the three ways of the module docstring."""

    def __init__(self, model, vision: ImageProcessing, ids: list[int], images: list[PreparedImage], device) -> None:
        self.model, self.vision, self.images, self.device = model, vision, images, device
        self.ids = torch.tensor([ids], dtype=torch.long, device=device)
        self.positions, self.delta = vision.positions(self.ids, images)

    def _pos(self, start: int, stop: int):
        return None if self.positions is None else self.positions[..., start:stop]

    def full(self) -> torch.Tensor:
        inputs = self.vision.forward_inputs(self.ids, self.images, self.device)
        out = self.model(input_ids=self.ids, position_ids=self._pos(0, self.ids.shape[1]), use_cache=False, **inputs)
        return out.logits.float()[0]

    def cached(self, prompt_len: int) -> torch.Tensor:
        """Rows ``prompt_len - 1 ..``: the last prefill logits, then one row per decoded token."""
        prompt = self.ids[:, :prompt_len]
        inputs = self.vision.forward_inputs(prompt, self.images, self.device)
        out = self.model(input_ids=prompt, position_ids=self._pos(0, prompt_len), use_cache=True, **inputs)
        rows, cache = [out.logits.float()[0, -1]], out.cache
        for t in range(prompt_len, self.ids.shape[1]):
            step = self.ids[:, t:t + 1]
            out = self.model(input_ids=step, cache=cache, position_ids=self._pos(t, t + 1), use_cache=True,
                             **self.vision.forward_inputs(step, [], self.device))
            rows.append(out.logits.float()[0, -1])
            cache = out.cache
        return torch.stack(rows)

    def precomputed(self) -> torch.Tensor:
        """The full pass with the vision tower run beforehand, its output handed in as ``mm_encoder_outputs``."""
        inputs = self.vision.forward_inputs(self.ids, self.images, self.device)
        pixels = {k: inputs.pop(k) for k in list(inputs) if k != self.vision.family.type_ids}
        features = self.model.get_image_features(**pixels, return_dict=True)
        out = self.model(input_ids=self.ids, position_ids=self._pos(0, self.ids.shape[1]), use_cache=False,
                         mm_encoder_outputs={"image": features}, **inputs)
        return out.logits.float()[0]


def image_logits(model, vision: ImageProcessing, vocab_size: int, device, seed: int = 0):
    """The probe's sequence (``probe_tokens`` around ``probe_image``): its ``ImageLogits`` and prompt length."""
    image = vision.prepare(probe_image())
    before, between, follow = probe_tokens(vision, vocab_size, seed)
    ids = before + image.tokens.tolist() + between + follow
    return ImageLogits(model, vision, ids, [image], device), len(ids) - len(follow)


def probe_image_decoding(model, vision: ImageProcessing, vocab_size: int) -> str | None:
    """None when the three computations agree on this model, else why images cannot be served on it (the model
    still serves text)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    try:
        with torch.no_grad():
            run, prompt_len = image_logits(model, vision, vocab_size, device)
            ref = run.full()
            tol = (1e-3 if dtype == torch.float32 else 5e-2) * max(1.0, float(ref.abs().max()))
            cached_gap = float((run.cached(prompt_len) - ref[prompt_len - 1:]).abs().max())
            pre_gap = float((run.precomputed() - ref).abs().max())
    except Exception as exc:  # noqa: BLE001 - any failure means images cannot be served on this model
        return f"a forward pass with an image failed ({type(exc).__name__}: {exc})"
    finally:
        _clear_position_state(model)
    if cached_gap > tol:
        return (f"decoding after an image prefilled into the KV cache differs from a full forward pass by "
                f"{cached_gap:.3g} (sampled logprobs could not match the trainer's)")
    if pre_gap > tol:
        return f"precomputed vision features change the logits by {pre_gap:.3g}"
    return None


def _clear_position_state(model) -> None:
    """Forget the M-RoPE offsets a Qwen model caches between calls (``rope_deltas``), so a later text-only call
    never reuses an image request's."""
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None

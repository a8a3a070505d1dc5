"""What an image becomes for one served vision-language model: the tokens that stand for it in the sequence, and
the pixel tensors its forward pass takes.

An image chunk of a prompt or datum stands for the run of tokens the model's own processor puts where one image
goes (``PreparedImage.tokens``); its length is the chunk's ``expected_tokens``. Per family (``VISION_FAMILIES``):

* Qwen2.5-VL, Qwen3-VL and Qwen3.5: the image processor resizes the image to a multiple of ``patch_size x merge_size``
  and cuts it into patches (``pixel_values`` rows, ``image_grid_thw``); the image is ``grid_t*grid_h*grid_w /
  merge_size^2`` copies of ``<|image_pad|>``, the same count the Qwen processors substitute (their
  ``replace_image_token``) and Tinker's renderers send as ``expected_tokens``. ``<|vision_start|>`` and
  ``<|vision_end|>`` around it are the client's text. The Qwen processors cannot be built without torchvision
  (their video half needs it), so the image half is used on its own, with the PIL backend everywhere. The forward
  also takes ``mm_token_type_ids`` (1 at image tokens) to lay out the 3-D M-RoPE positions (``positions``).
* Gemma 3 and LLaVA: the family's processor expands its image marker (Gemma 3: ``\\n\\n<start_of_image>`` +
  ``mm_tokens_per_image`` soft tokens + ``<end_of_image>\\n\\n``; LLaVA: one ``<image>`` per patch); Gemma 3's
  forward takes ``token_type_ids`` (1 at soft tokens), which make the tokens of one image attend to each other
  both ways.

Everything here is numpy (``PreparedImage``) until ``forward_inputs`` builds the tensors for one forward pass.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from server_mock.engine.images import DecodedImage
from server_mock.errors import WorkerError

__all__ = ["VISION_FAMILIES", "ImageProcessing", "PreparedImage", "VisionFamily", "check_expected_tokens",
           "is_image_text", "load_image_processing"]


@dataclass(frozen=True)
class VisionFamily:
    """How one family of image-text models takes images (see the module docstring)."""

    expansion: str  # "grid": image processor + the Qwen grid rule; "processor": the family's processor
    type_ids: str | None = None  # the forward kwarg that marks image tokens (None: the family takes none)
    mrope: bool = False  # 3-D rotary positions laid out from the images' grids (Qwen)


_QWEN = VisionFamily("grid", "mm_token_type_ids", mrope=True)
# every family here is built tiny and checked in tests (engine/tiny_vlm.py); a model type not listed loads as
# today: text-only through its causal-LM class if transformers has one (e.g. qwen3_5_moe), else it is refused
VISION_FAMILIES: dict[str, VisionFamily] = {
    "qwen3_5": _QWEN,
    "qwen3_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "gemma3": VisionFamily("processor", "token_type_ids"),
    "llava": VisionFamily("processor"),
}

# outputs of a processor that describe the text, not the image
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def is_image_text(config) -> bool:
    """True for a config this worker serves as an image-text model: a family of ``VISION_FAMILIES`` with its vision
    tower configured (a text-only config of the same family, e.g. ``qwen3_5_text``, has another model type)."""
    return config.model_type in VISION_FAMILIES and getattr(config, "vision_config", None) is not None


@dataclass(frozen=True)
class PreparedImage:
    """One decoded image, processed for one model (numpy, so it crosses threads and processes as data)."""

    digest: str  # SHA-256 of the client's bytes
    width: int
    height: int
    tokens: np.ndarray  # int64: the ids that stand for this image in the sequence
    placeholders: int  # how many of ``tokens`` are the image token (= rows of vision features)
    pixel_inputs: dict[str, np.ndarray] = field(default_factory=dict)  # forward kwargs, batch axis 0

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


def check_expected_tokens(prepared: PreparedImage, expected: int | None, where: str) -> int:
    """The chunk's token count: the client's ``expected_tokens`` if it matches the processor's, the processor's
    count where the client left it out, else a 400 naming the chunk and both numbers."""
    if expected is None:
        return prepared.n_tokens
    if int(expected) != prepared.n_tokens:
        raise WorkerError(400, "image_token_mismatch",
                          f"{where}.expected_tokens: the client counted {int(expected)} tokens for this "
                          f"{prepared.width}x{prepared.height} image, the model's processor makes {prepared.n_tokens}; "
                          "count with the model's image processor or leave expected_tokens out",
                          f"{where}.expected_tokens")
    return prepared.n_tokens


class ImageProcessing:
    """The image side of one served image-text model (built by ``load_image_processing``)."""

    def __init__(self, model_type: str, config, processor, image_processor, tokenizer,
                 forward_params: set[str], rope_index=None) -> None:
        self.model_type = model_type
        self.family = VISION_FAMILIES[model_type]
        self.config = config
        self.processor = processor  # the multimodal processor ("processor" families), else None
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.forward_params = forward_params
        self._rope_index = rope_index  # the model's M-RoPE layout (``get_rope_index``), pure index arithmetic
        image_token_id = getattr(config, "image_token_id", None)
        if image_token_id is None:
            image_token_id = getattr(config, "image_token_index", None)
        self.image_token_id = int(image_token_id)

    def prepare(self, decoded: DecodedImage) -> PreparedImage:
        """The tokens and pixel inputs of one decoded image."""
        if self.family.expansion == "grid":
            out = self.image_processor(images=[decoded.image], return_tensors="np")
            grid = np.asarray(out["image_grid_thw"]).reshape(-1)
            n = int(np.prod(grid)) // int(self.image_processor.merge_size) ** 2
            tokens = np.full(n, self.image_token_id, dtype=np.int64)
        else:
            out = self.processor(text=[self.processor.image_token], images=[[decoded.image]], return_tensors="np",
                                 add_special_tokens=False)
            tokens = np.asarray(out["input_ids"][0], dtype=np.int64)
        pixel_inputs = {k: np.asarray(v) for k, v in out.items() if k not in _TEXT_KEYS and k in self.forward_params}
        placeholders = int((tokens == self.image_token_id).sum())
        return PreparedImage(decoded.digest, decoded.width, decoded.height, tokens, placeholders, pixel_inputs)

    def type_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """1 at image tokens, 0 elsewhere (what ``mm_token_type_ids`` / ``token_type_ids`` mean here)."""
        return (ids == self.image_token_id).long()

    def forward_inputs(self, ids: torch.Tensor, images: list[PreparedImage], device) -> dict[str, Any]:
        """The image kwargs of one forward pass over ``ids`` (B, T) holding ``images`` in reading order (row by row,
        left to right), on ``device`` (the models cast the pixels to their vision tower's dtype)."""
        if sum(img.placeholders for img in images) != int((ids == self.image_token_id).sum()):
            raise ValueError("the image tokens of the batch do not match its images")
        kwargs: dict[str, Any] = {}
        if self.family.type_ids is not None:
            kwargs[self.family.type_ids] = self.type_ids(ids)
        if images:
            for key in images[0].pixel_inputs:
                tensor = torch.from_numpy(np.concatenate([img.pixel_inputs[key] for img in images], axis=0))
                kwargs[key] = tensor.to(device)
        return kwargs

    def positions(self, ids: torch.Tensor, images: list[PreparedImage],
                  attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """M-RoPE position ids (3, B, T) of ``ids`` and each row's offset for the text after it (B, 1), or
        (None, None) for a family with plain positions. Passing them explicitly keeps a forward pass independent
        of the position offsets transformers caches on the model between calls."""
        if not self.family.mrope:
            return None, None
        grids = None
        if images:
            grids = torch.from_numpy(np.concatenate([img.pixel_inputs["image_grid_thw"] for img in images])).to(
                ids.device)
        return self._rope_index(ids, mm_token_type_ids=self.type_ids(ids), image_grid_thw=grids,
                                attention_mask=attention_mask)


def load_image_processing(model, source: str, tokenizer) -> ImageProcessing:
    """The image processing of the image-text model ``model`` loaded from ``source``: its processor (Gemma 3, LLaVA)
    or image processor (Qwen), always the PIL backend so a result never depends on whether torchvision is there."""
    from transformers import AutoImageProcessor, AutoProcessor

    config = model.config
    family = VISION_FAMILIES[config.model_type]
    processor = None
    if family.expansion == "grid":
        image_processor = AutoImageProcessor.from_pretrained(source, backend="pil")
    else:
        processor = AutoProcessor.from_pretrained(source, backend="pil")
        image_processor = processor.image_processor
    params = set(inspect.signature(model.forward).parameters)
    rope_index = model.model.get_rope_index if family.mrope else None  # PEFT wraps layers, not this module
    return ImageProcessing(config.model_type, config, processor, image_processor, tokenizer, params, rope_index)

"""Helpers of the tests that send images to a worker: test images, the client's token count of an image, the text
around an image in a user turn."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def image_tokens(folder, data: bytes) -> int:
    """The image's token count as a client counts it, with the model's own image processing loaded here."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor

    config = AutoConfig.from_pretrained(folder)
    img = Image.open(io.BytesIO(data)).convert("RGB")
    if config.model_type == "gemma3":
        proc = AutoProcessor.from_pretrained(folder, backend="pil")
        ids = proc(text=[proc.image_token], images=[[img]], add_special_tokens=False)["input_ids"][0]
        return len(ids)
    proc = AutoImageProcessor.from_pretrained(folder, backend="pil")
    h, w = img.height, img.width
    return proc.get_number_of_image_patches(h, w, {}) // proc.merge_size ** 2


def pieces(tok, family: str) -> tuple[list[int], list[int]]:
    """The text around the image, as the family's chat template renders a user turn with one image."""
    if family.startswith("qwen"):
        return (tok.encode("<|im_start|>user\n<|vision_start|>", add_special_tokens=False),
                tok.encode("<|vision_end|>how many shapes?<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False))
    return (tok.encode("<|im_start|>user\n", add_special_tokens=False),
            tok.encode("how many shapes?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))


def completion_inputs(n_prompt: int, completion: list[int]) -> dict:
    """Cross-entropy inputs scoring only the completion of a datum whose model input is prompt + completion[:-1]."""
    return {"target_tokens": [0] * (n_prompt - 1) + list(completion),
            "weights": [0.0] * (n_prompt - 1) + [1.0] * len(completion)}



def png_declaring(width: int, height: int) -> bytes:
    """A valid PNG header claiming ``width x height`` RGB pixels with one row of data (a few hundred bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = zlib.compress(b"\x00" * (1 + 3 * width), 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")

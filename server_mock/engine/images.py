"""Client images decoded within bounds: bytes per image, pixels per image, images per request.

An image chunk is PNG or JPEG bytes. Pillow opens a file lazily (it reads the header, not the pixels), so the
declared width x height is checked against ``--max-image-pixels`` before a single pixel is decoded: a
decompression bomb (a few KiB of PNG claiming 100k x 100k pixels) costs a header read. The bytes are bounded
before Pillow sees them, the declared format must match the file's, a file with several frames (APNG, MPO) is
refused rather than silently cut to its first frame, and a truncated or corrupt file is a 400, never a 500.
What a request's images may cost together is checked from all their headers before the first is decoded
(``ImageDecoder.admit``): their count, and the bytes they decode to (``--max-decoded-image-bytes``; identical
bytes, keyed by SHA-256, count once, as they are decoded once).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from server_mock.config import Limits
from server_mock.errors import WorkerError, bad_request

__all__ = ["FORMATS", "DecodedImage", "ImageDecoder", "decode_image", "image_digest", "read_header"]

DECODED_CHANNELS = 3  # a decoded image is RGB, one byte a channel
# the chunk's ``format`` -> what Pillow calls it
FORMATS = {"png": "PNG", "jpeg": "JPEG"}


@dataclass(frozen=True)
class DecodedImage:
    digest: str  # SHA-256 of the bytes: the image's identity for deduplication and prefix keys
    image: Image.Image  # RGB, fully decoded
    width: int
    height: int


def image_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_header(data: bytes, fmt: str, limits: Limits, where: str) -> Image.Image:
    """``data`` opened lazily (its header read, no pixel decoded) and checked against the per-image bounds, or a
    4xx naming ``where`` (e.g. ``prompt.chunks[2]``) and the bound it broke."""
    if fmt not in FORMATS:
        raise bad_request(f"{where}.format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}",
                          code="invalid_image")
    if not data:
        raise bad_request(f"{where}.data", "is empty", code="invalid_image")
    if len(data) > limits.max_image_bytes:
        raise WorkerError(413, "image_too_large", f"{where}.data: {len(data)} bytes exceeds limit "
                          f"max_image_bytes={limits.max_image_bytes} (--max-image-bytes)", f"{where}.data")
    with warnings.catch_warnings():
        # Pillow's own bomb guard warns (and errors at twice its limit); ours below is tighter and says which flag
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=[FORMATS[fmt]])
        except Image.DecompressionBombError:
            img = None
        except (OSError, ValueError, SyntaxError) as exc:  # Pillow's "cannot identify image file" and friends
            raise bad_request(f"{where}.data", f"is not a readable {fmt} image ({exc})", code="invalid_image") from exc
        if img is None:
            raise WorkerError(413, "image_too_large", f"{where}: its header declares more pixels than limit "
                              f"max_image_pixels={limits.max_image_pixels} (--max-image-pixels)", f"{where}.data")
        width, height = img.size
        if width * height > limits.max_image_pixels:
            raise WorkerError(413, "image_too_large", f"{where}: {width}x{height} = {width * height} pixels exceeds "
                              f"limit max_image_pixels={limits.max_image_pixels} (--max-image-pixels)",
                              f"{where}.data")
        if width < 1 or height < 1:
            raise bad_request(f"{where}.data", f"has no pixels ({width}x{height})", code="invalid_image")
        if getattr(img, "n_frames", 1) != 1:
            raise bad_request(f"{where}.data", f"has {img.n_frames} frames; send one still image",
                              code="invalid_image")
    return img


def decode_image(data: bytes, fmt: str, limits: Limits, where: str) -> DecodedImage:
    """``data`` as an RGB image, or a 4xx naming ``where`` (e.g. ``prompt.chunks[2]``) and the bound it broke."""
    img = read_header(data, fmt, limits, where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img.load()
            rgb = img.convert("RGB")
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise bad_request(f"{where}.data", f"could not be decoded as {fmt} ({exc})", code="invalid_image") from exc
    return DecodedImage(image_digest(data), rgb, img.size[0], img.size[1])


class ImageDecoder:
    """Decodes the image chunks of one request. ``admit`` takes them all before any is decoded: at most
    ``max_images_per_request`` of them, and at most ``max_decoded_image_bytes`` once decoded (width x height x
    ``DECODED_CHANNELS`` of each distinct file, read from the headers). Nothing decoded is kept here: the caller
    keeps what it makes of an image, and drops the pixels."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.count = 0

    def admit(self, images: Sequence[tuple[bytes, str, str]]) -> int:
        """Check the ``(data, format, where)`` of every image of the request, headers only; the bytes their
        distinct images decode to. 413 naming the first image past a bound (nothing is decoded)."""
        limits = self.limits
        if len(images) > limits.max_images_per_request:
            where = images[limits.max_images_per_request][2]
            raise WorkerError(413, "too_many_images", f"{where}: image {limits.max_images_per_request + 1} of this "
                              f"request ({len(images)} in all) exceeds limit max_images_per_request="
                              f"{limits.max_images_per_request} (--max-images-per-request)", where)
        total = 0
        seen: set[tuple[str, str]] = set()
        for data, fmt, where in images:
            key = (image_digest(data), fmt)
            if key in seen:
                continue  # decoded once
            seen.add(key)
            width, height = read_header(data, fmt, limits, where).size
            total += width * height * DECODED_CHANNELS
            if total > limits.max_decoded_image_bytes:
                raise WorkerError(413, "images_too_large", f"{where}: the distinct images of this request up to this "
                                  f"one decode to {total} bytes (width x height x {DECODED_CHANNELS}, from their "
                                  f"headers), past limit max_decoded_image_bytes={limits.max_decoded_image_bytes} "
                                  "(--max-decoded-image-bytes); send fewer or smaller images", f"{where}.data")
        self.count = 0
        return total

    def decode(self, data: bytes, fmt: str, where: str) -> DecodedImage:
        self.count += 1
        if self.count > self.limits.max_images_per_request:
            raise WorkerError(413, "too_many_images", f"{where}: image {self.count} of this request exceeds limit "
                              f"max_images_per_request={self.limits.max_images_per_request} "
                              "(--max-images-per-request)", where)
        return decode_image(data, fmt, self.limits, where)

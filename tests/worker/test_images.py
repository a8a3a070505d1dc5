"""Client images decoded within bounds (engine/images.py): bytes, pixels and count, each at its limit and one past;
a decompression bomb refused from its header, before any pixel is decoded; wrong or broken files are 400s."""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from server_mock.config import Limits
from server_mock.engine.images import ImageDecoder, decode_image, image_digest
from server_mock.errors import WorkerError


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="JPEG", quality=95)
    return out.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def png_declaring(width: int, height: int, rows: int = 1) -> bytes:
    """A valid PNG header claiming ``width x height`` RGB pixels, with pixel data for only ``rows`` rows (zlib of
    zeros: the whole file stays a few KiB whatever it claims)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = zlib.compress(b"\x00" * (rows * (1 + 3 * width)), 9)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", raw) + _chunk(b"IEND", b"")


def refused(status: int, code: str, call):
    with pytest.raises(WorkerError) as info:
        call()
    assert (info.value.status, info.value.code) == (status, code), info.value.message
    return info.value


def test_a_png_and_a_jpeg_decode_to_rgb_with_their_size_and_digest():
    data = png(7, 5)
    got = decode_image(data, "png", Limits(), "prompt.chunks[1]")
    assert (got.width, got.height, got.image.mode, got.image.size) == (7, 5, "RGB", (7, 5))
    assert got.digest == image_digest(data) and len(got.digest) == 64
    assert np.array_equal(np.asarray(got.image), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    assert decode_image(jpeg(9, 4), "jpeg", Limits(), "x").image.size == (9, 4)


def test_bytes_at_the_limit_pass_and_one_past_is_413_naming_the_chunk_and_flag():
    data = png(6, 6)
    decode_image(data, "png", replace(Limits(), max_image_bytes=len(data)), "prompt.chunks[0]")
    tight = replace(Limits(), max_image_bytes=len(data) - 1)
    err = refused(413, "image_too_large", lambda: decode_image(data, "png", tight, "prompt.chunks[0]"))
    assert err.field == "prompt.chunks[0].data"
    assert f"{len(data)} bytes" in err.message and f"max_image_bytes={len(data) - 1}" in err.message
    assert "--max-image-bytes" in err.message


def test_pixels_at_the_limit_pass_and_one_past_is_413():
    data = png(12, 10)
    decode_image(data, "png", replace(Limits(), max_image_pixels=120), "c")
    err = refused(413, "image_too_large", lambda: decode_image(data, "png", replace(Limits(), max_image_pixels=119),
                                                              "data[2].model_input.chunks[1]"))
    assert "12x10 = 120 pixels" in err.message and "max_image_pixels=119" in err.message
    assert "--max-image-pixels" in err.message and err.field == "data[2].model_input.chunks[1].data"


def test_a_decompression_bomb_is_refused_from_its_header_without_decoding(no_decoding):
    bomb = png_declaring(30_000, 30_000)  # 900 M pixels (2.7 GB of RGB) in a file of a few hundred bytes
    assert len(bomb) < 2_000
    err = refused(413, "image_too_large", lambda: decode_image(bomb, "png", Limits(), "prompt.chunks[0]"))
    assert "max_image_pixels" in err.message
    # just past the default limit, under Pillow's own bomb guard: our check alone refuses it, still unread
    side = int(Limits().max_image_pixels ** 0.5) + 1
    err = refused(413, "image_too_large", lambda: decode_image(png_declaring(side, side), "png", Limits(), "c"))
    assert f"{side}x{side} = {side * side} pixels" in err.message
    assert no_decoding == []


def test_a_real_bomb_of_zeros_is_refused_unread(no_decoding):
    """A complete 5000x5000 PNG (75 MB of pixels, a few dozen KiB compressed) over a 16 M pixel limit."""
    bomb = png_declaring(5000, 5000, rows=5000)
    assert len(bomb) < 200_000
    refused(413, "image_too_large", lambda: decode_image(bomb, "png", Limits(), "c"))
    assert no_decoding == []


def test_count_at_the_limit_passes_and_one_past_is_413_before_any_decode(no_decoding):
    limits = replace(Limits(), max_images_per_request=3)
    decoder = ImageDecoder(limits)
    images = [(png(4, 4), "png", f"data[{i}].model_input.chunks[1]") for i in range(4)]
    assert decoder.admit(images[:3]) == 4 * 4 * 3  # identical bytes count once
    err = refused(413, "too_many_images", lambda: decoder.admit(images))
    assert "image 4" in err.message and "max_images_per_request=3" in err.message
    assert err.field == "data[3].model_input.chunks[1]" and "--max-images-per-request" in err.message
    assert no_decoding == []


def test_the_declared_format_must_match_the_file():
    refused(400, "invalid_image", lambda: decode_image(png(4, 4), "jpeg", Limits(), "c"))
    refused(400, "invalid_image", lambda: decode_image(jpeg(4, 4), "png", Limits(), "c"))
    err = refused(400, "invalid_image", lambda: decode_image(png(4, 4), "gif", Limits(), "prompt.chunks[3]"))
    assert err.field == "prompt.chunks[3].format"
    decoder = ImageDecoder(Limits())
    decoder.decode(png(4, 4), "png", "c")
    refused(400, "invalid_image", lambda: decoder.decode(png(4, 4), "jpeg", "c"))  # known bytes, wrong format


@pytest.mark.parametrize("data", [b"", b"not an image at all", png(8, 8)[:40], png(8, 8)[:-30]])
def test_empty_garbage_or_truncated_files_are_400s(data):
    err = refused(400, "invalid_image", lambda: decode_image(data, "png", Limits(), "prompt.chunks[0]"))
    assert err.field == "prompt.chunks[0].data"


def test_an_animated_png_is_refused_rather_than_cut_to_one_frame():
    frames = [Image.new("RGB", (4, 4), (i * 60, 0, 0)) for i in range(3)]
    out = io.BytesIO()
    frames[0].save(out, format="PNG", save_all=True, append_images=frames[1:])
    err = refused(400, "invalid_image", lambda: decode_image(out.getvalue(), "png", Limits(), "c"))
    assert "3 frames" in err.message


def test_palette_grey_and_alpha_images_become_rgb():
    for mode in ("P", "L", "RGBA", "LA"):
        out = io.BytesIO()
        Image.new(mode, (3, 2)).save(out, format="PNG")
        assert decode_image(out.getvalue(), "png", Limits(), "c").image.mode == "RGB"

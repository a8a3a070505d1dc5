"""What a request's images may cost together, checked from their headers before any is decoded
(engine/images.py ``ImageDecoder.admit``, service/image_inputs.py ``RequestImages.admit``): the image count, and
the bytes their distinct images decode to (``--max-decoded-image-bytes``), each at its limit and one past, with
tiny 1-bit PNGs of large dimensions (2 KB of file, 48 MiB of RGB each). Every protocol's sample and forward
requests reach the worker's images through ``validate_sample`` / ``validate_rows``, tested here on both."""

from __future__ import annotations

import gc
import io
import weakref
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from pytrio_compat.wire import SampleRequest, WireImage
from server_mock.config import Limits
from server_mock.engine.images import ImageDecoder
from server_mock.engine.vision import PreparedImage
from server_mock.errors import WorkerError
from server_mock.service.image_inputs import RequestImages
from server_mock.service.validation import validate_rows, validate_sample

SIDE = 4096
DECODED = SIDE * SIDE * 3  # one such image as RGB


def bilevel_png(seed: int, side: int = SIDE) -> bytes:
    """A 1-bit ``side`` x ``side`` PNG, distinct per ``seed`` (one pixel differs): ~2 KB of file."""
    img = Image.new("1", (side, side), 0)
    img.putpixel((seed % side, seed // side), 1)
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def bombs() -> list[bytes]:
    return [bilevel_png(i) for i in range(3)]


def refused(status: int, code: str, call) -> WorkerError:
    with pytest.raises(WorkerError) as info:
        call()
    assert (info.value.status, info.value.code) == (status, code), info.value.message
    return info.value


def test_the_files_are_small_and_decode_large(bombs):
    assert all(len(b) < 4096 for b in bombs) and len(set(bombs)) == 3
    assert Image.open(io.BytesIO(bombs[0])).size == (SIDE, SIDE)


def test_decoded_bytes_at_the_limit_pass_and_one_past_is_413_before_any_decode(bombs, no_decoding):
    limits = replace(Limits(), max_decoded_image_bytes=2 * DECODED)
    chunks = [(data, "png", f"prompt_images[{i}].chunk") for i, data in enumerate(bombs)]
    assert ImageDecoder(limits).admit(chunks[:2]) == 2 * DECODED  # exactly the limit
    assert ImageDecoder(limits).admit(chunks[:2] + [(bombs[0], "png", "prompt_images[2].chunk")]) == 2 * DECODED
    err = refused(413, "images_too_large", lambda: ImageDecoder(limits).admit(chunks))
    assert err.field == "prompt_images[2].chunk.data"
    assert f"max_decoded_image_bytes={2 * DECODED}" in err.message and "--max-decoded-image-bytes" in err.message
    assert str(3 * DECODED) in err.message
    one_past = replace(limits, max_decoded_image_bytes=2 * DECODED - 1)
    err = refused(413, "images_too_large", lambda: ImageDecoder(one_past).admit(chunks[:2]))
    assert err.field == "prompt_images[1].chunk.data"
    assert no_decoding == []


def test_the_count_is_checked_before_any_header_or_decode(bombs, no_decoding):
    """41 images with the limit at 40: refused at once (before, the first 40 were decoded: +2.7 GB)."""
    limits = replace(Limits(), max_images_per_request=40, max_decoded_image_bytes=1 << 40)
    chunks = [(bombs[i % 3], "png", f"prompt_images[{i}].chunk") for i in range(41)]
    err = refused(413, "too_many_images", lambda: ImageDecoder(limits).admit(chunks))
    assert err.field == "prompt_images[40].chunk" and "max_images_per_request=40" in err.message
    assert ImageDecoder(limits).admit(chunks[:40]) == 3 * DECODED
    assert no_decoding == []


class StubVision:
    """A served model's image processing reduced to what admission and expansion need; ``prepare`` records the
    decoded images it is given (weakly) and makes one token per image."""

    image_token_id = 7
    family = SimpleNamespace(mrope=False)

    def __init__(self) -> None:
        self.seen: list[weakref.ref] = []

    def prepare(self, decoded) -> PreparedImage:
        self.seen.append(weakref.ref(decoded.image))
        return PreparedImage(decoded.digest, decoded.width, decoded.height, np.full(1, 7, dtype=np.int64), 1, {})


def stub_host(vision=None):
    return SimpleNamespace(vision=vision if vision is not None else StubVision(), vision_refusal="", name="stub",
                           model_type="stub", vocab_size=100, max_seq_len=4096)


def image(data: bytes, position: int = 0) -> WireImage:
    return WireImage.model_validate({"chunk": {"data": data, "format": "png"}, "position": position})


def test_a_sample_prompt_over_the_budget_is_refused_naming_the_image(bombs, no_decoding):
    limits = replace(Limits(), max_decoded_image_bytes=2 * DECODED)
    request = SampleRequest.model_validate({"prompt_tokens": [1, 2, 3], "sampling_params": {"max_tokens": 2}})
    request.prompt_images = [image(b, 1) for b in bombs]
    err = refused(413, "images_too_large", lambda: validate_sample(request, stub_host(), limits))
    assert err.field == "prompt_images[2].chunk.data"
    assert no_decoding == []


def test_forward_datums_are_budgeted_together_before_any_decode(bombs, no_decoding):
    """Two datums of one op: their images count together (the limit fits two of the three)."""
    limits = replace(Limits(), max_decoded_image_bytes=2 * DECODED)
    data = [{"tokens": np.array([1, 2], dtype=np.int64), "target_tokens": np.array([1, 2], dtype=np.int64)}] * 2
    images = [[image(bombs[0]), image(bombs[1], 1)], [image(bombs[2])]]
    err = refused(413, "images_too_large", lambda: validate_rows("cross_entropy", data, stub_host(), limits, images))
    assert err.field == "data[1].images[0].chunk.data"
    limits = replace(limits, max_images_per_request=2)
    err = refused(413, "too_many_images", lambda: validate_rows("cross_entropy", data, stub_host(), limits, images))
    assert err.field == "data[1].images[0].chunk"
    assert no_decoding == []


def test_decoded_images_are_dropped_once_processed_and_identical_ones_decoded_once():
    small = [bilevel_png(i, side=64) for i in range(2)]
    vision = StubVision()
    request_images = RequestImages(stub_host(vision), Limits())
    wire = [image(small[0], 0), image(small[1], 1), image(small[0], 2)]
    request_images.admit([("prompt_images", wire)])
    tokens, spans = request_images.expand(np.array([1, 2, 3], dtype=np.int64), wire, "prompt_tokens",
                                          "prompt_images")
    assert len(spans) == 3 and len(vision.seen) == 2  # the repeated image is processed once
    gc.collect()
    assert all(ref() is None for ref in vision.seen), "a decoded image outlived its processing"

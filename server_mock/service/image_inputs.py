"""Image chunks of a prompt or datum turned into the engine's form, once, before anything is queued.

Every protocol hands its image chunks over as ``WireImage`` (the image's bytes, format, the client's
``expected_tokens`` and the text position it goes before). Here each is decoded within the worker's bounds
(``engine.images``), run through the served model's own processor (``engine.vision``), its token count checked
against ``expected_tokens`` (or filled in), and its tokens put into the sequence: the result is the expanded token
ids and one ``ImageSpan`` per image. Identical images of one request are decoded and processed once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pytrio_compat.wire import WireImage
from server_mock.config import Limits
from server_mock.engine.host import ModelHost
from server_mock.engine.images import ImageDecoder, image_digest
from server_mock.engine.vision import ImageSpan, PreparedImage, check_expected_tokens
from server_mock.errors import WorkerError, bad_request

__all__ = ["RequestImages", "check_takes_images"]


def check_takes_images(host: ModelHost, where: str) -> None:
    """A 400 naming ``where`` unless the served model takes images."""
    if host.vision is None:
        raise bad_request(where, f"image inputs need a vision-language model; {host.name} "
                                 f"({host.model_type}) is text-only", code="unsupported_input")
    if host.vision_refusal:
        raise bad_request(where, f"image inputs are not taken on {host.name}: {host.vision_refusal}",
                          code="unsupported_input")


class RequestImages:
    """The images of one request (a sample prompt, or every datum of a forward op): all checked from their headers
    first (``admit``: at most ``--max-images-per-request`` of them, decoding to at most
    ``--max-decoded-image-bytes``), then each decoded, processed and its pixels dropped; identical ones processed
    once."""

    def __init__(self, host: ModelHost, limits: Limits) -> None:
        self.host = host
        self.decoder = ImageDecoder(limits)
        self._prepared: dict[tuple[str, str], PreparedImage] = {}

    def admit(self, groups: Sequence[tuple[str, Sequence[WireImage] | None]]) -> None:
        """Check every image of the request, by ``(images_field, images)``, before any is decoded: the model takes
        images, their count and the bytes they decode to are within bounds (``ImageDecoder.admit``)."""
        chunks = []
        for field, images in groups:
            if images:
                check_takes_images(self.host, field)
                chunks += [(image.chunk.data, image.chunk.format, f"{field}[{k}].chunk")
                           for k, image in enumerate(images)]
        if chunks:
            self.decoder.admit(chunks)

    def expand(self, text: np.ndarray, images: Sequence[WireImage] | None, where: str,
               images_field: str) -> tuple[np.ndarray, tuple[ImageSpan, ...]]:
        """``text`` (int64 text token ids) with ``images`` put in: the sequence's token ids and its image spans.
        ``where`` names the text tokens' field, ``images_field`` the images' (e.g. ``prompt_images``)."""
        if not images:
            return text, ()
        check_takes_images(self.host, images_field)
        vision = self.host.vision
        placeholder = np.flatnonzero(text == vision.image_token_id)
        if placeholder.size:
            raise bad_request(where, f"token id {vision.image_token_id} at position {int(placeholder[0])} is the "
                                     "model's image placeholder; send each image as an image chunk instead",
                              code="invalid_tokens")
        pieces: list[np.ndarray] = []
        spans: list[ImageSpan] = []
        done = 0  # text tokens placed so far
        length = 0  # tokens of the expanded sequence so far
        for k, image in enumerate(images):
            at = f"{images_field}[{k}]"
            if image.position > len(text):
                raise bad_request(f"{at}.position", f"must be at most the {len(text)} text tokens, got "
                                                    f"{image.position}")
            if image.position < done:
                raise bad_request(f"{at}.position", f"images come in reading order: {image.position} is before "
                                                    f"the previous image's position {done}")
            if k and image.position == done and vision.family.mrope:
                raise bad_request(f"{at}.position", f"is the previous image's position: {self.host.model_type} lays "
                                                    "out its positions per run of image tokens, so two images need "
                                                    "text between them (its <|vision_end|><|vision_start|>)")
            pieces.append(text[done:image.position])
            length += image.position - done
            done = image.position
            prepared = self._prepare(image, f"{at}.chunk")
            check_expected_tokens(prepared, image.chunk.expected_tokens, f"{at}.chunk")
            spans.append(ImageSpan(length, prepared))
            pieces.append(prepared.tokens)
            length += prepared.n_tokens
        pieces.append(text[done:])
        return np.concatenate(pieces).astype(np.int64), tuple(spans)

    def _prepare(self, image: WireImage, where: str) -> PreparedImage:
        key = (image_digest(image.chunk.data), image.chunk.format)
        prepared = self._prepared.get(key)
        if prepared is None:
            decoded = self.decoder.decode(image.chunk.data, image.chunk.format, where)
            try:
                prepared = self._prepared[key] = self.host.vision.prepare(decoded)
            except (ValueError, TypeError) as exc:  # a processor that cannot take this image (e.g. too small)
                raise WorkerError(400, "invalid_image", f"{where}.data: the model's image processor refused "
                                                        f"this {decoded.width}x{decoded.height} image ({exc})",
                                  f"{where}.data") from exc
            del decoded  # its pixels are the processor's inputs now: the RGB copy goes
        return prepared

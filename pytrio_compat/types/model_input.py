"""ModelInput and its chunks: the token sequence a model reads."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator


class EncodedTextChunk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)


class ImageChunk(BaseModel):
    """An inline PNG or JPEG image between text chunks, for a vision-language model. It stands for
    ``expected_tokens`` positions of the sequence (the model's image processor decides how many; the worker checks
    the count, and fills it in for a sample prompt that leaves it out)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: bytes = Field(min_length=1)
    format: Literal["png", "jpeg"]
    expected_tokens: int | None = Field(default=None, gt=0)
    type: Literal["image"] = "image"

    @field_validator("data", mode="before")
    @classmethod
    def _decode_base64(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError("image data must be standard base64") from exc
        return value

    @field_serializer("data", when_used="json")
    def _encode_base64(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    @property
    def length(self) -> int:
        if self.expected_tokens is None:
            raise ValueError("ImageChunk.expected_tokens is needed to compute the length")
        return self.expected_tokens


Chunk = Annotated[Union[EncodedTextChunk, ImageChunk], Field(discriminator="type")]


class ModelInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunks: list[Chunk]

    @classmethod
    def from_ints(cls, tokens: list[int]) -> "ModelInput":
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(chunks=[])

    def append_int(self, token: int) -> "ModelInput":
        return ModelInput.from_ints(self.to_ints() + [int(token)])

    def to_ints(self) -> list[int]:
        if self.has_images:
            raise ValueError("ModelInput holds image chunks; to_ints() works on text-only inputs")
        return [t for chunk in self.chunks for t in chunk.tokens]  # type: ignore[union-attr]

    def tolist(self) -> list[int]:
        return self.to_ints()

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def __len__(self) -> int:
        return self.length

    def text_and_images(self) -> tuple[list[int], list[tuple[int, ImageChunk]]]:
        """The text tokens, and each image chunk with the number of text tokens before it (how the worker's wire
        carries a sequence with images)."""
        tokens: list[int] = []
        images: list[tuple[int, ImageChunk]] = []
        for chunk in self.chunks:
            if isinstance(chunk, ImageChunk):
                images.append((len(tokens), chunk))
            else:
                tokens.extend(chunk.tokens)
        return tokens, images

    @property
    def has_images(self) -> bool:
        return any(isinstance(chunk, ImageChunk) for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.has_images and not any(chunk.tokens for chunk in self.chunks)  # type: ignore[union-attr]

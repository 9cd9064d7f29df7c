"""What the model reads: an ordered list of chunks (encoded text, or an inline image).

Invariant: `len(model_input)` is the number of model positions, i.e. text tokens plus each image's
`expected_tokens`; it is undefined (ValueError) while an image lacks `expected_tokens`.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_serializer, field_validator

from .base import BaseModel


class EncodedTextChunk(BaseModel):
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
    """A PNG or JPEG image. `expected_tokens` is only the client's length estimate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: bytes = Field(min_length=1)
    format: Literal["png", "jpeg"]
    expected_tokens: int | None = Field(default=None, gt=0)
    type: Literal["image"] = "image"

    @field_validator("data", mode="before")
    @classmethod
    def _decode_base64(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        try:
            return base64.b64decode(value, validate=True)
        except ValueError as e:
            raise ValueError("ImageChunk.data: a str must be standard base64") from e

    @field_serializer("data", when_used="json")
    def _encode_base64(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")


ModelInputChunk = Annotated[EncodedTextChunk | ImageChunk, Field(discriminator="type")]


class ModelInput(BaseModel):
    chunks: list[ModelInputChunk]

    @classmethod
    def from_ints(cls, tokens: list[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=list(tokens))])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def append(self, chunk: EncodedTextChunk | ImageChunk) -> ModelInput:
        """A new ModelInput with `chunk` added at the end (self is unchanged)."""
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        """A new ModelInput with one more text token (merged into a trailing text chunk)."""
        if self.chunks and isinstance(self.chunks[-1], EncodedTextChunk):
            last = EncodedTextChunk(tokens=[*self.chunks[-1].tokens, token])
            return ModelInput(chunks=[*self.chunks[:-1], last])
        return self.append(EncodedTextChunk(tokens=[token]))

    def to_ints(self) -> list[int]:
        tokens: list[int] = []
        for chunk in self.chunks:
            if isinstance(chunk, ImageChunk):
                raise ValueError(
                    "ModelInput.to_ints: the input contains image chunks, which have no token ids"
                )
            tokens.extend(chunk.tokens)
        return tokens

    def tolist(self) -> list[int]:
        return self.to_ints()

    @property
    def length(self) -> int:
        return len(self)

    def __len__(self) -> int:
        total = 0
        for chunk in self.chunks:
            if isinstance(chunk, EncodedTextChunk):
                total += len(chunk)
            elif chunk.expected_tokens is None:
                raise ValueError("ModelInput length: an ImageChunk needs expected_tokens to be counted")
            else:
                total += chunk.expected_tokens
        return total

    @property
    def has_images(self) -> bool:
        return any(isinstance(c, ImageChunk) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not any(isinstance(c, ImageChunk) or len(c.tokens) > 0 for c in self.chunks)

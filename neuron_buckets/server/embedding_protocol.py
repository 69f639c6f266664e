"""``POST /v1/embeddings`` on the wire, as OpenAI (and vLLM) define it.

``input`` is a string, a list of strings, a list of token ids or a list of such lists; each is
one embedding, in order. ``encoding_format`` is ``float`` (a list of numbers) or ``base64`` (the
float32 little-endian bytes, base64-encoded), which the ``openai`` client asks for by default and
decodes itself. ``dimensions`` (shortened embeddings) is refused unless it is the model's width:
nb's models are not trained to be cut.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from torch import Tensor

from neuron_buckets.server.openai_protocol import Int

MAX_INPUTS = 2048  # inputs in one request, as OpenAI's limit


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]] = Field(...)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text input
    user: str | None = None

    @field_validator("encoding_format", "add_special_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("input")
    @classmethod
    def _some_inputs(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("input is empty")
        if isinstance(value, list) and len(value) > MAX_INPUTS and not isinstance(value[0], int):
            raise ValueError(f"input holds {len(value)} inputs; at most {MAX_INPUTS} per request")
        return value

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or its token ids."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]  # type: ignore[list-item]
        return list(self.input)  # type: ignore[arg-type]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage

    @classmethod
    def of(cls, vectors: Tensor, model: str, tokens: int, encoding: str) -> EmbeddingResponse:
        """The response for ``vectors`` (N, hidden) float32, encoded as ``encoding`` asks."""
        rows = vectors.float().numpy()

        def encoded(row: np.ndarray) -> list[float] | str:
            if encoding == "base64":
                return base64.b64encode(row.astype("<f4").tobytes()).decode()
            return row.tolist()

        data = [Embedding(index=i, embedding=encoded(row)) for i, row in enumerate(rows)]
        return cls(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

"""The OpenAI wire format that ``nb serve`` speaks: request and response bodies as pydantic models.

Field names, defaults and response shapes follow the OpenAI API as vLLM serves it, so existing
clients (the ``openai`` package, curl scripts, benchmark harnesses) work unchanged; vLLM's own
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``return_token_ids``) are accepted too, and nb's ``speculative: false`` opts a request out of
the server's drafting. Unknown fields are ignored, as OpenAI does, except the
ones that would change the answer and that nb does not implement (``n`` > 1, log probabilities,
penalties, ``echo``...): those are refused by name rather than silently dropped.

Integers are strict: JSON's ``true`` is not the number 1 (pydantic's lax mode would take it as
one), so ``max_tokens: true`` and ``prompt: [true, 1]`` are refused by name.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, field_validator, model_validator

from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampling_params import SamplingParams

Int = Annotated[int, Strict()]  # no bools, no numeric strings

# A field nb does not implement, and the values that mean "not used" (sent by many clients);
# null always does. Chat's ``logprobs`` is a boolean (false: off), completions' a count.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "suffix": (),
    "tools": ([],),
    "response_format": (),
}


def means_off(value: Any, offs: tuple[Any, ...]) -> bool:
    """``value`` is null or one of ``offs``, a bool only where a bool is (``0 == False``)."""
    return value is None or any(
        value == off and isinstance(value, bool) == isinstance(off, bool) for off in offs
    )


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat completions share: the model, sampling and streaming fields."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] = []
    ignore_eos: bool = False
    speculative: bool = True  # nb's: false = no drafts for this request when the server speculates
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's fields are nullable, and some clients send null for "not set"."""
        field = cls.model_fields[info.field_name]
        if value is None and not field.is_required():
            return field.get_default(call_default_factory=True)
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingRequest:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not means_off(value, UNSUPPORTED[name]):
                raise ValueError(f"{name}={value!r} is not supported by nb serve")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, room: int) -> SamplingParams:
        """The engine's parameters; without ``max_tokens`` a request may use all of ``room``, the
        tokens left in ``max_model_len`` after its prompt (vLLM's default). ValueError if out of range.
        """
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=self.max_tokens or max(room, 1),
            temperature=self.temperature,
            top_k=max(self.top_k, 0),  # vLLM and OpenAI clients send -1 for "off"
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            speculative=self.speculative,
        )


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's default for completions
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ValueError(f"prompt: nb serve takes one prompt per request, got {len(self.prompt)}")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("prompt is empty")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        """The plain {role, content} dict that chat templates expect."""
        parts = self.content if isinstance(self.content, list) else [self.content or ""]
        return {"role": self.role, "content": "".join(p if isinstance(p, str) else p.text for p in parts)}


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the artifact's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _newer_name(self) -> ChatCompletionRequest:
        """OpenAI renamed ``max_tokens`` to ``max_completion_tokens`` for chat; take either."""
        self.max_tokens = self.max_completion_tokens or self.max_tokens
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, out: RequestOutput) -> Usage:
        prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None
    token_ids: list[int] | None = None  # vLLM's ``return_token_ids`` extension


class ChatChoice(BaseModel):
    index: int = 0
    message: dict[str, str]
    finish_reason: str | None = None
    logprobs: None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ResponseHeader(BaseModel):
    """The fields every response and stream chunk of one request repeats."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseHeader:
        return cls(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model)


class Completion(ResponseHeader):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletion(ResponseHeader):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(ResponseHeader):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "neuron-buckets"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody

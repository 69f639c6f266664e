"""``POST /v1/completions`` on the wire: the request (one prompt, as text or token ids), its
choices and their logprobs, as OpenAI (and vLLM) define them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from neuron_buckets.engine.logprobs import TokenLogprob
from neuron_buckets.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from neuron_buckets.server.openai_protocol import (
    Int,
    ResponseHeader,
    SamplingRequest,
    TokenText,
    Usage,
    floored,
)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or as token ids.

    ``echo`` puts the prompt before each choice's text, and with ``logprobs`` its tokens' logprobs
    before the choice's (the first token's null); ``max_tokens: 0`` with ``echo`` generates
    nothing: the prompt's logprobs alone, what evaluation harnesses score a text with. As vLLM,
    the engine then runs one token, which the response leaves out."""

    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt
    return_token_ids: bool = False
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_off(cls, value: Any) -> Any:
        """Clients that share one body between the routes send chat's ``false`` for "off"."""
        return None if value is False else value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """The prompt (and its logprobs) back, nothing generated."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, room: int) -> SamplingParams:
        params = super().sampling_params(room)
        if self.echo_only:
            params = replace(params, max_tokens=1)  # 0 would mean "no bound" there
        if self.echo and self.logprobs is not None:
            params = replace(params, prompt_logprobs=self.logprobs)
        return params

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: it needs echo=true (the prompt's logprobs)")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ValueError(f"prompt: nb serve takes one prompt per request, got {len(self.prompt)}")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("prompt is empty")
        return self


class CompletionLogprobs(BaseModel):
    """Completions' logprobs: per token its text, offset in the choice's text, logprob, and the
    top ``logprobs`` tokens with the emitted one (so up to ``logprobs + 1`` entries), as OpenAI's;
    an echoed prompt's first token has null for both (nothing predicts it)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]

    @classmethod
    def of(
        cls, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], text: TokenText,
        offset: int = 0,
    ) -> CompletionLogprobs:
        """``entries[j]`` scores ``token_ids[j]``; None for a prompt's first token."""
        tokens = [text(t) for t in token_ids]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        tops = [
            None if e is None
            else {**{text(t): floored(v) for t, v in e.top}, text(e.token_id): floored(e.logprob)}
            for e in entries
        ]
        return cls(
            text_offset=offsets, token_logprobs=[None if e is None else floored(e.logprob) for e in entries],
            tokens=tokens, top_logprobs=tops,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's ``return_token_ids`` extension


class Completion(ResponseHeader):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None

"""``POST /v1/chat/completions`` on the wire: messages, tools and the tool choice, the reply's
choices, stream chunks and logprobs, as OpenAI (and vLLM) define them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from neuron_buckets.engine.logprobs import TokenLogprob
from neuron_buckets.engine.sampling_params import MAX_LOGPROBS
from neuron_buckets.engine.structured_outputs_params import StructuredOutputsParams
from neuron_buckets.server.hermes_tool_parser import forced_call_tag
from neuron_buckets.server.openai_protocol import (
    STRICT,
    Int,
    ResponseHeader,
    SamplingRequest,
    TokenText,
    Usage,
    floored,
)


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def parsed_arguments(self) -> Any:
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return self.arguments


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's reply: the call it answers
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The plain dict chat templates expect: role and content, and the tool fields when
        given, a call's arguments as an object (templates write them with ``tojson``)."""
        parts = self.content if isinstance(self.content, list) else [self.content or ""]
        message: dict[str, Any] = {
            "role": self.role, "content": "".join(p if isinstance(p, str) else p.text for p in parts)
        }
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.parsed_arguments()}}
                for c in self.tool_calls
            ]
        message.update({k: v for k in ("tool_call_id", "name") if (v := getattr(self, k)) is not None})
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages rendered with the artifact's chat template.

    ``tools`` go to the template; with ``tool_choice`` ``auto`` (the default with tools) the reply's
    ``<tool_call>`` blocks become ``tool_calls``; ``required`` or a named function forces one call
    through the grammar; ``none`` parses nothing.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_completion_tokens: Int | None = Field(None, ge=1)
    add_special_tokens: bool = False  # vLLM's: special tokens beyond those the template writes
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _newer_name(self) -> ChatCompletionRequest:
        """OpenAI renamed ``max_tokens`` to ``max_completion_tokens`` for chat; take either."""
        self.max_tokens = self.max_completion_tokens or self.max_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        declared = [t.function.name for t in self.tools or []]
        if self.forced_tool_choice and not declared:
            raise ValueError(f"tool_choice={self.forced_tool_choice!r} needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in declared:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        shaped = self.response_format is not None and self.response_format.type != "text"
        if self.forced_tool_choice and shaped:
            raise ValueError("response_format and a forced tool_choice cannot both shape the reply")
        return self

    @property
    def forced_tool_choice(self) -> str | None:
        """``required``, or the named function's name, or None when no call is forced."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if (forced := self.forced_tool_choice) is None:
            return super().structured_outputs()
        functions = [
            (t.function.name, t.function.parameters) for t in self.tools or []
            if forced == "required" or t.function.name == forced
        ]
        return StructuredOutputsParams(structural_tag=forced_call_tag(functions))

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]

    @classmethod
    def of(cls, token: str, logprob: float) -> TopLogprob:
        return cls(token=token, logprob=floored(logprob), bytes=list(token.encode()))


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat's logprobs: per token its text, bytes, logprob and the ``top_logprobs`` most likely."""

    content: list[ChatTokenLogprob]

    @classmethod
    def of(cls, entries: Sequence[TokenLogprob], text: TokenText) -> ChatLogprobs:
        return cls(content=[
            ChatTokenLogprob(
                **TopLogprob.of(text(e.token_id), e.logprob).model_dump(),
                top_logprobs=[TopLogprob.of(text(t), v) for t, v in e.top],
            )
            for e in entries
        ])


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ToolCallDelta(ToolCall):
    index: int


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(ResponseHeader):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(ResponseHeader):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None

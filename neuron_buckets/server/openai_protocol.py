"""The OpenAI wire format that ``nb serve`` speaks: request and response bodies as pydantic models.

Field names, defaults and response shapes follow the OpenAI API as vLLM serves it, so existing
clients (the ``openai`` package, curl scripts, benchmark harnesses) work unchanged; vLLM's own
extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``add_special_tokens``, ``return_token_ids``) are accepted too, and nb's ``speculative: false``
opts a request out of the server's drafting. ``logprobs`` (and chat's ``top_logprobs``), ``n``,
``best_of``, ``response_format``, completions' ``echo`` and chat's ``tools``/``tool_choice`` are
implemented (the engine's logprobs, prompt logprobs and structured outputs, and
``hermes_tool_parser.py``). Every other OpenAI or vLLM field is in one of two tables, shared by
completions and chat: ``UNSUPPORTED``, the fields that would change the answer
and that nb does not implement, refused by name unless they hold a value that means "not used";
and ``IGNORED``, the fields accepted because they never change the answer, each with the reason.
Fields in neither table are ignored, as vLLM does.

Types are strict: JSON's ``true`` is not the number 1 (pydantic's lax mode would take it as one),
and ``"yes"`` is not a boolean, so ``temperature: true``, ``stream: "yes"`` and ``prompt: [true, 1]``
are refused by name.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, field_validator, model_validator

from neuron_buckets.engine.logprobs import TokenLogprob
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from neuron_buckets.engine.structured_outputs_params import StructuredOutputsParams
from neuron_buckets.server.hermes_tool_parser import forced_call_tag

Int = Annotated[int, Strict()]  # no bools, no numeric strings
STRICT = ConfigDict(strict=True)  # no bools as numbers, no strings as booleans
# Choices one request may ask for: each is a request of its own in the engine.
MAX_N = 64
# What JSON cannot hold: a logprob of -inf is sent as this, as vLLM does.
LOGPROB_FLOOR = -9999.0

# The fields nb does not implement, and the values that mean "not used" (sent by many clients);
# null always does. A field one endpoint implements is declared on its model, so it never reaches
# this table there: ``max_completion_tokens`` and ``top_logprobs`` are chat's, refused on
# completions (whose ``logprobs`` is the count), and ``echo`` is completions', refused on chat.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # OpenAI's
    "echo": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "suffix": ("",),
    "max_completion_tokens": (),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "reasoning_effort": (),
    "verbosity": (),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
    # vLLM's
    "prompt_embeds": (),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structural_tag": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "include_reasoning": (True,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": ([],),
    "mm_processor_kwargs": ({},),
    "priority": (0,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": ({},),
}

# The fields accepted and ignored, and why ignoring them never changes the answer.
IGNORED: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring",
    "metadata": "tags for stored completions, and nb stores none",
    "store": "whether the provider keeps the completion, and nb keeps none",
    "service_tier": "the provider's pricing and latency tier",
    "safety_identifier": "an end-user id for the provider's abuse monitoring",
    "prompt_cache_key": "a routing hint for the provider's prompt cache; nb's prefix cache needs none",
    "parallel_tool_calls": "every call the model writes is parsed; a forced tool_choice writes one",
    "length_penalty": "read only by beam search, which is refused",
    "request_id": "names vLLM's response; nb names its own",
}


def means_off(value: Any, offs: tuple[Any, ...]) -> bool:
    """``value`` is null or one of ``offs``, a bool only where a bool is (``0 == False``)."""
    return value is None or any(
        value == off and isinstance(value, bool) == isinstance(off, bool) for off in offs
    )


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's ``name``, ``schema``, ``strict``, ``description``."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    name: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")


class ResponseFormat(BaseModel):
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.json_schema  # its key order is the output's: not sorted
            return StructuredOutputsParams(json=json.dumps(schema))
        return None


class SamplingRequest(BaseModel):
    """What completions and chat completions share: the model, sampling and streaming fields."""

    model_config = ConfigDict(extra="allow", strict=True)

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
    min_tokens: Int = Field(0, ge=0)
    n: Int = Field(1, ge=1, le=MAX_N)  # choices: each seeded from ``seed`` (seed + its index)
    best_of: Int | None = Field(None, ge=1, le=MAX_N)  # run this many, return the n most likely
    response_format: ResponseFormat | None = None
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
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} must be at least n={self.n}")
        if self.stream and self.runs > self.n:
            raise ValueError("best_of > n cannot be streamed: the best are known only at the end")
        return self

    @property
    def runs(self) -> int:
        """The sequences generated: ``best_of`` (the ``n`` most likely are returned), else ``n``."""
        return self.best_of or self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token (0: the emitted token's only); None: no logprobs."""
        return None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar the output must match, if any."""
        return None if self.response_format is None else self.response_format.structured_outputs()

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
            min_tokens=self.min_tokens,
            speculative=self.speculative,
            logprobs=self.num_logprobs,
            structured_outputs=self.structured_outputs(),
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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, outs: Sequence[RequestOutput]) -> Usage:
        """One request's usage: its prompt once, the tokens of all its choices."""
        prompt, completion = len(outs[0].prompt_token_ids), sum(len(out.token_ids) for out in outs)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


TokenText = Callable[[int], str]  # a token's text as logprobs name it


def floored(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's ``return_token_ids`` extension


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

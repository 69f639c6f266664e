"""The OpenAI wire format that ``nb serve`` speaks: what every endpoint shares, as pydantic models.

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

Each endpoint's own models live beside it: ``completion_protocol.py``, ``chat_protocol.py``,
``embedding_protocol.py``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, field_validator, model_validator

from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.structured_outputs_params import StructuredOutputsParams

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


class ResponseHeader(BaseModel):
    """The fields every response and stream chunk of one request repeats."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseHeader:
        return cls(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "neuron-buckets"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's content digest (vLLM: its path)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

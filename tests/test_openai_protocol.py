"""The OpenAI request bodies ``nb serve`` accepts, and the engine parameters they become."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.structured_outputs_params import StructuredOutputsParams
from neuron_buckets.server.chat_protocol import ChatCompletionRequest
from neuron_buckets.server.completion_protocol import CompletionRequest
from neuron_buckets.server.openai_protocol import IGNORED, UNSUPPORTED


def test_fields_map_to_the_engine_parameters_and_chat_without_max_tokens_fills_the_room():
    fields = {"prompt": [[1, 2]], "temperature": 0.5, "top_k": -1, "stop": "\n", "seed": 3}
    body = CompletionRequest.model_validate(fields)
    assert body.prompt == [1, 2]
    assert body.sampling_params(room=40) == SamplingParams(
        max_tokens=16, temperature=0.5, top_k=0, seed=3, stop=("\n",)
    )
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.sampling_params(room=40).max_tokens == 40
    opted_out = CompletionRequest.model_validate({"prompt": "hi", "speculative": False})
    assert not opted_out.sampling_params(room=40).speculative and body.sampling_params(room=40).speculative


def test_null_means_the_default_as_openai_clients_send_it():
    fields = {"prompt": "x", "temperature": None, "max_tokens": None, "user": None}
    body = CompletionRequest.model_validate(fields)
    assert (body.temperature, body.max_tokens) == (1.0, 16)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": parts}], "max_tokens": 5, "max_completion_tokens": 7}
    )
    assert chat.max_tokens == 7 and chat.messages[0].as_template_input() == {"role": "user", "content": "ab"}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"best_of": 2, "n": 3}, "best_of=2 must be at least n=3"),
        ({"best_of": 2, "stream": True}, "best_of > n cannot be streamed"),
        ({"max_tokens": 0}, "max_tokens=0 generates nothing: it needs echo=true"),
        ({"top_logprobs": 2}, "top_logprobs=2 is not supported"),  # chat's, not completions'
        ({"n": 0}, "greater than or equal to 1"),
        ({"logprobs": 21}, "less than or equal to 20"),
        ({"prompt": ["a", "b"]}, "one prompt per request, got 2"),
        ({"prompt": ""}, "prompt is empty"),
        ({"max_tokens": -1}, "greater than or equal to 0"),
    ],
)
def test_what_would_change_the_answer_and_is_not_implemented_is_refused_by_name(fields, message):
    with pytest.raises(ValidationError, match=message):
        CompletionRequest.model_validate({"prompt": "x", **fields})


def test_echo_with_logprobs_asks_the_engine_for_the_prompts_logprobs():
    def params(**fields):
        return CompletionRequest.model_validate({"prompt": "x", **fields}).sampling_params(room=40)

    scored = params(echo=True, max_tokens=0, logprobs=3)  # lm-eval's loglikelihood
    assert (scored.max_tokens, scored.prompt_logprobs, scored.logprobs) == (1, 3, 3)  # its token: dropped
    assert (params(echo=True, max_tokens=5).max_tokens, params(echo=True).prompt_logprobs) == (5, None)
    assert params(logprobs=2).prompt_logprobs is None  # without echo the prompt is not scored


# vLLM's request fields (vllm/entrypoints/openai/protocol.py: CompletionRequest and
# ChatCompletionRequest, which follow OpenAI's own and add vLLM's sampling and extra parameters),
# and the OpenAI chat fields vLLM does not declare.
VLLM_COMPLETION_FIELDS = (
    "model", "prompt", "prompt_embeds", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
    "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
)
VLLM_CHAT_FIELDS = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "user",
    "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words",
    "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structural_tag", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
)
OPENAI_CHAT_FIELDS = (
    "functions", "function_call", "metadata", "store", "service_tier", "modalities", "audio",
    "prediction", "web_search_options", "verbosity", "safety_identifier", "prompt_cache_key",
)
MESSAGES = [{"role": "user", "content": "hi"}]
ENDPOINTS = {
    "completions": (CompletionRequest, {"prompt": "x"}, VLLM_COMPLETION_FIELDS),
    "chat": (ChatCompletionRequest, {"messages": MESSAGES}, VLLM_CHAT_FIELDS + OPENAI_CHAT_FIELDS),
}


class NotOff:
    """A value no field takes as "not used"."""


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_vllm_field_is_implemented_refused_by_name_or_harmless_for_a_stated_reason(endpoint):
    model, base, fields = ENDPOINTS[endpoint]
    assert not UNSUPPORTED.keys() & IGNORED.keys()
    for name in fields:
        if name in model.model_fields:  # implemented (an endpoint's own field wins over the tables)
            assert name not in IGNORED
            continue
        assert name in UNSUPPORTED or name in IGNORED, f"{endpoint}: {name} is neither implemented nor listed"
        if name in UNSUPPORTED:
            with pytest.raises(ValidationError, match=rf"{name}=.* is not supported by nb serve"):
                model.model_validate({**base, name: NotOff()})
            model.model_validate({**base, name: None})  # null is "not used"
        elif name in IGNORED:
            assert IGNORED[name] and model.model_validate({**base, name: "anything"})


@pytest.mark.parametrize(
    "endpoint, fields",
    [
        ("completions", {"bad_words": ["a"]}),
        ("completions", {"allowed_token_ids": [1, 2]}),
        ("completions", {"guided_json": {"type": "object"}}),
        ("completions", {"use_beam_search": True}),
        ("completions", {"max_completion_tokens": 3}),
        ("chat", {"functions": [{"name": "f", "parameters": {}}]}),
        ("chat", {"guided_regex": "a+"}),
        ("chat", {"include_stop_str_in_output": True}),
        ("chat", {"echo": True}),
    ],
)
def test_fields_that_change_the_answer_are_refused_by_name_on_either_endpoint(endpoint, fields):
    model, base, _ = ENDPOINTS[endpoint]
    name = next(iter(fields))
    with pytest.raises(ValidationError, match=rf"{name}=.* is not supported by nb serve"):
        model.model_validate({**base, **fields})


def test_logprobs_and_n_map_to_the_engine_parameters():
    completion = CompletionRequest.model_validate({"prompt": "x", "logprobs": 0, "n": 3})
    assert completion.sampling_params(8).logprobs == 0 and completion.n == 3
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, "logprobs": True, "top_logprobs": 5})
    assert chat.sampling_params(8).logprobs == 5
    off = ChatCompletionRequest.model_validate({"messages": MESSAGES, "logprobs": False, "top_logprobs": 0})
    assert off.sampling_params(8).logprobs is None
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs: true"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "top_logprobs": 2})


def test_response_format_becomes_the_structured_outputs_of_the_engine():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "response_format": fmt})
    expected = StructuredOutputsParams(json=json.dumps(schema))
    assert body.sampling_params(8).structured_outputs == expected
    fmt = {"type": "json_object"}
    json_object = CompletionRequest.model_validate({"prompt": "x", "response_format": fmt})
    assert json_object.sampling_params(8).structured_outputs == StructuredOutputsParams(json_object=True)
    text = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}})
    assert text.sampling_params(8).structured_outputs is None
    with pytest.raises(ValidationError, match="needs json_schema.schema"):
        CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_schema"}})


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tool_choice": "required"}, "tool_choice='required' needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g', which is"),
        ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "both"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_tool_choices_that_cannot_be_served_are_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_a_forced_tool_choice_is_a_grammar_and_auto_parses_without_one():
    def chat(**fields) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [TOOL], **fields})

    auto = chat()
    assert auto.tool_choice == "auto" and auto.parses_tool_calls
    assert auto.sampling_params(8).structured_outputs is None
    assert "<tool_call>" in chat(tool_choice="required").sampling_params(8).structured_outputs.structural_tag
    none = chat(tool_choice="none")
    assert not none.parses_tool_calls and none.template_tools() == [TOOL]


def test_values_that_mean_not_used_are_accepted_as_clients_send_them():
    off = {"n": 1, "logprobs": False, "response_format": {"type": "text"}, "tool_choice": "auto", "tools": [],
           "skip_special_tokens": True, "min_tokens": 0, "parallel_tool_calls": True, "user": "me"}
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, **off})
    assert body.sampling_params(8).max_tokens == 8


@pytest.mark.parametrize(
    "fields, where",
    [
        ({"temperature": True}, "temperature"),
        ({"top_p": False}, "top_p"),
        ({"min_p": "0.5"}, "min_p"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"ignore_eos": "true"}, "ignore_eos"),
        ({"speculative": 0}, "speculative"),
        ({"add_special_tokens": "no"}, "add_special_tokens"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"seed": True}, "seed"),
    ],
)
def test_booleans_are_not_numbers_and_strings_are_not_booleans(fields, where):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", **fields})
    assert [".".join(map(str, err["loc"])) for err in e.value.errors()] == [where]
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1}
    assert ChatCompletionRequest.model_validate(chat).temperature == 1.0  # an integer is a number

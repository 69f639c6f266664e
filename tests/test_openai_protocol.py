"""The OpenAI request bodies ``nb serve`` accepts, and the engine parameters they become."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.server.openai_protocol import ChatCompletionRequest, CompletionRequest


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
        ({"n": 2}, "n=2 is not supported"),
        ({"logprobs": 1}, "logprobs=1 is not supported"),
        ({"prompt": ["a", "b"]}, "one prompt per request, got 2"),
        ({"prompt": ""}, "prompt is empty"),
        ({"max_tokens": 0}, "greater than or equal to 1"),
    ],
)
def test_what_would_change_the_answer_and_is_not_implemented_is_refused_by_name(fields, message):
    with pytest.raises(ValidationError, match=message):
        CompletionRequest.model_validate({"prompt": "x", **fields})

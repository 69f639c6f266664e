"""What ``nb serve`` accepts and what it refuses, over HTTP: values that underflow in float32 give
greedy's tokens, unimplemented fields and loose types are 400s in OpenAI's shape, stop strings are
bounded, and with a key the API's description needs it too. One eager artifact with a tokenizer
serves the module (no graph compile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.sampling_params import MAX_STOP_CHARS
from neuron_buckets.server.access import ServerAccess
from tests.test_serve import MODEL, post
from tests.test_serve_hostile import get, raw_post, serving

pytestmark = pytest.mark.xdist_group("serve")
PROMPT = [5, 9, 3, 7, 11]


@pytest.fixture(scope="module")
def base(text_artifact: Path):
    with serving(LLMEngine.open(text_artifact)) as (url, _):
        yield url


def completion(base: str, **fields) -> tuple[int, dict]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    return post(f"{base}/v1/completions", {**body, **fields})


def refused(status: int, body: dict, *words: str) -> str:
    """The message of a 400 in OpenAI's error shape, checked to name ``words``."""
    assert status == 400, body
    error = body["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError", body
    assert all(w in error["message"] for w in words), error["message"]
    return error["message"]


@pytest.mark.parametrize(
    "fields", [{"temperature": 1e-45}, {"temperature": 1e-38}, {"temperature": 1.0, "top_p": 1e-50}],
    ids=["temperature-1e-45", "temperature-1e-38", "top-p-1e-50"],
)
def test_values_that_underflow_in_float32_give_greedys_tokens(base, fields):
    status, greedy = completion(base, temperature=0)
    assert status == 200, greedy
    status, body = completion(base, seed=1, **fields)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    "route, fields",
    [
        ("completions", {"bad_words": ["a"]}),
        ("completions", {"allowed_token_ids": [5, 6]}),
        ("completions", {"guided_json": {"type": "object"}}),
        ("completions", {"use_beam_search": True}),
        ("completions", {"max_completion_tokens": 2}),
        ("chat/completions", {"functions": [{"name": "f", "parameters": {}}]}),
        ("chat/completions", {"bad_words": ["a"]}),
    ],
)
def test_fields_that_would_change_the_answer_are_refused_by_name(base, route, fields):
    body = {"prompt": PROMPT} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    name = next(iter(fields))
    refused(*post(f"{base}/v1/{route}", {**body, **fields}), name, "is not supported by nb serve")


def test_min_tokens_masks_the_stop_id_greedy_reaches_first(base):
    """The first greedy token, made a stop id, ends the request at once; with ``min_tokens`` 3 it
    is masked for three tokens, and a min_tokens above max_tokens is a 400 that names it."""
    status, greedy = completion(base, temperature=0)
    first = greedy["choices"][0]["token_ids"][0]
    status, stopped = completion(base, temperature=0, stop_token_ids=[first])
    assert status == 200 and stopped["choices"][0]["token_ids"] == [first], stopped
    status, body = completion(base, temperature=0, stop_token_ids=[first], min_tokens=3)
    assert status == 200, body
    tokens = body["choices"][0]["token_ids"]
    assert first not in tokens[:3] and (len(tokens) == 8 or (len(tokens) > 3 and tokens[-1] == first))
    refused(*completion(base, min_tokens=9), "min_tokens must be an integer in [0, max_tokens=8]")


@pytest.mark.parametrize(
    "fields, name",
    [({"temperature": True}, "temperature"), ({"stream": "yes"}, "stream"),
     ({"max_tokens": True}, "max_tokens")],
)
def test_booleans_are_not_numbers_and_strings_are_not_booleans(base, fields, name):
    refused(*completion(base, **fields), name)


def test_a_megabyte_of_stop_strings_is_refused_by_the_stated_bound(base):
    stop = ["x" * 1000] * 1000
    message = refused(*completion(base, stop=stop), "stop: at most 64 strings of")
    assert f"{MAX_STOP_CHARS} characters in all, got 1000 with 1000000 characters" in message
    status, body = completion(base, stop=["z" * MAX_STOP_CHARS])  # at the bound: served
    assert status == 200, body


def test_the_api_description_needs_the_key_when_there_is_one(text_artifact):
    paths = ("/openapi.json", "/docs", "/redoc")
    with serving(LLMEngine.open(text_artifact), access=ServerAccess(api_key="k3y")) as (url, _):
        assert [get(url + p) for p in paths] == [401] * 3
        assert [get(url + p, {"Authorization": "Bearer k3y"}) for p in paths] == [200] * 3
        status, body = raw_post(f"{url}/v1/completions", {"prompt": PROMPT}, {})
        assert status == 401 and body["error"]["code"] == 401
    with serving(LLMEngine.open(text_artifact)) as (url, _):
        assert [get(url + p) for p in paths] == [200] * 3

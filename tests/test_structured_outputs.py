"""Structured outputs through ``nb serve`` with the official ``openai`` client, on a random-weight
model: its text is noise, so only the grammar can make it valid JSON of the schema.

The artifact has room for long outputs (a string of 4 characters may take 24 byte tokens, each
an escape) and decode rows of 4 positions, so prompt-lookup drafts are verified under the grammar.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.structured_output_manager import unenforced_keyword
from tests.conftest import TEXT_EAGER, write_config
from tests.test_serve import MODEL, client, metric_samples, serving, total
from tests.test_serve_openai_fields import oracle as oracle  # transformers' log-softmax, a fixture

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]

ROOMY = (
    TEXT_EAGER.replace("num_blocks = 64", "num_blocks = 160")
    .replace("max_model_len = 128", "max_model_len = 256")
    .replace("max_num_batched_tokens = 32", "max_num_batched_tokens = 32\nspeculation_length = 3")
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def roomy_artifact(text_model, tmp_path_factory: pytest.TempPathFactory):
    from typer.testing import CliRunner

    from neuron_buckets.cli import app

    tmp = tmp_path_factory.mktemp("roomy")
    config = write_config(tmp, text_model[0], ROOMY)
    args = ["compile", str(config), "--out", str(tmp / "art"), "--cache-dir", str(tmp / "c")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return tmp / "art"


@pytest.mark.parametrize("drafts", [0, 3], ids=["plain", "drafted"])
def test_json_schema_completions_all_parse_and_validate(roomy_artifact, drafts):
    speculative = SpeculativeConfig(num_speculative_tokens=drafts, auto_off=False) if drafts else None
    engine = LLMEngine.open(roomy_artifact, speculative=speculative)
    count = 50 if not drafts else 20
    with serving(engine) as base:
        c = client(base)
        for seed in range(count):
            if seed % 2:
                out = c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "a pet"}], max_tokens=220,
                    temperature=1.0, seed=seed, response_format=FORMAT,
                )
                text, reason = out.choices[0].message.content, out.choices[0].finish_reason
            else:
                out = c.completions.create(
                    model=MODEL, prompt="a pet:", max_tokens=220, temperature=1.0, seed=seed,
                    extra_body={"response_format": FORMAT},
                )
                text, reason = out.choices[0].text, out.choices[0].finish_reason
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)
        masks = total(metric_samples(base), "nb:engine_grammar_masks_total")
    assert masks == engine.step_stats.grammar_masks > 0 and engine.step_stats.grammar_seconds > 0
    if drafts:
        assert engine.spec_stats.num_draft_tokens > 0


def test_json_object_and_refused_schemas(roomy_artifact):
    with serving(LLMEngine.open(roomy_artifact)) as base:
        c = client(base)
        out = c.completions.create(
            model=MODEL, prompt="an object:", max_tokens=200, temperature=0.0,
            extra_body={"response_format": {"type": "json_object"}},
        )
        assert out.choices[0].text.startswith("{")
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(out.choices[0].text), dict)
        unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
        bad_type = {"type": "object", "properties": {"a": {"type": "foo"}}}
        for schema, message in ((unique, "'uniqueItems' (at $), which nb cannot enforce"),
                                (bad_type, 'Unsupported type "foo"')):
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            with pytest.raises(openai.BadRequestError, match=re.escape(message)):
                c.completions.create(
                    model=MODEL, prompt="x", max_tokens=5, extra_body={"response_format": fmt}
                )


def test_unenforced_keywords_are_found_where_schemas_are_not_where_names_are():
    assert unenforced_keyword({"properties": {"not": {"type": "string"}}}) is None  # a property named "not"
    nested = {"properties": {"a": {"items": [{"type": "string"}, {"if": {}}]}}}
    assert unenforced_keyword(nested) == "'if' (at $.properties.a.items[1])"
    assert unenforced_keyword({"$ref": "https://example.com/s.json"}).startswith("an external $ref")
    assert unenforced_keyword({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}) is None


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
    }}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    }}},
]
DECLARED = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_required_and_named_tool_choices_always_return_a_call_to_a_declared_function(roomy_artifact):
    with serving(LLMEngine.open(roomy_artifact)) as base:
        c = client(base)
        messages = [{"role": "user", "content": "weather?"}]
        for seed in range(50):
            named = seed % 5 == 4
            choice = {"type": "function", "function": {"name": "get_time"}} if named else "required"
            out = c.chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=200,
                temperature=1.0, seed=seed, stream=seed % 10 == 9,
            )
            if seed % 10 == 9:  # streamed: the call comes whole, in one chunk
                chunks = [ch.choices[0] for ch in out if ch.choices]
                calls = [tc for ch in chunks for tc in ch.delta.tool_calls or []]
                reason = chunks[-1].finish_reason
            else:
                calls, reason = out.choices[0].message.tool_calls, out.choices[0].finish_reason
            assert reason == "tool_calls" and len(calls) == 1
            function = calls[0].function
            assert function.name == "get_time" if named else function.name in DECLARED
            jsonschema.validate(json.loads(function.arguments), DECLARED[function.name])
        # the call goes back to the template as an assistant turn, then the tool's answer
        history = [*messages, {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                   {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"}]
        out = c.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4,
            extra_body={"ignore_eos": True},  # random weights may draw the end of text before the cap
        )
        assert out.choices[0].message.tool_calls == [] and out.choices[0].finish_reason == "length"


def test_logprobs_of_accepted_drafts_are_transformers_log_softmax(roomy_artifact, oracle):
    speculative = SpeculativeConfig(num_speculative_tokens=3, auto_off=False)
    engine = LLMEngine.open(roomy_artifact, speculative=speculative)
    prompt = [0, *([7, 8, 9, 10] * 6)]  # prompt lookup finds drafts in it
    with serving(engine) as base:
        out = client(base).completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=3,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    choice = out.choices[0]
    assert engine.spec_stats.num_accepted_tokens > 0
    expected = oracle(prompt, choice.token_ids)
    assert choice.token_ids == expected.argmax(dim=-1).tolist()
    emitted = expected.max(dim=-1).values
    assert choice.logprobs.token_logprobs == pytest.approx(emitted.tolist(), abs=1e-4)

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
from neuron_buckets.engine.llm_engine import LLMEngine, generate
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.structured_output_manager import unenforced_keyword
from neuron_buckets.engine.structured_outputs_params import StructuredOutputsParams
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


# A grammar wins over min_tokens: the request ends where the grammar ends ("stop"), however many
# tokens min_tokens still asks for. Each check below counts the answers it validated (a floor).
SMALL = {
    "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
    "additionalProperties": False,
}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}  # the last chunk counts the tokens
FEW = 40  # min_tokens: well past any SMALL answer ({"a":false} is a dozen byte tokens)


def grammar_ended(text: str, reason: str, used: int, schema: dict, max_tokens: int, min_tokens: int) -> bool:
    """Whether the answer ended with its grammar: valid JSON of ``schema``, finish reason ``stop``,
    before ``min_tokens``. The only other end allowed is a cut at ``max_tokens`` (False)."""
    if reason == "length":
        assert used == max_tokens, text
        return False
    assert reason == "stop" and used < min_tokens, (reason, used, text)
    jsonschema.validate(json.loads(text), schema)
    return True


@pytest.mark.parametrize("drafts", [0, 3], ids=["plain", "drafted"])
def test_requests_end_where_their_grammar_ends_whatever_min_tokens_or_ignore_eos_say(roomy_artifact, drafts):
    """Engine requests, sampled (several seeds) and greedy, with ``min_tokens`` past the schema's
    answer: each ends at the end-of-sequence token that completes its grammar, and the text is
    the JSON alone. Also with ``ignore_eos``, and with the grammar's only allowed first token
    ("{") made a stop id, which ``min_tokens`` would mask: the grammar keeps it."""
    speculative = SpeculativeConfig(num_speculative_tokens=drafts, auto_off=False) if drafts else None
    engine = LLMEngine.open(roomy_artifact, speculative=speculative)
    brace = engine.tokenizer.hf.encode("{", add_special_tokens=False)
    assert len(brace) == 1
    small = StructuredOutputsParams(json=json.dumps(SMALL))
    variants = [{}, {"ignore_eos": True}, {"stop_token_ids": tuple(brace)}]
    sampling = [{"temperature": 0.0}, *({"temperature": 1.0, "seed": seed} for seed in range(4))]
    params = [
        SamplingParams(max_tokens=FEW + 8, min_tokens=FEW, structured_outputs=small, **v, **t)
        for v in variants for t in sampling
    ]
    prompt = engine.tokenizer.hf.encode('{"a": true} {"a": false} {"a": ')  # prompt lookup drafts from it
    outs = generate(engine, [prompt] * len(params), params)
    for out in outs:
        assert out.stop_reason in engine.eos_token_ids, out
        assert grammar_ended(out.text, out.finish_reason, len(out.token_ids), SMALL, FEW + 8, FEW)
    assert len(outs) == 15
    if drafts:
        assert engine.spec_stats.num_accepted_tokens > 0


def test_json_schema_and_forced_tool_call_answers_end_with_the_grammar_through_serve(roomy_artifact):
    """``min_tokens`` past the answer, through ``nb serve`` and the ``openai`` client: JSON schema
    completions and chats, sampled (several seeds) and greedy, streamed and whole, and calls to a
    named tool with ``min_tokens`` 100. Every answer is the grammar's and nothing after it, or a
    cut at ``max_tokens``: the long schema, asked with ``max_tokens`` = ``min_tokens``, mostly is."""
    small = {"type": "json_schema", "json_schema": {"name": "flag", "schema": SMALL}}
    checked, cut = 0, 0
    with serving(LLMEngine.open(roomy_artifact)) as base:
        c = client(base)
        for seed in range(12):
            schema, fmt, max_tokens = (SCHEMA, FORMAT, FEW) if seed % 3 == 2 else (SMALL, small, FEW + 8)
            sampling = {"temperature": 0.0} if seed % 4 == 0 else {"temperature": 1.0, "seed": seed}
            stream = seed % 2 == 1
            sampling |= STREAM if stream else {}
            extra = {"min_tokens": FEW, "response_format": fmt}
            if seed % 4 < 2:
                out = c.completions.create(
                    model=MODEL, prompt="a flag:", max_tokens=max_tokens, extra_body=extra, **sampling
                )
                text, reason, used = streamed_or_whole(out, stream, lambda ch: ch.text, lambda ch: ch.text)
            else:
                out = c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "a flag"}], max_tokens=max_tokens,
                    extra_body=extra, **sampling,
                )
                text, reason, used = streamed_or_whole(
                    out, stream, lambda ch: ch.delta.content, lambda ch: ch.message.content
                )
            if grammar_ended(text, reason, used, schema, max_tokens, FEW):
                checked += 1
            else:
                cut += 1
        messages = [{"role": "user", "content": "time?"}]
        named = {"type": "function", "function": {"name": "get_time"}}
        for seed in range(6):
            sampling = {"temperature": 0.0} if seed == 0 else {"temperature": 1.0, "seed": seed}
            stream = seed % 2 == 1
            sampling |= STREAM if stream else {}
            out = c.chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=200,
                extra_body={"min_tokens": 100}, **sampling,
            )
            if stream:
                chunks = list(out)
                used = chunks[-1].usage.completion_tokens
                choices = [ch.choices[0] for ch in chunks if ch.choices]  # the role's, then the reply's
                assert not any(ch.delta.content for ch in choices[:-1])  # a reply with tools comes whole
                message, reason = choices[-1].delta, choices[-1].finish_reason
            else:
                message, reason = out.choices[0].message, out.choices[0].finish_reason
                used = out.usage.completion_tokens
            assert reason == "tool_calls" and len(message.tool_calls) == 1 and not message.content, message
            assert message.tool_calls[0].function.name == "get_time" and used < 100
            jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), DECLARED["get_time"])
            checked += 1
    assert checked >= 6 + 8 and checked + cut == 18


def streamed_or_whole(out, stream: bool, piece, whole) -> tuple[str, str, int]:
    """A choice's (text, finish reason, completion tokens), from a stream's chunks (the last one
    carries the usage) or a whole response; ``piece`` and ``whole`` read a chunk's and a choice's text."""
    if not stream:
        return whole(out.choices[0]), out.choices[0].finish_reason, out.usage.completion_tokens
    chunks = list(out)
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    text = "".join(piece(ch) or "" for ch in choices)
    return text, choices[-1].finish_reason, chunks[-1].usage.completion_tokens

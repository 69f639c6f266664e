"""Hermes/Qwen ``<tool_call>`` blocks parsed into OpenAI tool calls."""

from __future__ import annotations

import json

from neuron_buckets.server.hermes_tool_parser import forced_call_tag, parse


def test_calls_are_parsed_and_the_text_around_them_kept():
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse(text)
    assert content == "Let me look."
    named = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert named == [("f", {"x": 1}), ("g", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_what_is_not_a_call_stays_text():
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    for text in ("no calls here", "<tool_call>{not json}</tool_call>", nameless, '<tool_call>{"name": "f"'):
        assert parse(text) == (text, [])


def test_the_forced_tag_wraps_one_call_to_one_of_the_functions():
    tag = json.loads(forced_call_tag([("f", {"type": "object"}), ("g", {"type": "object"})]))
    start, call, end = tag["format"]["elements"]
    assert (start["value"], end["value"]) == ("<tool_call>\n", "\n</tool_call>")
    assert [s["properties"]["name"] for s in call["json_schema"]["anyOf"]] == [{"const": "f"}, {"const": "g"}]

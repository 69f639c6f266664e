"""Tool calls in the Hermes/Qwen form: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Chat templates of Hermes, Qwen 2/2.5/3 and many fine-tunes tell the model to write calls this
way (vLLM's ``hermes`` parser reads them). ``parse`` turns a reply into its text and OpenAI
``tool_calls``; ``forced_call_tag`` is the structural tag that makes the model write exactly one
call to one of the given functions (``tool_choice`` ``required`` or a named function), its
arguments valid against the function's JSON schema.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

START, END = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)
# Free whitespace the call's JSON may hold at each point: bounded, so a model that would emit
# spaces forever still has to write the call.
MAX_WHITESPACE = 1


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_tag(functions: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The structural tag (xgrammar's JSON form) of one call to one of ``functions``, each a
    (name, parameters schema) pair."""
    schema = {"anyOf": [call_schema(name, parameters) for name, parameters in functions]}
    call = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
    elements = [
        {"type": "const_string", "value": START + "\n"}, call, {"type": "const_string", "value": "\n" + END}
    ]
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": elements}})


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's text outside its calls (None when nothing is left) and its calls, in OpenAI's
    shape; a block that is not a JSON object with a string ``name`` stays in the text."""
    calls, kept, last = [], [], 0
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
        })
    content = ("".join(kept) + text[last:]).strip()
    return (content or None) if calls else text, calls

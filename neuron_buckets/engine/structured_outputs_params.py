"""What a request's output must match: vLLM's ``StructuredOutputsParams``, the kinds nb runs.

One of: a JSON schema (``json``, its text), any JSON object (``json_object``), or an xgrammar
structural tag (``structural_tag``, its JSON text: literal text around schema-constrained JSON,
which is how tool calls are forced). Held as text so ``SamplingParams`` stays hashable and the
grammar compiler's cache can key on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "json_object", "structural_tag") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, structural_tag; "
                             f"got {given or 'none'}")

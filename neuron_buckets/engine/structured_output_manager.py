"""Grammar-constrained decoding on the host: xgrammar's token bitmask over a step's logits.

A request with ``structured_outputs`` gets a ``GrammarMatcher`` of its compiled grammar; before
each sampling, every row it owns has the tokens its grammar forbids set to -inf (after the head,
before the penalty, temperature and filters), and after it the emitted tokens advance the
matcher. Nothing is recompiled: masks are host work on the logits the head already returns. A
decode row with drafts is masked at every position as if the drafts before it were accepted, so
the verification keeps only drafts the grammar allows (a forbidden draft has probability 0),
then the matcher is rolled back to where the row started. Once the grammar is complete only the
end-of-sequence tokens are allowed, so the request ends there. A grammar wins over ``min_tokens``
and ``ignore_eos``: the ``min_tokens`` mask keeps a row's stop ids when the grammar allows nothing
else (``sampler.mask_early_stops``), and the stop rule ends a request at its grammar's end
(``Request.append``); without that the row would sample outside the grammar after its answer.

Grammars are compiled once per distinct schema (xgrammar's compiler cache, thread-safe), on the
server's tokenizer thread when it checks a request, so the engine thread only makes matchers.
JSON is written without free whitespace (vLLM's ``disable_any_whitespace``): a model that may
emit any number of spaces between tokens may never finish. Schema keywords xgrammar would
ignore are refused by name rather than silently not enforced.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

from torch import Tensor

from neuron_buckets.engine.request_check import RequestError
from neuron_buckets.engine.step_stats import StepStats
from neuron_buckets.engine.structured_outputs_params import StructuredOutputsParams
from neuron_buckets.utils.errors import UserError

# JSON Schema keywords the grammar cannot enforce (xgrammar accepts and ignores them).
UNENFORCED = (
    "uniqueItems", "if", "then", "else", "not", "dependentSchemas", "dependentRequired",
    "unevaluatedProperties", "unevaluatedItems",
)
# Keywords whose value maps names to schemas, and those whose value is a schema or a list of them.
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMAS = ("items", "additionalProperties", "contains", "propertyNames", "allOf", "anyOf", "oneOf",
              "prefixItems", "additionalItems")


def unenforced_keyword(schema: Any, where: str = "$") -> str | None:
    """The first keyword of ``schema`` that the grammar cannot enforce, with its path, or None."""
    if isinstance(schema, list):
        return next((k for i, s in enumerate(schema) if (k := unenforced_keyword(s, f"{where}[{i}]"))), None)
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in UNENFORCED:
            return f"{key!r} (at {where})"
        if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            return f"an external $ref {value!r} (at {where})"
        if key in NAMED_SCHEMAS and isinstance(value, dict):
            found = (unenforced_keyword(s, f"{where}.{key}.{name}") for name, s in value.items())
        elif key in SUBSCHEMAS:
            found = iter([unenforced_keyword(value, f"{where}.{key}")])
        else:
            continue
        if (bad := next((k for k in found if k), None)) is not None:
            return bad
    return None


def printable_strings(schema: Any) -> Any:
    """``schema`` with a pattern on each length-bounded string that has none: xgrammar's grammar
    for those allows raw control characters, which JSON forbids inside a string (a parser
    refuses the output). The pattern keeps xgrammar's own characters (no quote, no backslash)
    less the control ones."""
    if isinstance(schema, list):
        return [printable_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (
        {name: printable_strings(s) for name, s in v.items()} if k in NAMED_SCHEMAS and isinstance(v, dict)
        else printable_strings(v) if k in SUBSCHEMAS else v
    ) for k, v in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    shaped = {"pattern", "format", "enum", "const"} & schema.keys()
    if schema.get("type") == "string" and bounded and not shaped:
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return out


def loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"{what} is not JSON: {e}") from None


def enforceable(schema: Any) -> Any:
    """``schema`` as the grammar is made from it, or a RequestError naming what it cannot enforce."""
    if (bad := unenforced_keyword(schema)) is not None:
        raise RequestError(f"the JSON schema uses {bad}, which nb cannot enforce")
    return printable_strings(schema)


def tag_schemas_enforceable(tag: Any) -> Any:
    """A structural tag with each JSON schema in it ``enforceable``."""
    if isinstance(tag, list):
        return [tag_schemas_enforceable(t) for t in tag]
    if not isinstance(tag, dict):
        return tag
    out = {k: tag_schemas_enforceable(v) for k, v in tag.items()}
    if tag.get("type") == "json_schema" and "json_schema" in tag:
        out["json_schema"] = enforceable(tag["json_schema"])
    return out


def compiler_message(error: Exception) -> str:
    """xgrammar's message without its timestamp and source path."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)


class StructuredOutputManager:
    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int], stats: StepStats
    ) -> None:
        """``vocab_size``: the model's (its logits' width); ``stop_token_ids``: the engine's
        end-of-sequence ids, the only tokens a complete grammar allows. Cheap: xgrammar reads the
        vocabulary on the first request that needs it, on whichever thread that is."""
        self.hf, self.vocab_size, self.stats = hf_tokenizer, vocab_size, stats
        self.stop_token_ids = sorted(stop_token_ids)
        self.mask_width = max(vocab_size, len(hf_tokenizer))  # the tokens a mask covers
        self._lock = threading.Lock()
        self._compiler: Any = None

    @property
    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                except ImportError:
                    raise UserError("structured outputs need xgrammar: pip install "
                                    "'neuron-buckets[text]'") from None
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.hf, vocab_size=self.mask_width, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (cached); a RequestError naming what cannot be enforced."""
        try:
            if spec.json is not None:
                schema = enforceable(loads(spec.json, "the JSON schema"))
                return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if spec.json_object:
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            tag = tag_schemas_enforceable(loads(spec.structural_tag or "", "the structural tag"))
            return self.compiler.compile_structural_tag(json.dumps(tag))
        except (RuntimeError, ValueError, TypeError) as e:
            if isinstance(e, RequestError):
                raise
            raise RequestError(f"the grammar cannot be compiled: {compiler_message(e)}") from None

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec))

    def mask(self, logits: Tensor, rows: Sequence[tuple[Any, Sequence[int]]]) -> None:
        """Mask float32 ``logits`` in place. ``rows`` covers its rows in order: (a matcher or None
        for an unconstrained request, its drafts), each taking ``1 + len(drafts)`` rows."""
        import xgrammar

        start = time.perf_counter()
        bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], self.mask_width)  # all allowed
        row, masked = 0, []
        for matcher, drafts in rows:
            accepted = 0
            for j in range(len(drafts) + 1 if matcher is not None else 0):
                if matcher.is_terminated():  # past its end-of-sequence: nothing of it is kept
                    break
                matcher.fill_next_token_bitmask(bitmask, row + j)
                masked.append(row + j)
                if j == len(drafts) or not matcher.accept_token(drafts[j]):
                    break  # a forbidden draft is rejected: no later row of this one is reached
                accepted += 1
            if accepted:
                matcher.rollback(accepted)
            row += 1 + len(drafts)
        if masked:
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=masked)
        self.stats.add_masks(len(masked), time.perf_counter() - start)

    @staticmethod
    def accept(matcher: Any, tokens: Sequence[int]) -> None:
        """Advance ``matcher`` over the tokens a row emitted (sampled under its mask)."""
        for token in tokens:
            if matcher.is_terminated():
                return
            matcher.accept_token(token)

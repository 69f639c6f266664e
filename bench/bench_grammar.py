"""What a grammar costs per output token: constrained requests against unconstrained ones.

Runs a batch of requests through an ``LLMEngine`` over an artifact with a tokenizer, once with a
JSON schema (``structured_outputs``, the path of ``response_format``) and once unconstrained with
each request held to the length its constrained run had (``ignore_eos``), so both batches step
the same rows, and prints the wall seconds per output token of each, their ratio, and the host
cost of the masks themselves (filling xgrammar's bitmask and applying it to the logits) per
masked row, from the engine's step stats. A model of random weights writes noise, so the
grammar decides every token: the worst case for the mask. Without ``ARTIFACT_DIR`` it compiles
``bench_serve.py``'s model (with its word tokenizer, ``--layers`` deep) at its default grid. The
figures go into ``bench/RESULTS.md`` (``--results`` names another file); nothing is asserted.
Run: python -m bench.bench_grammar [ARTIFACT_DIR] [--requests 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from neuron_buckets import LLMEngine, SamplingParams, generate
from neuron_buckets.engine.structured_outputs_params import StructuredOutputsParams

from .bench_serve import GRID, bench_model, serve_artifact
from .real_models import add_size_args
from .results_table import PROVENANCE, Ratio, ResultsTable, add_results_argument

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                  "required": ["id", "ok"]},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
}
TABLE = ResultsTable(
    heading="What a grammar costs per output token (bench_grammar.py)",
    about="""
`bench/bench_grammar.py`: a batch of `requests` through an `LLMEngine` (temperature 1, seeded), once
under a JSON schema (`structured_outputs`, the path of `response_format`) and once unconstrained,
each request held to the length of its constrained run, so both step the same rows: wall ms per
output token of each, and the host cost of the masks (filling xgrammar's bitmask and applying it)
per masked row. Random weights write noise, so the grammar decides every token: the mask's worst case.
""",
    columns=("artifact", "requests", "unconstrained ms/token", "json_schema ms/token", "json / unconstrained",
             "mask ms per masked row", "masked rows", *PROVENANCE),
    key=2,
    derived={"json / unconstrained": Ratio("json_schema ms/token", "unconstrained ms/token")},
)


def timed(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, list[int]]:
    """Wall seconds per output token, and each request's output length."""
    start = time.perf_counter()
    lengths = [len(o.token_ids) for o in generate(engine, prompts, params)]
    return (time.perf_counter() - start) / sum(lengths), lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", type=Path, help="default: compile bench_serve.py's model")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    add_size_args(parser, "nb-bench-serve", "the model only")
    add_results_argument(parser)
    parser.set_defaults(layers=4, **GRID)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.results = 2, args.work / "RESULTS.md"
    args.work.mkdir(parents=True, exist_ok=True)
    artifact = args.artifact or serve_artifact(args.work, bench_model(args.models, args.layers), args)
    engine = LLMEngine.open(artifact)
    if engine.tokenizer is None:
        raise SystemExit("error: the artifact has no tokenizer; a grammar needs one")
    prompts = [engine.tokenizer.encode(f"pet number {i}:") for i in range(args.requests)]
    grammar = StructuredOutputsParams(json=json.dumps(SCHEMA))
    constrained = [
        SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, structured_outputs=grammar)
        for i in range(args.requests)
    ]
    timed(engine, prompts[:1], constrained[:1])  # warm: graphs loaded, grammar compiled
    masks, mask_seconds = engine.step_stats.grammar_masks, engine.step_stats.grammar_seconds
    shaped, lengths = timed(engine, prompts, constrained)
    rows = engine.step_stats.grammar_masks - masks
    mask_ms = (engine.step_stats.grammar_seconds - mask_seconds) / max(rows, 1) * 1e3
    plain = [
        SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lengths)
    ]
    base, _ = timed(engine, prompts, plain)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.requests} requests")
    print(f"unconstrained  {base * 1e3:8.3f} ms per output token")
    print(f"json_schema    {shaped * 1e3:8.3f} ms per output token  ({shaped / base - 1:+.1%})")
    print(f"mask           {mask_ms:8.3f} ms per masked row ({rows} rows)")
    TABLE.write(args.results, [[artifact.name, str(args.requests), f"{base * 1e3:.3f}", f"{shaped * 1e3:.3f}",
                                f"{mask_ms:.3f}", str(rows)]])


if __name__ == "__main__":
    main()

"""What a grammar costs per output token: constrained requests against unconstrained ones.

Runs a batch of requests through an ``LLMEngine`` over an artifact with a tokenizer, once with a
JSON schema (``structured_outputs``, the path of ``response_format``) and once unconstrained with
each request held to the length its constrained run had (``ignore_eos``), so both batches step
the same rows. The two batches run in ``--rounds`` alternating rounds (``rounds.py``: the order
swaps each round) after a warm-up, and it prints the median wall seconds per output token of each
(min-max beside them), their ratio, and the host cost of the masks themselves (filling xgrammar's
bitmask and applying it to the logits) per masked row and per output token, from the engine's step
stats: the mask's share of an unconstrained token is what the ratio should show. A model of
random weights writes noise, so the grammar decides every token: the worst case for the mask.
Without ``ARTIFACT_DIR`` it compiles ``bench_serve.py``'s model (with its word tokenizer,
``--layers`` deep) at its default grid. The figures go into ``bench/RESULTS.md`` (``--results``
names another file); nothing is asserted.
Run: python -m bench.bench_grammar [ARTIFACT_DIR] [--requests 8] [--max-tokens 128] [--rounds 3]
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
from .rounds import add_rounds_argument, run_rounds, spreads

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
each request held to the length of its constrained run, so both step the same rows, in `rounds`
alternating rounds (`bench/rounds.py`): median wall ms per output token of each (min-max beside
them), and the host cost of the masks (filling xgrammar's bitmask and applying it) per masked row
and per output token of the constrained runs; `mask / unconstrained token` is the share the masks
alone add to a token, to set beside `json / unconstrained`. Random weights write noise, so the
grammar decides every token: the mask's worst case.
""",
    columns=("artifact", "requests", "rounds", "unconstrained ms/token", "json_schema ms/token",
             "json / unconstrained", "ms/token min-max unconstrained ; json", "mask ms per masked row",
             "masked rows", "mask ms per output token", "mask / unconstrained token", *PROVENANCE),
    key=2,
    derived={"json / unconstrained": Ratio("json_schema ms/token", "unconstrained ms/token"),
             "mask / unconstrained token": Ratio("mask ms per output token", "unconstrained ms/token",
                                                 digits=3, suffix="")},
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
    add_rounds_argument(parser)
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
    _, lengths = timed(engine, prompts, constrained)  # warm: graphs loaded, grammar compiled; lengths
    plain = [
        SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lengths)
    ]
    timed(engine, prompts, plain)
    masks, mask_seconds = engine.step_stats.grammar_masks, engine.step_stats.grammar_seconds
    batches = {"unconstrained": plain, "json_schema": constrained}
    samples = run_rounds(list(batches), args.rounds,
                         lambda name, _: {"": {"ms": 1e3 * timed(engine, prompts, batches[name])[0]}})
    found = {name: spreads(samples)[name][""]["ms"] for name in batches}
    base, shaped = found["unconstrained"], found["json_schema"]
    rows = engine.step_stats.grammar_masks - masks
    mask_ms = (engine.step_stats.grammar_seconds - mask_seconds) / max(rows, 1) * 1e3
    per_token = mask_ms * rows / (args.rounds * sum(lengths))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.requests} requests, "
          f"{args.rounds} rounds")
    print(f"unconstrained  {base.median:8.3f} ms per output token ({base.cell('.3f')})")
    print(f"json_schema    {shaped.median:8.3f} ms per output token ({shaped.cell('.3f')}), "
          f"{shaped.median / base.median - 1:+.1%}")
    print(f"mask           {mask_ms:8.3f} ms per masked row ({rows} rows), {per_token:.3f} ms per output "
          f"token, {per_token / base.median:+.1%} of an unconstrained token")
    TABLE.write(args.results, [[artifact.name, str(args.requests), str(args.rounds),
                                f"{base.median:.3f}", f"{shaped.median:.3f}",
                                f"{base.cell('.3f')} ; {shaped.cell('.3f')}",
                                f"{mask_ms:.3f}", str(rows), f"{per_token:.3f}"]])


if __name__ == "__main__":
    main()

"""Generation tok/s of one artifact grid at tensor_parallel_size 1 and 2 on this machine.

Model: a shallow twin of a real shape (``--shape``, ``--layers``; random weights, float32), whose
heads, KV heads and MLP split over two ranks. Both artifacts have the same small grid (one packed
prefill bucket, one decode bucket); at TP=2 two processes each hold half the weights and run the
same graphs on half the heads, with an all-reduce after o and down and the logits gathered. Each
run generates ``--new`` greedy tokens for ``--requests`` prompts of ``--prompt`` tokens, after one
warm-up run that loads every graph; it prints decode-inclusive tokens per second of each and the
ratio. On a machine with fewer cores than ranks times useful threads, TP=2 is expected to lose: the
number says by how much here, it is not a target. The row goes into ``bench/RESULTS.md``
(``--results`` names another file).

    python -m bench.bench_tensor_parallel [--shape llama-3.2-1b] [--layers 2]
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
import time
from pathlib import Path

from .real_models import SHAPES, build_checkpoint
from .results_table import PROVENANCE, Ratio, ResultsTable, add_results_argument

GRID = """
[model]
path = "{model}"

[cache]
block_size = 16
num_blocks = {blocks}
max_model_len = 256

[buckets]
max_num_seqs = {requests}
max_num_batched_tokens = {tokens}
num_seqs_buckets = [{requests}]
num_batched_tokens_buckets = [{tokens}]
decode_context_length_buckets = [256]

[compile]
backend = "inductor"
jobs = 1
fresh_layers = false

[parallel]
tensor_parallel_size = {tp}
"""
TABLE = ResultsTable(
    heading="Tensor parallelism on this machine (bench_tensor_parallel.py)",
    about="""
`bench/bench_tensor_parallel.py`: decode-inclusive generated tokens per second of one small grid
(one packed prefill bucket, one decode bucket) at tensor_parallel_size 1 and 2 (two processes over
gloo, each with half the heads and MLP), on a shallow twin of `shape` (`layers` deep, random
weights, float32): `requests` prompts of `prompt` tokens, `new` greedy tokens each, after a warm-up
run. On fewer cores than ranks times useful threads TP=2 is expected to lose; the ratio says by
how much here.
""",
    columns=("shape", "layers", "requests x prompt, new", "TP=1 tok/s", "TP=2 tok/s", "TP=2 / TP=1",
             *PROVENANCE),
    key=3,
    derived={"TP=2 / TP=1": Ratio("TP=2 tok/s", "TP=1 tok/s")},
)


def run(directory: Path, prompts: list[list[int]], new: int) -> float:
    """Tokens per second of one greedy generation of ``prompts`` (after a warm-up run)."""
    from neuron_buckets import BucketRuntime, SamplingParams, generate

    runtime = BucketRuntime.open(directory, preload=True)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    generate(runtime, prompts, params)
    start = time.perf_counter()
    outs = generate(runtime, prompts, params)
    seconds = time.perf_counter() - start
    runtime.close()
    return sum(len(o.token_ids) for o in outs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-tp")
    add_results_argument(parser)
    args = parser.parse_args()

    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    model = build_checkpoint(args.work / f"{args.shape}-{args.layers}", SHAPES[args.shape], args.layers)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(args.prompt)] for i in range(args.requests)]
    rates = {}
    for tp in (1, 2):
        root = args.work / f"tp{tp}"
        root.mkdir(parents=True, exist_ok=True)
        text = GRID.format(model=model.as_posix(), blocks=1 + args.requests * 16, requests=args.requests,
                           tokens=args.requests * args.prompt, tp=tp)
        (root / "nb.toml").write_text(textwrap.dedent(text))
        report = Compiler(load_config(root / "nb.toml"), root / "art", args.work / "cache").run()
        if report.failed:
            raise SystemExit(f"compile failed: {report.failed[0].error}")
        rates[tp] = run(root / "art", prompts, args.new)
        print(f"tensor_parallel_size {tp}: {rates[tp]:.1f} tok/s", flush=True)
    print(f"TP=2 / TP=1: {rates[2] / rates[1]:.2f}x ({args.shape}, {args.layers} layers, float32, "
          f"{args.requests} x {args.prompt} prompt tokens, {args.new} new)")
    TABLE.write(args.results, [[SHAPES[args.shape].name, str(args.layers),
                                f"{args.requests} x {args.prompt}, {args.new}", f"{rates[1]:.1f}",
                                f"{rates[2]:.1f}"]])


if __name__ == "__main__":
    main()

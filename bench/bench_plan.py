"""Bucket planning on the Azure LLM inference traces: DP runtime, and the plan's padding against
the powers-of-two default at the same number of graphs; plus loading a million-row trace.

Run: python -m bench.bench_plan TRACE_DIR, where TRACE_DIR holds ``AzureLLMInferenceTrace_conv.csv``
and ``AzureLLMInferenceTrace_code.csv`` (Azure's public LLM inference traces). Prints its figures
and writes them into ``bench/RESULTS.md`` (``--results`` names another file).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from neuron_buckets.traffic.planner import PlanOptions, optimal_sets, plan, powers_of_two_baseline
from neuron_buckets.traffic.traces import load_trace

from .results_table import PROVENANCE, Ratio, ResultsTable, add_results_argument

PADDING = ResultsTable(
    heading="Bucket planning: padding (bench_plan.py)",
    about="""
`bench/bench_plan.py`: padding (padded tokens over real ones) of the Azure traces' prompts on the
powers-of-two default and on `nb plan`'s buckets at the same number of prefill graphs K (align
64), and of the decode batches replayed from the arrivals. The figures follow from the traces and
the planner alone, so they change only with the code.
""",
    columns=("trace", "requests", "K", "prefill powers of two", "prefill plan", "plan / powers of two",
             "decode powers of two", "decode plan", *PROVENANCE),
    key=1,
    derived={"plan / powers of two": Ratio("prefill plan", "prefill powers of two", digits=3, suffix="")},
)
TIMES = ResultsTable(
    heading="Bucket planning: time (bench_plan.py)",
    about="`bench/bench_plan.py`: the planner's own cost, best of 5 runs (1 for the slow ones).",
    columns=("work", "ms", *PROVENANCE),
    key=1,
)


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def compare(traces: Path, name: str) -> list[str]:
    trace = load_trace(traces / f"AzureLLMInferenceTrace_{name}.csv")
    k = len(powers_of_two_baseline(trace.prompt_lens.max()))
    doc = plan(trace, PlanOptions(graphs=k, align=64)).to_json()
    p, d = doc["prefill"], doc["decode"]
    base, dbase = p["baseline"], d["baseline"]
    print(f"\n{name}: {len(trace):,} requests, longest prompt {trace.prompt_lens.max():,}, K = {k}")
    print(f"  {'':22}{'padding':>9}  buckets")
    print(f"  {'prefill powers of two':22}{base['padding_ratio']:>9.1%}  {base['buckets']}")
    print(f"  {'prefill plan':22}{p['padding_ratio']:>9.1%}  {p['buckets']}")
    print(f"  plan / powers of two = {p['padding_ratio'] / base['padding_ratio']:.3f} (must be <= 0.6)")
    print(f"  {'decode powers of two':22}{dbase['padding_ratio']:>9.1%}  {dbase['buckets']}")
    print(f"  {'decode plan':22}{d['padding_ratio']:>9.1%}  {d['buckets']}  (peak {d['peak_batch']})")
    print("  Pareto: " + ", ".join(f"K={r['graphs']} {r['padding_ratio']:.1%}" for r in doc["pareto"]))
    powers, planned = base["padding_ratio"], p["padding_ratio"]
    return [name, f"{len(trace)}", str(k), f"{powers:.1%}", f"{planned:.1%}",
            f"{dbase['padding_ratio']:.1%}", f"{d['padding_ratio']:.1%}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", type=Path, help="folder with AzureLLMInferenceTrace_{conv,code}.csv")
    add_results_argument(parser)
    args = parser.parse_args()
    traces = args.trace_dir
    conv = load_trace(traces / "AzureLLMInferenceTrace_conv.csv").prompt_lens
    dp = best_of(lambda: optimal_sets(conv, 8, 64))
    print(f"DP, conversation trace ({len(conv):,} prompts), K=8, align 64: {dp * 1e3:.2f} ms")
    assert dp < 1.0, f"the DP must run under a second, took {dp:.2f} s"
    dp1 = best_of(lambda: optimal_sets(conv, 8, 1), repeats=1)
    print(f"DP, same, align 1 ({len(np.unique(conv)):,} distinct lengths): {dp1 * 1e3:.0f} ms")
    full = best_of(lambda: plan(load_trace(traces / "AzureLLMInferenceTrace_conv.csv"), PlanOptions(8)))
    print(f"whole nb plan (load, DP, decode replay, stats), conversation trace: {full * 1e3:.0f} ms")
    padding = [compare(traces, name) for name in ("code", "conv")]
    rng = np.random.default_rng(0)
    n = 1_000_000
    stamps = np.datetime64("2023-11-16T18:15:46") + np.sort(rng.integers(0, 3600 * 10**9, n)).astype(
        "timedelta64[ns]"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.csv"
        lines = np.char.add(np.char.add(stamps.astype(str), ","), rng.integers(1, 16000, n).astype(str))
        lines = np.char.add(np.char.add(lines, ","), rng.integers(0, 2000, n).astype(str))
        path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(lines) + "\n")
        load = best_of(lambda: load_trace(path), repeats=1)
    print(f"\nload_trace, {n:,}-row Azure-format CSV with date-time stamps: {load:.2f} s")
    times = [
        [f"DP, conversation trace ({len(conv):,} prompts), K=8, align 64", f"{dp * 1e3:.2f}"],
        [f"DP, same, align 1 ({len(np.unique(conv)):,} distinct lengths)", f"{dp1 * 1e3:.0f}"],
        ["whole nb plan (load, DP, decode replay, stats), conversation trace", f"{full * 1e3:.0f}"],
        [f"load_trace, {n:,}-row Azure-format CSV with date-time stamps", f"{load * 1e3:.0f}"],
    ]
    PADDING.write(args.results, padding)
    TIMES.write(args.results, times)


if __name__ == "__main__":
    main()

"""N-gram speculative decoding at concurrency 1: tok/s with and without drafts, and acceptance.

Model: the SmolLM2-135M shape with random weights (``--layers`` deep; 30 is the real depth),
built once into ``--models``. Two artifacts of the same grid: one without speculation rows and
one whose decode rows carry ``1 + K`` tokens. Per workload, one request at a time, ``--new-tokens``
each: the plain artifact (``plain``), the speculation artifact without drafts (``wide rows``: what
the wider rows cost alone), with prompt-lookup drafts as the engine runs them by default, turning
speculation off where it does not pay (``ngram``; ``off`` counts the steps it sat out), and
drafting every step (``always``, ``auto_off = false``). ``ratio`` is ngram over plain.
Workloads: ``repeat`` (greedy; a prompt that repeats one passage: prompt lookup's home ground
when the output quotes it), ``random`` (greedy; random prompts) and ``sampled`` (random prompts at
temperature 1: a flat distribution, whose tokens drafts rarely guess: where lookup does not pay).
Greedy tokens must be identical across the runs, and a seeded sampled request's tokens between
the runs without drafts; the script fails otherwise. Random weights decide how much the output
repeats, so acceptance is what it is on this model: the figures say what drafts cost and save
here, not what a trained model accepts. The rows go into ``bench/RESULTS.md`` (``--results`` names
another file). Run it on an idle machine; timings vary by machine and load.

    python -m bench.bench_speculative [--layers 30] [--k 3] [--new-tokens 64] [--requests 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from neuron_buckets import BucketRuntime, LLMEngine, SamplingParams, generate
from neuron_buckets.config.speculative import SpeculativeConfig

from .real_models import build_smollm
from .results_table import PROVENANCE, Ratio, ResultsTable, add_results_argument
from .workloads import TOKEN_HIGH, TOKEN_LOW, Workload

CONFIG = """
[model]
path = "{model}"

[cache]
block_size = 16
num_blocks = 64
max_model_len = 512

[buckets]
max_num_seqs = 1
max_num_batched_tokens = 256
num_seqs_buckets = [1]
num_batched_tokens_buckets = [256]
speculation_length = {k}

[compile]
backend = "{backend}"
jobs = 1
"""
TABLE = ResultsTable(
    heading="N-gram speculative decoding at concurrency 1 (bench_speculative.py)",
    about="""
`bench/bench_speculative.py`: generated tokens per second of one request at a time on the
random-weight SmolLM2-135M shape (`layers` deep, float32), `requests` prompts per workload: the
artifact without speculation (`plain`), the one whose decode rows carry 1 + K tokens without drafts
(`wide rows`), with prompt-lookup drafts as the engine runs them (`ngram`, turning drafts off where
they do not pay: `off` is the steps it sat out) and drafting every step (`always`). `repeat`:
greedy, a prompt repeating one passage; `random`: greedy, random prompts; `sampled`: random prompts
at temperature 1. Acceptance is what random weights give, not what a trained model accepts.
""",
    columns=("layers", "K", "workload", "backend", "requests x new", "plain tok/s", "wide rows tok/s",
             "ngram tok/s", "ngram / plain", "ngram accept", "mean accepted length", "off / steps",
             "always tok/s", "always / plain", "always accept", *PROVENANCE),
    key=4,
    derived={"ngram / plain": Ratio("ngram tok/s", "plain tok/s"),
             "always / plain": Ratio("always tok/s", "plain tok/s")},
)


@dataclass(frozen=True)
class Case:
    workload: Workload
    temperature: float  # 0: greedy

    def params(self, i: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.workload.max_new_tokens, ignore_eos=True,
                              temperature=self.temperature, seed=i)  # fmt: skip


def cases(n: int, new_tokens: int, seed: int = 0) -> list[Case]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    passages = [torch.randint(TOKEN_LOW, TOKEN_HIGH, (40,), generator=gen).tolist() for _ in range(n)]
    randoms = [torch.randint(TOKEN_LOW, TOKEN_HIGH, (160,), generator=gen).tolist() for _ in range(n)]
    return [
        Case(Workload("repeat", [p * 4 for p in passages], new_tokens), 0.0),
        Case(Workload("random", randoms, new_tokens), 0.0),
        Case(Workload("sampled", randoms, new_tokens), 1.0),
    ]


def compile_artifact(root: Path, model: Path, k: int, backend: str) -> Path:
    config, out = root / f"spec{k}.toml", root / f"spec{k}"
    config.write_text(CONFIG.format(model=model, k=k, backend=backend))
    env = {**os.environ, "NB_CACHE_DIR": str(root / "cache")}
    cmd = ["nb", "compile", str(config), "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return out


def run(
    runtime: BucketRuntime, spec: SpeculativeConfig | None, case: Case
) -> tuple[list[list[int]], float, LLMEngine]:
    """Each prompt alone (concurrency 1) on a fresh engine: the tokens, the generated tokens per
    second, and the engine (its counters)."""
    prompts = case.workload.prompts
    engine, start, tokens = LLMEngine(runtime, speculative=spec), time.perf_counter(), []
    for i, prompt in enumerate(prompts):
        tokens.append(generate(engine, [prompt], case.params(i))[0].token_ids)
    return tokens, len(prompts) * case.workload.max_new_tokens / (time.perf_counter() - start), engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per decode row")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="prompts per workload, run one at a time")
    ap.add_argument("--backend", default="inductor", choices=("inductor", "eager"))
    ap.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-models")
    add_results_argument(ap)
    args = ap.parse_args()
    rows = []

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_smollm(args.models / f"smollm2-{args.layers}layers", num_layers=args.layers)
        plain = BucketRuntime.open(compile_artifact(root, model, 0, args.backend))
        wide = BucketRuntime.open(compile_artifact(root, model, args.k, args.backend))
        spec = SpeculativeConfig(num_speculative_tokens=args.k)
        always = replace(spec, auto_off=False)
        print(f"{args.layers} layers, K = {args.k}, {args.requests} requests x {args.new_tokens} tokens, "
              f"concurrency 1, {args.backend}")  # fmt: skip
        print(f"{'workload':<8} {'plain tok/s':>11} {'wide rows':>9} {'ngram':>7} {'ratio':>6} {'accept':>6} "
              f"{'mean len':>8} {'off':>9} {'always':>7} {'ratio':>6} {'accept':>6}")  # fmt: skip
        workloads = cases(args.requests, args.new_tokens)
        for runtime in (plain, wide):  # a first pass untimed: whatever a first call costs is paid
            run(runtime, None, workloads[0])
        for case in workloads:
            base, base_tps, _ = run(plain, None, case)
            bare, bare_tps, _ = run(wide, None, case)
            gated, gated_tps, engine = run(wide, spec, case)
            every, every_tps, every_engine = run(wide, always, case)
            name = case.workload.name
            if base != bare or (case.temperature == 0 and not base == gated == every):
                sys.exit(f"{name}: tokens differ between the runs")
            s, a, steps = engine.spec_stats, every_engine.spec_stats, engine.step_stats.steps
            print(f"{name:<8} {base_tps:>11.1f} {bare_tps:>9.1f} {gated_tps:>7.1f} "
                  f"{gated_tps / base_tps:>5.2f}x {s.acceptance_rate:>6.0%} {s.mean_accepted_length:>8.2f} "
                  f"{s.num_steps_off:>4}/{steps:<4} "
                  f"{every_tps:>7.1f} {every_tps / base_tps:>5.2f}x {a.acceptance_rate:>6.0%}")  # fmt: skip
            rows.append([str(args.layers), str(args.k), name, args.backend,
                         f"{args.requests} x {args.new_tokens}", f"{base_tps:.1f}", f"{bare_tps:.1f}",
                         f"{gated_tps:.1f}", f"{s.acceptance_rate:.0%}", f"{s.mean_accepted_length:.2f}",
                         f"{s.num_steps_off}/{steps}", f"{every_tps:.1f}", f"{a.acceptance_rate:.0%}"])
    TABLE.write(args.results, rows)


if __name__ == "__main__":
    main()

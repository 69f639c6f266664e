"""N-gram speculative decoding at concurrency 1: tok/s with and without drafts, and acceptance.

Model: the SmolLM2-135M shape with random weights (``--layers`` deep; 30 is the real depth).
Two artifacts of the same grid: one without speculation rows and one whose decode rows carry
``1 + K`` tokens. Three runs per workload, one request at a time, greedy, ``--new-tokens`` each:
the plain artifact, the speculation artifact without drafts (what the wider rows cost alone) and
with prompt-lookup drafts. Workloads: ``repeat`` (a prompt that repeats one passage: prompt
lookup's home ground when the output quotes it) and ``random`` (random prompts: little to look
up). Greedy tokens must be identical across the three runs; the script fails otherwise. Random
weights decide how much the output repeats, so acceptance is what it is on this model: the
figures say what drafts cost and save here, not what a trained model accepts. Run it on an idle
machine; timings vary by machine and load.

    python bench/bench_speculative.py [--layers 30] [--k 3] [--new-tokens 64] [--backend inductor]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from real_models import build_smollm  # noqa: E402
from workloads import TOKEN_HIGH, TOKEN_LOW, Workload  # noqa: E402

from neuron_buckets import LLMEngine, SamplingParams, generate  # noqa: E402
from neuron_buckets.config.speculative import SpeculativeConfig  # noqa: E402

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


def workloads(n: int, new_tokens: int, seed: int = 0) -> list[Workload]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    passages = [torch.randint(TOKEN_LOW, TOKEN_HIGH, (40,), generator=gen).tolist() for _ in range(n)]
    randoms = [torch.randint(TOKEN_LOW, TOKEN_HIGH, (160,), generator=gen).tolist() for _ in range(n)]
    repeat = Workload("repeat", [p * 4 for p in passages], new_tokens)
    return [repeat, Workload("random", randoms, new_tokens)]


def compile_artifact(root: Path, model: Path, k: int, backend: str) -> Path:
    config, out = root / f"spec{k}.toml", root / f"spec{k}"
    config.write_text(CONFIG.format(model=model, k=k, backend=backend))
    env = {**os.environ, "NB_CACHE_DIR": str(root / "cache")}
    cmd = ["nb", "compile", str(config), "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return out


def run(engine: LLMEngine, wl: Workload) -> tuple[list[list[int]], float]:
    """Each prompt alone (concurrency 1); the tokens and the generated tokens per second."""
    params = SamplingParams(max_tokens=wl.max_new_tokens, ignore_eos=True)
    generate(engine, wl.prompts[:1], params)  # warm-up: load the graphs this workload calls
    start, tokens = time.perf_counter(), []
    for prompt in wl.prompts:
        tokens.append(generate(engine, [prompt], params)[0].token_ids)
    return tokens, len(wl.prompts) * wl.max_new_tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per decode row")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="prompts per workload, run one at a time")
    ap.add_argument("--backend", default="inductor", choices=("inductor", "eager"))
    args = ap.parse_args()
    from neuron_buckets import BucketRuntime

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_smollm(root / "model", num_layers=args.layers)
        plain = BucketRuntime.open(compile_artifact(root, model, 0, args.backend))
        wide = BucketRuntime.open(compile_artifact(root, model, args.k, args.backend))
        spec = SpeculativeConfig(num_speculative_tokens=args.k)
        print(f"{args.layers} layers, K = {args.k}, {args.requests} requests x {args.new_tokens} tokens")
        print(f"{'workload':<8} {'plain tok/s':>12} {'wide rows':>10} {'ngram':>8} {'speedup':>8} "
              f"{'accept':>7} {'mean len':>9}")  # fmt: skip
        for wl in workloads(args.requests, args.new_tokens):
            base, base_tps = run(LLMEngine(plain), wl)
            off, off_tps = run(LLMEngine(wide), wl)
            engine = LLMEngine(wide, speculative=spec)
            on, on_tps = run(engine, wl)
            if not base == off == on:
                sys.exit(f"{wl.name}: greedy tokens differ between the runs")
            s, speedup = engine.spec_stats, on_tps / base_tps
            print(f"{wl.name:<8} {base_tps:>12.1f} {off_tps:>10.1f} {on_tps:>8.1f} {speedup:>7.2f}x "
                  f"{s.acceptance_rate:>7.0%} {s.mean_accepted_length:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

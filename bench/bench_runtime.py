"""What the bucket runtime costs and saves, measured side by side in one run.

1. Per decode step: the AOTInductor bucket graphs against eager PyTorch and against
   ``torch.compile(dynamic=True)`` on the same model, weights, cache and batch sizes. The bucket
   graph runs the padded batch (5 requests in the batch-8 graph); eager and dynamic run the exact
   batch, which is what they buy with their dynamic shapes. Eager includes the model's eager-only
   step checks, as any eager serving path would.
2. Host overhead per decode step at batch 1 and 64: bucket selection, padding and unpadding
   alone (the runtime's decode path without the graph call).
3. ``BucketRuntime.open``: lazy (no graph loaded) against ``preload=True`` (every graph).

The embedded default model is compiled into a temporary directory first (three graphs, about a
minute on two cores). Prints figures and ratios only; timings vary by machine, nothing is asserted.
Run: python bench/bench_runtime.py
"""

from __future__ import annotations

import tempfile
import time
import tomllib
from pathlib import Path

import torch
from torch.utils.benchmark import Timer

from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.config import parse_config
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.core.padding import DecodeRow, PrefillChunk, pad_decode
from neuron_buckets.model.checkpoint import default_model
from neuron_buckets.serve.row_packer import group_rows
from neuron_buckets.serve.runtime import BucketRuntime

CONFIG = """
[cache]
block_size = 16
num_blocks = 160
max_model_len = 256
dtype = "float32"

[buckets]
max_num_seqs = 8
max_num_batched_tokens = 128
num_seqs_buckets = [1, 8]
num_batched_tokens_buckets = [128]

[compile]
backend = "inductor"
jobs = 2
"""
CONTEXT = 100  # tokens already cached per request when the decode step runs
BATCHES = (1, 5, 8)


def best_ms(*fns, rounds: int = 3) -> list[float]:
    """Fastest block of each function over interleaved rounds: the figures least disturbed by
    other load on the machine (a burst hits one round of one function, not its minimum)."""
    timers = [Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()) for fn in fns]
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, timer in enumerate(timers):
            best[i] = min(best[i], *timer.blocked_autorange(min_run_time=0.3).times)
    return [b * 1e3 for b in best]


def compile_artifact(root: Path) -> Path:
    config = parse_config(tomllib.loads(CONFIG))
    out = root / "artifact"
    start = time.perf_counter()
    report = Compiler(config, out, root / "cache").run(jobs=config.compile.jobs)
    if report.failed:
        raise SystemExit(f"compile failed: {[o.error for o in report.failed]}")
    print(f"compiled {len(report.outcomes)} graphs in {time.perf_counter() - start:.1f} s\n")
    return out


def requests(runtime: BucketRuntime, batch: int) -> list[DecodeRow]:
    """``batch`` requests with CONTEXT tokens prefilled, each about to decode one token."""
    per_request = runtime.max_model_len // runtime.block_size
    gen = torch.Generator().manual_seed(batch)
    rows = []
    for r in range(batch):
        blocks = list(range(1 + r * per_request, 1 + (r + 1) * per_request))
        prompt = torch.randint(0, 512, (CONTEXT,), generator=gen).tolist()
        runtime.prefill([PrefillChunk(prompt, 0, blocks)])
        rows.append(DecodeRow([prompt[-1]], CONTEXT, blocks))
    return rows


@torch.inference_mode()
def time_decode(runtime: BucketRuntime, model: torch.nn.Module, dynamic, batch: int) -> str:
    """One table line: the four ways to run a decode step of ``batch`` requests, checked to agree."""
    rows = requests(runtime, batch)
    [(_, bucket)] = group_rows(list(enumerate(rows)), runtime.decode_buckets)
    caches = (runtime.k_cache, runtime.v_cache)
    padded = pad_decode(rows, bucket, runtime.block_size).args() + caches
    exact = pad_decode(rows, Bucket("decode", batch, 1, bucket.ctx), runtime.block_size).args() + caches
    graph = runtime.graph(bucket)
    start = time.perf_counter()
    want = dynamic(*exact)
    warm = time.perf_counter() - start
    diff = max((graph(*padded)[:batch] - want).abs().max().item(), (model(*exact) - want).abs().max().item())
    if diff > 1e-3:
        raise SystemExit(f"batch {batch}: the three paths disagree by {diff:.2e}")
    t_graph, t_runtime, t_eager, t_dynamic = best_ms(
        lambda: graph(*padded), lambda: runtime.decode(rows), lambda: model(*exact), lambda: dynamic(*exact)
    )
    return (
        f"{batch:>5} {bucket.name:>17} {t_graph:8.3f} {t_runtime:8.3f} {t_eager:8.3f} {t_dynamic:8.3f}"
        f" {t_eager / t_graph:7.2f}x {t_dynamic / t_graph:6.2f}x  {warm:.1f} s"
    )


def bench_decode(runtime: BucketRuntime) -> None:
    model = default_model()
    dynamic = torch.compile(model, dynamic=True, fullgraph=True)  # fullgraph: no silent eager fallback
    print(f"decode step, {CONTEXT} tokens of context per request (best ms; ratio = other / bucket graph)")
    print(
        f"{'batch':>5} {'bucket':>17} {'graph':>8} {'runtime':>8} {'eager':>8} {'dynamic':>8}"
        f" {'eager/g':>8} {'dyn/g':>7}  dynamic warm-up"
    )
    for batch in BATCHES:
        print(time_decode(runtime, model, dynamic, batch))
    print("(graph: the bucket graph call alone; runtime: runtime.decode, host work included;")
    print(" dynamic warm-up: its first call at that batch, compiling unless it already fits)\n")


def host_step(rows: list[DecodeRow], buckets: list[Bucket], block_size: int, logits: torch.Tensor) -> None:
    """runtime.decode without the graph: select the buckets, pad each call, slice the real rows."""
    for group, bucket in group_rows(list(enumerate(rows)), buckets):
        step = pad_decode([r for _, r in group], bucket, block_size)
        real = logits[: step.num_samples]
        _ = [real[k * bucket.seq : (k + 1) * bucket.seq] for k in range(len(group))]


def bench_host_overhead(block_size: int = 16, ctx: int = 4096) -> None:
    buckets = [Bucket("decode", b, 1, ctx) for b in (1, 2, 4, 8, 16, 32, 64)]
    per_request = ctx // block_size
    print(f"host overhead per decode step (select + pad + unpad, no graph), {ctx}-token context buckets")
    for batch in (1, 64):
        gen = torch.Generator().manual_seed(batch)
        table = (torch.randperm(batch * per_request, generator=gen) + 1).reshape(batch, per_request)
        starts = torch.randint(0, ctx - 1, (batch,), generator=gen).tolist()
        rows = [DecodeRow([1], s, table[r, : s // block_size + 1].tolist()) for r, s in enumerate(starts)]
        logits = torch.zeros(batch, 32_000)
        [ms] = best_ms(lambda rows=rows, logits=logits: host_step(rows, buckets, block_size, logits))
        print(f"  batch {batch:>2}: {ms * 1e3:8.1f} us per step, {ms * 1e3 / batch:6.1f} us per request")
    print()


def bench_open(directory: Path) -> None:
    def best_seconds(preload: bool) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            BucketRuntime.open(directory, preload=preload)
            times.append(time.perf_counter() - start)
        return min(times)

    lazy, eager = best_seconds(False), best_seconds(True)
    graphs = len(BucketRuntime.open(directory).records)
    print(
        f"open {directory.name} ({graphs} graphs): lazy {lazy * 1e3:.1f} ms, preload {eager * 1e3:.1f} ms "
        f"({eager / lazy:.1f}x; about {(eager - lazy) / graphs * 1e3:.1f} ms per graph)"
    )


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    with tempfile.TemporaryDirectory(prefix="nb-bench-") as root:
        artifact = compile_artifact(Path(root))
        bench_decode(BucketRuntime.open(artifact))
        bench_host_overhead()
        bench_open(artifact)


if __name__ == "__main__":
    main()

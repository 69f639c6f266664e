"""How far nb's graph calls are from this machine's limits, per model shape and dtype.

For each ``--shapes`` x ``--dtypes`` (default: every shape of ``real_models.SHAPES``, in float32
and in bfloat16), measured here:
- the GEMM rate of that dtype at the prefill layer's four shapes for a 512-token call (qkv, o,
  gate_up, down as nb fuses them), all cores, in torch's ``F.linear``, in the prepacked-weight
  kernels of MKL (float32 only; what inductor calls after freezing) and oneDNN (what vLLM CPU
  and nb's float32 packed linears call), and in nb's bfloat16 kernel (bfloat16 on a CPU with
  AVX512-BF16, ``kernels/bf16_linear_cpu.py``); the four together, each in its fastest kernel,
  are the ceiling of a layer's dense work;
- memory bandwidth, from streaming a tensor larger than any cache (a copy, counted as bytes read
  plus written, and a sum, bytes read);
- the floors of a decode step of ``B`` rows: memory, the bytes of the weights in that dtype (every
  layer and the LM head) over the read bandwidth, since each step reads them all; compute, its
  dense FLOP (2 x B x the weights that multiply) over the prefill GEMM rate; and, for reference,
  the same GEMMs run alone at ``B`` rows (what the BLAS reaches streaming those weights);
  whatever is compared runs in alternating rounds (``rounds.py``: the start order rotates each
  round), at least 3;
- nb's per-call times through ``BucketRuntime`` on the artifact ``bench_matrix.py`` serves for that
  shape and dtype (its limits, ``serve_limits.py``, and nb's default grid; compiled if absent):
  one packed 512-token prefill (two 256-token prompts), its dense GFLOP/s against the GEMM rate
  (the share is the layers' GEMMs alone over the call, both run back to back in each of
  ``--repeats`` rounds, the median: this machine's speed drifts by more than 10% within
  minutes); decode steps of 4 and 8 rows at context 400 against max(memory floor, compute floor),
  and the batch-8 step over the batch-4 step, in rounds that each read a 1 GiB tensor (the memory
  floor at that moment's rate) and run both steps back to back, the medians of the rounds' ratios;
- the rule for mixed steps: a ``--chunk``-token arrival with ``--riders`` decode rows riding in its
  prefill call, against the chunk's call alone plus the rows' decode call (alternating rounds), and
  the rows alone in their decode graph against the smallest packed call.

Each shape and dtype's row goes into ``bench/RESULTS.md`` (``--results`` names another file).
``--tiny`` runs 2-layer twins to check the script; its figures mean nothing, and its rows go to
``WORK/RESULTS.md``. Run it on an idle machine: every figure is a rate of this machine at this moment.

    python -m bench.bench_roofline [--shapes llama-3.2-1b --dtypes bfloat16] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import time
from collections.abc import Callable, Sequence
from functools import partial
from math import prod
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from neuron_buckets.core.padding import pad_prefill
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.kernels import bf16_linear_cpu
from neuron_buckets.kernels.linear_choice import KERNEL_BF16, linear_choice
from neuron_buckets.runtime.bucket_runtime import BucketRuntime

from .bench_generate import median_ms, prefill_call
from .bench_matrix import matrix_artifact
from .real_models import SHAPES, Shape, add_size_args
from .results_table import PROVENANCE, ResultsTable, add_results_argument
from .rounds import run_rounds
from .serve_limits import DTYPE_BYTES
from .workloads import TOKEN_LOW, Workload

TABLE = ResultsTable(
    heading="Roofline per shape and dtype (bench_roofline.py)",
    about="""
`bench/bench_roofline.py`: how far nb's calls are from this machine's limits. Prefill: a
512-token call's GEMM rate as a share of the dtype's GEMM rate at its shapes (target at least
0.90). Decode at context 400: the step against max(memory floor, compute floor) (target at most
1.5x at batch 8) and batch 8 against batch 4 (target at most 1.2), each a median of rounds that
read 1 GiB and run both steps back to back (the floor at that round's read rate). A ride: a 300-token arrival
with 4 decode rows in one call against its call plus the rows' decode call (target at most 1.00).
""",
    columns=("shape", "dtype", "GEMM GFLOP/s", "prefill share", "decode b4 ms (x floor)",
             "decode b8 ms (x floor)", "b8 / b4", "ride / two calls", *PROVENANCE),
    key=2,
)

TOKENS = 512  # the step budget: a full prefill call
DECODE_BATCHES, DECODE_CONTEXT = (4, 8), 400


def layer_gemms(shape: Shape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one decoder layer, as nb fuses them."""
    d, ffn, hd = shape.get("hidden_size"), shape.get("intermediate_size"), shape.get("head_dim")
    q, kv = shape.get("num_attention_heads") * hd, shape.get("num_key_value_heads") * hd
    return {"qkv": (d, q + 2 * kv), "o": (q, d), "gate_up": (d, 2 * ffn), "down": (ffn, d)}


def gemm_kernels(tokens: int, k: int, n: int, dtype: torch.dtype) -> dict[str, Callable[[], Tensor]]:
    """One ``tokens x k -> n`` GEMM in ``dtype`` up to four ways: torch's ``F.linear``, the
    prepacked-weight kernels of MKL (float32 only) and oneDNN, where this torch has them, and nb's
    bfloat16 kernel where it applies."""
    x, w = torch.randn(tokens, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    out = {"F.linear": lambda: F.linear(x, w)}
    if torch.backends.mkl.is_available() and dtype == torch.float32:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, tokens)
        out["MKL packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, tokens)
    if torch.backends.mkldnn.is_available():
        dnn = torch.ops.mkldnn._reorder_linear_weight(w, tokens)
        out["oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, dnn, None, "none", [], "")
    if bf16_linear_cpu.fits(w) and linear_choice().bf16 == KERNEL_BF16:
        packed = bf16_linear_cpu.pack(w)
        out["nb bf16"] = lambda: bf16_linear_cpu.bf16_linear(x, packed)
    return out


def bandwidth_gbs(nbytes: int, repeats: int) -> tuple[float, float]:
    """(copy GB/s counting bytes read and written, sum GB/s counting bytes read) over ``nbytes``."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), repeats)
    sum_ms = median_ms(lambda: src.sum(), repeats)
    return 2 * nbytes / copy_ms / 1e6, nbytes / sum_ms / 1e6


def weight_elements(model: Path) -> int:
    """Elements of every tensor in the checkpoint: a tied embedding is stored once, read by the head.

    A safetensors file is an 8-byte header length, then a JSON header that gives each tensor's shape.
    """
    total = 0
    for path in model.glob("*.safetensors"):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def gemm_rate(shape: Shape, dtype: torch.dtype, tokens: int, repeats: int, show: bool = True
              ) -> tuple[float, float, Callable[[], object]]:
    """(FLOP of one layer's four GEMMs at ``tokens`` rows, the GFLOP/s they reach when each repeats
    alone in its fastest kernel, a call running each once in that kernel); each GEMM's rate per
    kernel printed if ``show``. At 512 rows: the ceiling of a prefill layer's dense work."""
    layer_flop, best_ms = 0.0, 0.0
    per_kernel: dict[str, float] = {}
    fastest: list[Callable[[], Tensor]] = []
    for name, (k, n) in layer_gemms(shape).items():
        flop = 2.0 * tokens * k * n
        kernels = gemm_kernels(tokens, k, n, dtype)
        times = {kernel: median_ms(fn, repeats) for kernel, fn in kernels.items()}
        layer_flop, best_ms = layer_flop + flop, best_ms + min(times.values())
        fastest.append(kernels[min(times, key=times.__getitem__)])
        for kernel, ms in times.items():
            per_kernel[kernel] = per_kernel.get(kernel, 0.0) + ms
        if show:
            rates = ", ".join(f"{kernel} {flop / ms / 1e6:6.1f}" for kernel, ms in times.items())
            print(f"  {name:8s}{tokens} x {k:5d} -> {n:5d}: {rates}")
    rate = layer_flop / best_ms / 1e6
    if show:
        rates = ", ".join(f"{kernel} {layer_flop / ms / 1e6:6.1f}" for kernel, ms in per_kernel.items())
        print(f"  a layer's four GEMMs ({layer_flop / 1e9:.2f} GFLOP): {rates}; fastest of each {rate:.1f}")
    return layer_flop, rate, lambda: [gemm() for gemm in fastest]


def rounds_ms(fns: Sequence[Callable[[], object]], rounds: int) -> list[tuple[float, ...]]:
    """The ms of each of ``fns`` (in their order) per round, run back to back in each of ``rounds``
    alternating rounds (``rounds.py``: the start order rotates): this machine's speed drifts by more
    than 10% within minutes, so a ratio is taken within a round."""
    for fn in fns:
        fn()

    def once(name: str, _: int) -> dict[str, dict[str, float]]:
        start = time.perf_counter()
        fns[int(name)]()
        return {"": {"ms": (time.perf_counter() - start) * 1e3}}

    names = [str(i) for i in range(len(fns))]
    samples = run_rounds(names, rounds, once)
    return [tuple(samples[n][""]["ms"][r] for n in names) for r in range(rounds)]


def memory_floor_ms(model: Path, dtype: str, repeats: int) -> tuple[float, int]:
    """Print the bandwidths; (the milliseconds the weights in ``dtype`` take to be read once, their
    elements)."""
    copy_gbs, read_gbs = bandwidth_gbs(1 << 30, repeats)
    elements = weight_elements(model)
    weights = elements * DTYPE_BYTES[dtype]
    floor = weights / read_gbs / 1e6
    print(f"\nmemory, a 1 GiB tensor: copy {copy_gbs:.1f} GB/s (read + written), "
          f"sum {read_gbs:.1f} GB/s (read)")
    print(f"  weights in {dtype}, every layer + LM head: {weights / 1e6:.0f} MB; read once in {floor:.1f} ms")
    return floor, elements


def decode_floors(
    shape: Shape, layers: int, dtype: torch.dtype, rate: float, memory_ms: float, elements: int, repeats: int,
) -> dict[int, float]:
    """Print each decode batch's floors; its compute floor (ms) per batch."""
    untied = 0 if shape.fields.get("tie_word_embeddings") else 1  # an untied embedding is only gathered from
    dense = elements - untied * shape.get("vocab_size") * shape.get("hidden_size")
    compute = {}
    for batch in DECODE_BATCHES:
        compute[batch] = 2.0 * batch * dense / rate / 1e6
        alone = decode_gemms_ms(shape, layers, dtype, batch, repeats)
        print(f"  decode batch {batch}: compute floor {compute[batch]:.1f} ms ({2 * batch * dense / 1e9:.1f} "
              f"GFLOP at {rate:.0f} GFLOP/s), memory floor {memory_ms:.1f} ms -> floor "
              f"{max(memory_ms, compute[batch]):.1f} ms; the same GEMMs alone at {batch} rows {alone:.1f} ms")
    return compute


def decode_steps(artifact: Path, weight_bytes: int, compute: dict[int, float], repeats: int
                 ) -> dict[int, tuple[float, float]]:
    """Per batch of ``DECODE_BATCHES``: (its decode step's ms, that step over max(memory floor,
    compute floor)), medians of ``repeats`` rounds. Each round reads a 1 GiB tensor and runs a step
    of each batch back to back, so the memory floor (``weight_bytes`` at that round's read rate)
    and each batch's step are timed at the same moment. Also the median per-round ratio of the
    largest batch's step over the smallest's, under ``ratio``."""
    runtime = BucketRuntime.open(artifact, preload=True)
    per = -(-(DECODE_CONTEXT + 1) // runtime.block_size)
    plans = [tuple(Segment(i, [5], DECODE_CONTEXT, tuple(range(1 + i * per, 1 + (i + 1) * per)), 1)
                   for i in range(batch)) for batch in DECODE_BATCHES]  # fmt: skip
    stream = torch.ones(1 << 28)  # 1 GiB
    rounds = rounds_ms([stream.sum, *(partial(runtime.run_plan, plan) for plan in plans)], repeats)
    out = {}
    for i, batch in enumerate(DECODE_BATCHES, start=1):
        floors = [max(weight_bytes / stream.nbytes * r[0], compute[batch]) for r in rounds]
        out[batch] = (statistics.median(r[i] for r in rounds),
                      statistics.median(r[i] / floor for r, floor in zip(rounds, floors, strict=True)))
    out["ratio"] = statistics.median(r[-1] / r[1] for r in rounds)
    return out


def decode_gemms_ms(shape: Shape, layers: int, dtype: torch.dtype, batch: int, repeats: int) -> float:
    """Every layer's four GEMMs and the LM head at ``batch`` rows, each in its fastest kernel."""
    _, _, gemms = gemm_rate(shape, dtype, batch, repeats, show=False)
    x = torch.randn(batch, shape.get("hidden_size"), dtype=dtype)
    w = torch.randn(shape.get("vocab_size"), shape.get("hidden_size"), dtype=dtype)
    return median_ms(lambda: ([gemms() for _ in range(layers)], F.linear(x, w)), max(3, repeats // 2))


def mixed_step_ms(artifact: Path, chunk_tokens: int, riders: int, repeats: int) -> dict[str, float]:
    """The mixed-step rule's timings (ms) on one runtime: a ``chunk_tokens`` arrival beside
    ``riders`` decode rows in one call and in two (alternating, with their ratio per round), and the
    rows alone in a decode graph and in the smallest packed bucket."""
    runtime = BucketRuntime.open(artifact, preload=True)
    per = -(-(DECODE_CONTEXT + 1) // runtime.block_size)
    rows = [Segment(i, [5], DECODE_CONTEXT, tuple(range(1 + i * per, 1 + (i + 1) * per)), 1)
            for i in range(riders)]  # fmt: skip
    first = 1 + riders * per
    chunk = Segment(riders, list(range(TOKEN_LOW, TOKEN_LOW + chunk_tokens)), 0,
                    tuple(range(first, first + -(-chunk_tokens // runtime.block_size))), 1)  # fmt: skip
    smallest = runtime.buckets.prefill[0]
    packed_rows = pad_prefill(
        rows, smallest,
        runtime.block_size, runtime.buckets.samples(smallest),
    )
    calls = [c.bucket.name for c in runtime.buckets.calls((chunk, *rows))]
    rounds = rounds_ms([
        lambda: runtime.run_plan((chunk, *rows)),
        lambda: (runtime.run_plan((chunk,)), runtime.run_plan(tuple(rows))),
    ], repeats)
    return {
        f"riding, one step ({' + '.join(calls)})": statistics.median(one for one, _ in rounds),
        "chunk's call + decode call": statistics.median(two for _, two in rounds),
        "one step / two calls, per round": statistics.median(one / two for one, two in rounds),
        "chunk's call alone": median_ms(lambda: runtime.run_plan((chunk,)), repeats),
        "decode rows, decode graph": median_ms(lambda: runtime.run_plan(tuple(rows)), repeats),
        f"decode rows, packed {smallest.name}": median_ms(lambda: runtime.run(smallest, packed_rows),
                                                          repeats),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(parser, "nb-bench-matrix", "3 repeats")  # bench_matrix's folder: its artifacts
    parser.set_defaults(layers=None)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPE_BYTES), default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=300,
                        help="tokens of the arriving prompt in the mixed step")
    parser.add_argument("--riders", type=int, default=4, help="decode rows riding beside it")
    add_results_argument(parser)
    args = parser.parse_args()
    if args.tiny:  # its figures mean nothing: they go beside its artifacts
        args.layers, args.repeats, args.results = 2, 3, args.work / "RESULTS.md"
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def roofline(args: argparse.Namespace, key: str, dtype_name: str) -> None:
    """Every figure of one shape in one dtype."""
    shape, dtype = SHAPES[key], getattr(torch, dtype_name)
    layers = args.layers or shape.num_layers
    print(f"\n== {shape.name} shape, {layers} layers, {dtype_name}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians of {args.repeats} runs")
    print(f"{dtype_name} GEMM at the prefill layer's shapes, {TOKENS} tokens, GFLOP/s:")
    layer_flop, rate, layer_gemm = gemm_rate(shape, dtype, TOKENS, args.repeats)
    model, artifact = matrix_artifact(args.models, args.work, key, layers, dtype_name)
    memory_ms, elements = memory_floor_ms(model, dtype_name, max(3, args.repeats // 2))
    compute = decode_floors(shape, layers, dtype, rate, memory_ms, elements, args.repeats)

    halves = Workload("prefill512", [list(range(TOKEN_LOW, TOKEN_LOW + TOKENS // 2))] * 2, 1)
    prefill, bucket = prefill_call(artifact, halves)
    rounds = rounds_ms([prefill, lambda: [layer_gemm() for _ in range(layers)]], args.repeats)
    prefill_ms = statistics.median(nb for nb, _ in rounds)
    shares = sorted(gemm / nb for nb, gemm in rounds)  # the GEMMs alone / the call: its GEMM-rate share
    dense = layers * layer_flop
    print(f"\nnb, BucketRuntime on {artifact.name}:")
    nb_rate = dense / prefill_ms / 1e6
    print(f"  prefill {TOKENS} tokens ({bucket}): {prefill_ms:.0f} ms, {dense / 1e9:.1f} GFLOP dense, "
          f"{nb_rate:.1f} GFLOP/s = {statistics.median(shares):.2f} of the GEMM rate (median of "
          f"{len(shares)} rounds, each the call and {layers} layers of the four GEMMs back to back; "
          f"range {shares[0]:.2f}-{shares[-1]:.2f}; target: at least 0.90); {nb_rate / rate:.2f} of "
          f"the rate each GEMM reaches repeating alone, above")
    decode = decode_steps(artifact, elements * DTYPE_BYTES[dtype_name], compute, args.repeats)
    for batch in DECODE_BATCHES:
        ms, x_floor = decode[batch]
        print(f"  decode batch {batch} at context {DECODE_CONTEXT}: {ms:.1f} ms = {x_floor:.2f}x max(memory "
              f"floor, compute floor) (each round's floor at that round's read rate; target: at most "
              f"1.5x at batch 8)")
    small, large = DECODE_BATCHES
    print(f"  decode batch {large} / batch {small}: {decode['ratio']:.2f} (median of {args.repeats} rounds, "
          "the two back to back; target: at most 1.2)")
    mixed = mixed_step_ms(artifact, args.chunk, args.riders, args.repeats)
    print(f"\nmixed steps ({args.chunk}-token arrival, {args.riders} decode rows at context "
          f"{DECODE_CONTEXT}):")
    ratio = mixed.pop("one step / two calls, per round")
    for label, ms in mixed.items():
        print(f"  {label:40s} {ms:8.1f} ms")
    print(f"  riding / two calls: {ratio:.2f} (median of {args.repeats} rounds, the two back to back; "
          "target: at most 1.00)")
    TABLE.write(args.results, [[shape.name, dtype_name, f"{rate:.0f}", f"{statistics.median(shares):.2f}",
                                *(f"{decode[b][0]:.1f} ({decode[b][1]:.2f}x)" for b in DECODE_BATCHES),
                                f"{decode['ratio']:.2f}", f"{ratio:.2f}"]])


def main() -> None:
    args = parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    for key in args.shapes:
        for dtype in args.dtypes:
            roofline(args, key, dtype)


if __name__ == "__main__":
    main()

"""How far nb's graph calls are from this machine's limits: the "before" (and "after") table.

Measured here, on the SmolLM2-135M shape (float32):
- the fp32 GEMM rate at the prefill layer's four shapes for a 512-token call (qkv 576 -> 576 +
  2 x 192, o 576 -> 576, gate and up 576 -> 2 x 1536, down 1536 -> 576), all cores, in torch's
  ``F.linear`` and in the prepacked-weight kernels of MKL (what inductor calls after freezing)
  and oneDNN (what vLLM CPU calls); the four together, each in its fastest kernel, are the
  ceiling of a layer's dense work;
- memory bandwidth, from streaming a tensor larger than any cache (a copy, counted as bytes read
  plus written, and a sum, bytes read); the floor of a decode step is the bytes of the model's
  weights (every layer and the LM head) over the read bandwidth, since each step reads them all;
- nb's per-call times through ``BucketRuntime`` on an artifact of the offline bench's default grid
  (``bench_generate.py``'s ``art512``): one packed 512-token prefill (two 256-token prompts) and
  one batch-8 decode step at context 400, with the prefill's dense GFLOP/s (2 x tokens x the
  linear layers' weights) against the GEMM rate, and the decode's time against the memory floor.
  The prefill's share of the GEMM rate is the time of the layers' GEMMs alone (each in its
  fastest kernel, once per layer) over the call's, both run back to back in each of ``--repeats``
  rounds, the median: this machine's speed drifts by more than 10% within minutes. Also printed:
  the call's rate over the rate each GEMM reaches repeating alone, measured minutes earlier (the
  four in sequence, as a layer runs them, took 5-15% longer than that here, 2026-12-02);
- the rule for mixed steps, measured: a 504-token chunk beside 8 decode rows as one packed call
  against the same work as a packed call plus a decode call, and 8 decode rows alone in their
  decode graph against the smallest packed call.

``--tiny`` runs a 2-layer twin to check the script; its figures mean nothing. Run it on an idle
machine: every figure is a rate of this machine at this moment.

    python bench/bench_roofline.py [--layers 30] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import compile_artifact, decode_step_ms, median_ms, prefill_call  # noqa: E402
from real_models import SMOLLM2_135M, add_size_args, build_smollm  # noqa: E402
from workloads import TOKEN_LOW, Workload  # noqa: E402

from neuron_buckets.core.padding import pad_prefill  # noqa: E402
from neuron_buckets.core.step_plan import Segment  # noqa: E402
from neuron_buckets.runtime.bucket_runtime import BucketRuntime  # noqa: E402

TOKENS = 512  # the step budget: a full prefill call
DECODE_BATCH, DECODE_CONTEXT = 8, 400  # decode_step_ms runs 8 rows


def layer_gemms() -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one decoder layer, as nb fuses them."""
    d, ffn = int(SMOLLM2_135M["hidden_size"]), int(SMOLLM2_135M["intermediate_size"])
    kv = int(SMOLLM2_135M["num_key_value_heads"]) * int(SMOLLM2_135M["head_dim"])
    return {"qkv": (d, d + 2 * kv), "o": (d, d), "gate_up": (d, 2 * ffn), "down": (ffn, d)}


def gemm_kernels(tokens: int, k: int, n: int) -> dict[str, Callable[[], Tensor]]:
    """One ``tokens x k -> n`` fp32 GEMM three ways: torch's ``F.linear``, and the prepacked-weight
    kernels inductor (MKL, after freezing) and vLLM CPU (oneDNN) call, where this torch has them."""
    x, w = torch.randn(tokens, k), torch.randn(n, k)
    out = {"F.linear": lambda: F.linear(x, w)}
    if torch.backends.mkl.is_available():
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, tokens)
        out["MKL packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, tokens)
    if torch.backends.mkldnn.is_available():
        dnn = torch.ops.mkldnn._reorder_linear_weight(w, tokens)
        out["oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, dnn, None, "none", [], "")
    return out


def bandwidth_gbs(nbytes: int, repeats: int) -> tuple[float, float]:
    """(copy GB/s counting bytes read and written, sum GB/s counting bytes read) over ``nbytes``."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), repeats)
    sum_ms = median_ms(lambda: src.sum(), repeats)
    return 2 * nbytes / copy_ms / 1e6, nbytes / sum_ms / 1e6


def weight_bytes(model: Path) -> int:
    """Bytes of every tensor in the checkpoint: a tied embedding is stored once, read by the head.

    A safetensors file is an 8-byte header length, the JSON header, then the tensors' bytes.
    """
    total = 0
    for path in model.glob("*.safetensors"):
        with path.open("rb") as f:
            (header,) = struct.unpack("<Q", f.read(8))
        total += path.stat().st_size - 8 - header
    return total


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(parser, "nb-bench-generate", "3 repeats")  # bench_generate's folder: its art512
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.repeats = 2, 3
    return args


def gemm_rate(repeats: int) -> tuple[float, float, Callable[[], object]]:
    """Print each GEMM's rate per kernel; (FLOP of one layer's four GEMMs, the GFLOP/s they reach
    when each repeats alone in its fastest kernel, a call running each once in that kernel): the
    ceiling of a prefill layer's dense work."""
    print(f"\nfp32 GEMM at the prefill layer's shapes, {TOKENS} tokens, GFLOP/s:")
    layer_flop, best_ms = 0.0, 0.0
    per_kernel: dict[str, float] = {}
    fastest: list[Callable[[], Tensor]] = []
    for name, (k, n) in layer_gemms().items():
        flop = 2.0 * TOKENS * k * n
        kernels = gemm_kernels(TOKENS, k, n)
        times = {kernel: median_ms(fn, repeats) for kernel, fn in kernels.items()}
        layer_flop, best_ms = layer_flop + flop, best_ms + min(times.values())
        fastest.append(kernels[min(times, key=times.__getitem__)])
        for kernel, ms in times.items():
            per_kernel[kernel] = per_kernel.get(kernel, 0.0) + ms
        rates = ", ".join(f"{kernel} {flop / ms / 1e6:6.1f}" for kernel, ms in times.items())
        print(f"  {name:8s}{TOKENS} x {k:4d} -> {n:4d}: {rates}")
    rates = ", ".join(f"{kernel} {layer_flop / ms / 1e6:6.1f}" for kernel, ms in per_kernel.items())
    rate = layer_flop / best_ms / 1e6
    print(f"  a layer's four GEMMs ({layer_flop / 1e9:.2f} GFLOP): {rates}; fastest of each {rate:.1f}")
    return layer_flop, rate, lambda: [gemm() for gemm in fastest]


def alternating_ms(
    first: Callable[[], object], second: Callable[[], object], rounds: int
) -> list[tuple[float, float]]:
    """(ms of ``first``, ms of ``second``) in each of ``rounds`` back-to-back rounds: this machine's
    speed drifts by more than 10% within minutes, so a ratio is taken within a round."""
    first(), second()
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        first()
        middle = time.perf_counter()
        second()
        out.append(((middle - start) * 1e3, (time.perf_counter() - middle) * 1e3))
    return out


def memory_floor_ms(model: Path, layers: int, repeats: int) -> float:
    """Print the bandwidths; the milliseconds the model's weights take to be read once."""
    copy_gbs, read_gbs = bandwidth_gbs(1 << 30, repeats)
    weights = weight_bytes(model)
    floor = weights / read_gbs / 1e6
    print(f"\nmemory, a 1 GiB tensor: copy {copy_gbs:.1f} GB/s (read + written), "
          f"sum {read_gbs:.1f} GB/s (read)")
    print(f"  weights, {layers} layers + LM head: {weights / 1e6:.0f} MB; a decode step's floor "
          f"{floor:.1f} ms at the read rate")
    return floor


def mixed_step_ms(artifact: Path, repeats: int) -> dict[str, float]:
    """The mixed-step rule's timings (ms) on one runtime: a chunk filling the budget beside
    ``DECODE_BATCH`` decode rows in one call and in two (alternating, with their ratio per round),
    and the rows alone in a decode graph and in the smallest packed bucket."""
    runtime = BucketRuntime.open(artifact, preload=True)
    per = -(-(DECODE_CONTEXT + 1) // runtime.block_size)
    rows = [Segment(i, [5], DECODE_CONTEXT, tuple(range(1 + i * per, 1 + (i + 1) * per)), 1)
            for i in range(DECODE_BATCH)]  # fmt: skip
    first = 1 + DECODE_BATCH * per
    chunk = Segment(DECODE_BATCH, list(range(TOKEN_LOW, TOKEN_LOW + TOKENS - DECODE_BATCH)), 0,
                    tuple(range(first, first + TOKENS // runtime.block_size)), 1)  # fmt: skip
    smallest = runtime.buckets.prefill[0]
    packed_rows = pad_prefill(
        rows, smallest,
        runtime.block_size, runtime.buckets.samples(smallest),
    )
    rounds = alternating_ms(
        lambda: runtime.run_plan((chunk, *rows)),
        lambda: (runtime.run_plan((chunk,)), runtime.run_plan(tuple(rows))),
        repeats,
    )
    return {
        "mixed, one packed call": statistics.median(one for one, _ in rounds),
        "mixed, packed + decode call": statistics.median(two for _, two in rounds),
        "one call / two calls, per round": statistics.median(one / two for one, two in rounds),
        "decode rows, decode graph": median_ms(lambda: runtime.run_plan(tuple(rows)), repeats),
        f"decode rows, packed {smallest.name}": median_ms(
            lambda: runtime.run(smallest, packed_rows), repeats
        ),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"SmolLM2-135M shape, {args.layers} layers, float32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians of {args.repeats} runs")
    layer_flop, rate, layer_gemm = gemm_rate(args.repeats)
    model = build_smollm(args.models / f"smollm2-{args.layers}layers", num_layers=args.layers)
    floor_ms = memory_floor_ms(model, args.layers, max(3, args.repeats // 2))

    args.work.mkdir(parents=True, exist_ok=True)
    name = "art512" if args.layers == 30 else f"art512-{args.layers}layers"  # bench_generate's for 30
    artifact = compile_artifact(args.work, name, model=model.as_posix(), num_blocks=600, max_model_len=512,
                                num_seqs="[1, 8, 16]", prefill="[64, 256, 512]", prefill_max=512)
    halves = Workload("prefill512", [list(range(TOKEN_LOW, TOKEN_LOW + TOKENS // 2))] * 2, 1)
    prefill, bucket = prefill_call(artifact, halves)
    rounds = alternating_ms(prefill, lambda: [layer_gemm() for _ in range(args.layers)], args.repeats)
    prefill_ms = statistics.median(nb for nb, _ in rounds)
    shares = sorted(gemm / nb for nb, gemm in rounds)  # the GEMMs alone / the call: its GEMM-rate share
    decode_ms = decode_step_ms(artifact, DECODE_CONTEXT, args.repeats)
    dense = args.layers * layer_flop
    print(f"\nnb, BucketRuntime on {artifact.name}:")
    nb_rate = dense / prefill_ms / 1e6
    print(f"  prefill {TOKENS} tokens ({bucket}): {prefill_ms:.0f} ms, {dense / 1e9:.1f} GFLOP dense, "
          f"{nb_rate:.1f} GFLOP/s = {statistics.median(shares):.2f} of the GEMM rate (median of "
          f"{len(shares)} rounds, each the call and {args.layers} layers of the four GEMMs back to back; "
          f"range {shares[0]:.2f}-{shares[-1]:.2f}; target: at least 0.90); {nb_rate / rate:.2f} of "
          f"the rate each GEMM reaches repeating alone, above")
    print(f"  decode batch {DECODE_BATCH} at context {DECODE_CONTEXT}: {decode_ms:.1f} ms = "
          f"{decode_ms / floor_ms:.1f}x the memory floor ({floor_ms:.1f} ms)")
    mixed = mixed_step_ms(artifact, args.repeats)
    print(f"\nmixed steps ({TOKENS - DECODE_BATCH}-token chunk, {DECODE_BATCH} decode rows at context "
          f"{DECODE_CONTEXT}):")
    ratio = mixed.pop("one call / two calls, per round")
    for label, ms in mixed.items():
        print(f"  {label:34s} {ms:8.1f} ms")
    print(f"  one call / two calls: {ratio:.2f} (median of {args.repeats} rounds, the two back to back)")


if __name__ == "__main__":
    main()

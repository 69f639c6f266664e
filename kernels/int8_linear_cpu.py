"""INT8 W8A8 projections on the CPU: a C++ kernel, ``nb::int8_linear``, over weights packed at load.

A decode step streams every weight once for a few tokens, so its projections are bound by memory,
and oneDNN's u8s8 GEMM (what the W8A8 graphs called before, and what vLLM CPU calls) streams the
int8 weights no faster per byte than its bfloat16 GEMM streams twice the bytes.
``int8_linear_cpu.cpp`` streams one 64-channel group per thread through vpdpbusd, nearer the read
rate, and keeps pace with oneDNN on a prefill call (CHANGELOG has the figures). It also quantizes
the activations per token itself, so a graph calls one op per projection.

It needs AVX512-VNNI (and AVX512BW), and a projection of a multiple of 64 output channels and of
4 input features; elsewhere W8A8 takes oneDNN's u8s8 GEMM, or float32 products on a CPU without
any VNNI (``model/quant/quantized_linear.py``). Whether a graph calls it is decided as it is traced, on
the compiling machine (``fits`` here, and the CPU's choice in ``linear_choice.py``); the artifact
then carries the library, and the runtime packs the weights for it only where that library is
registered, so a graph and its weights always agree.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .cpp_library import CppLibrary

OP = "nb::int8_linear"
LIBRARY = CppLibrary(Path(__file__).with_suffix(".cpp"), OP, "nb's INT8 linear kernel",
                     ("-mavx512vnni", "-mavx512bw"),
                     needs=("avx512f", "avx512bw", "avx512_vnni"), needs_name="AVX512-VNNI")
GROUP = 64  # output channels the kernel computes together (its packed layout's unit)

torch.library.define(OP, "(Tensor x, Tensor weight, Tensor scale) -> Tensor")


@torch.library.register_fake(OP)
def _int8_linear_fake(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def cpu_has_vnni() -> bool:
    """Whether this CPU runs the kernel (AVX512-VNNI and AVX512BW)."""
    return LIBRARY.runs_here()


def fits(weight: Tensor) -> bool:
    """Whether the kernel computes a W8A8 projection of this (out, in) int8 weight: on the CPU, a
    multiple of 64 outputs and of 4 inputs."""
    out, inp = weight.shape
    return weight.device.type == "cpu" and out % GROUP == 0 and inp % 4 == 0


def pack(weight: Tensor) -> Tensor:
    """The (out, in) int8 weight in the kernel's layout, still (out, in) int8: 64-channel groups,
    then 4 input features, then 4 blocks of 16 channels with their 4 bytes; each byte w + 128 as
    unsigned (``int8_linear_cpu.cpp``)."""
    out, inp = weight.shape
    blocked = weight.reshape(out // GROUP, GROUP // 16, 16, inp // 4, 4).permute(0, 3, 1, 2, 4)
    return (blocked.contiguous().view(torch.uint8) ^ 0x80).view(torch.int8).reshape(out, inp)


def int8_linear(x: Tensor, packed: Tensor, scale: Tensor) -> Tensor:
    """``x`` quantized per token times the packed weight, scaled: (..., out) in ``x``'s dtype."""
    LIBRARY.ensure()
    return torch.ops.nb.int8_linear(x, packed, scale)

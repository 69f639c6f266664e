"""bfloat16 projections on the CPU: a C++ kernel, ``nb::bf16_linear``, over weights packed at load.

A decode step streams every weight once for a few tokens, so its projections are bound by memory,
and oneDNN's bfloat16 GEMM streams a few rows' weights well below the read rate.
``bf16_linear_cpu.cpp`` streams one 32-channel group per thread through vdpbf16ps, up to 8 tokens
per pass, so a decode step reads each weight once, and keeps pace with oneDNN on a prefill call
(CHANGELOG and bench/RESULTS.md have the figures). Both sum in float32 and round once to bfloat16.

It needs AVX512-BF16 (and AVX512BW), bfloat16 activations, and a projection of a multiple of 32
output channels and of 2 input features; elsewhere bfloat16 stays on oneDNN (``model/linear.py``),
and so it does on a CPU with AMX, whose tiles oneDNN drives: there oneDNN is within a tenth of it
at one token and far faster from a few tokens up (bench/RESULTS.md).
Whether a graph calls it is decided as it is traced, on the compiling machine (``fits`` here, and
the CPU's choice in ``linear_choice.py``); the artifact then carries the library, and the runtime
packs the weights for it only for an artifact that carries it, so a graph and its weights agree.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch import Tensor

from .cpp_library import CppLibrary

OP = "nb::bf16_linear"
LIBRARY = CppLibrary(Path(__file__).with_suffix(".cpp"), OP, "nb's bfloat16 linear kernel",
                     ("-mavx512bf16", "-mavx512bw"),
                     needs=("avx512f", "avx512bw", "avx512_bf16"), needs_name="AVX512-BF16")
GROUP = 32  # output channels the kernel computes together (its packed layout's unit)

torch.library.define(OP, "(Tensor x, Tensor weight) -> Tensor")
_packed: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()  # what ``pack`` made


@torch.library.register_fake(OP)
def _bf16_linear_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def cpu_has_bf16() -> bool:
    """Whether this CPU runs the kernel (AVX512-BF16 and AVX512BW)."""
    return LIBRARY.runs_here()


def fits(weight: Tensor) -> bool:
    """Whether the kernel computes a projection of this (out, in) weight: bfloat16 on the CPU, a
    multiple of 32 outputs and of 2 inputs."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return False
    out, inp = weight.shape
    return out % GROUP == 0 and inp % 2 == 0


def pack(weight: Tensor) -> Tensor:
    """The (out, in) bfloat16 weight in the kernel's layout, still (out, in) bfloat16: 32-channel
    groups, then pairs of input features, then 2 blocks of 16 channels with their 2 values
    (``bf16_linear_cpu.cpp``)."""
    out, inp = weight.shape
    blocked = weight.reshape(out // GROUP, GROUP // 16, 16, inp // 2, 2).permute(0, 3, 1, 2, 4)
    packed = blocked.contiguous().reshape(out, inp)
    _packed[id(packed)] = packed
    return packed


def is_packed(weight: Tensor) -> bool:
    """Whether ``weight`` is a tensor ``pack`` returned: an eager call on it (``nb verify``'s model
    over the runtime's weights) must run the kernel, since its shape and dtype are a dense one's."""
    return _packed.get(id(weight)) is weight


def bf16_linear(x: Tensor, packed: Tensor) -> Tensor:
    """``x`` times the packed weight: (..., out) in bfloat16."""
    LIBRARY.ensure()
    return torch.ops.nb.bf16_linear(x, packed)

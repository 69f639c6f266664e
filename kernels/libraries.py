"""The native kernel libraries an artifact may carry, written once: each by the name its manifest
gives it, with its build and how a serving process loads an artifact's copy.

The list and the choice live here so that the places that follow them cannot drift apart: the
artifact writer builds and copies what ``carried`` names, the runtime registers what a manifest
lists through ``LIBRARIES``, the inductor backend refuses a graph that calls an op of a library
that was not carried, and the build plan and the runtime ask ``cpu_attention`` where attention
runs. Which path a projection takes stays ``linear_choice``'s to decide; this only follows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import bf16_linear_cpu, block_kv_cpu, int8_linear_cpu, package_call_cpu
from .cpp_library import CppLibrary
from .linear_choice import KERNEL_BF16, KERNEL_INT8, linear_choice


@dataclass(frozen=True)
class KernelLibrary:
    """One library as an artifact carries it (``kernels/<name>.so``, listed in its manifest)."""

    name: str
    library: CppLibrary
    register: Callable[[Path], None]  # load an artifact's copy, refused on a CPU that cannot run it
    in_graphs: bool = True  # whether graphs call its op (the package call is the runtime's own)


BLOCK_KV = KernelLibrary("block_kv_cpu", block_kv_cpu.LIBRARY, block_kv_cpu.LIBRARY.register)
INT8_LINEAR = KernelLibrary("int8_linear_cpu", int8_linear_cpu.LIBRARY, int8_linear_cpu.register)
BF16_LINEAR = KernelLibrary("bf16_linear_cpu", bf16_linear_cpu.LIBRARY, bf16_linear_cpu.register)
PACKAGE_CALL = KernelLibrary("package_call_cpu", package_call_cpu.LIBRARY, package_call_cpu.LIBRARY.register,
                             in_graphs=False)
LIBRARIES = {lib.name: lib for lib in (PACKAGE_CALL, BLOCK_KV, INT8_LINEAR, BF16_LINEAR)}


def cpu_attention(device: torch.device | str, dtype: torch.dtype | str) -> bool:
    """Whether attention on ``device`` over a cache of ``dtype`` runs in nb's C++ kernel: its
    artifact carries the library, the runtime mixes decode rows into prompt buckets, and the build
    plan leaves out fresh layers (the kernel reads each segment's context alone)."""
    return block_kv_cpu.applies(device, dtype)


def carried(device: str, dtype: str, w8a8: bool) -> dict[str, KernelLibrary]:
    """The libraries the graphs of an artifact compiled for ``device`` call, over a cache of
    ``dtype`` (a config's name) and, where ``w8a8``, int8 projections of int8 activations: on a CPU
    the package call, the attention where ``cpu_attention``, and nb's projection kernels where
    ``linear_choice`` picked them (the graphs were traced for them then); by name."""
    if torch.device(device).type != "cpu":
        return {}
    choice = linear_choice()
    wanted = {
        PACKAGE_CALL: True,
        BLOCK_KV: cpu_attention(device, dtype),
        INT8_LINEAR: w8a8 and choice.int8_w8a8 == KERNEL_INT8,
        BF16_LINEAR: dtype == "bfloat16" and choice.bf16 == KERNEL_BF16,
    }
    return {lib.name: lib for lib, wanted_here in wanted.items() if wanted_here}

"""The native kernel libraries an artifact may carry, written once, and which of them it carries.

The list and the choice live here so that the places that follow them cannot drift apart: the
artifact writer builds and copies what ``carried`` names, the runtime registers what a manifest
lists through ``LIBRARIES`` (each library's own ``register`` refuses a CPU that cannot run it), the
inductor backend refuses a graph that calls the op of a library that was not carried, and the
build plan and the runtime ask ``cpu_attention`` where attention runs. Which path a projection
takes stays ``linear_choice``'s to decide; this only follows it.
"""

from __future__ import annotations

import torch

from . import bf16_linear_cpu, block_kv_cpu, int8_linear_cpu, package_call_cpu
from .cpp_library import CppLibrary
from .linear_choice import KERNEL_BF16, KERNEL_INT8, linear_choice

BLOCK_KV = block_kv_cpu.LIBRARY
INT8_LINEAR = int8_linear_cpu.LIBRARY
BF16_LINEAR = bf16_linear_cpu.LIBRARY
PACKAGE_CALL = package_call_cpu.LIBRARY  # the runtime's own call of a graph, without the GIL
LIBRARIES = {lib.name: lib for lib in (PACKAGE_CALL, BLOCK_KV, INT8_LINEAR, BF16_LINEAR)}  # by manifest name


def cpu_attention(device: torch.device | str, dtype: torch.dtype | str) -> bool:
    """Whether attention on ``device`` over a cache of ``dtype`` runs in nb's C++ kernel: its
    artifact carries the library, the runtime mixes decode rows into prompt buckets, and the build
    plan leaves out fresh layers (the kernel reads each segment's context alone)."""
    return block_kv_cpu.applies(device, dtype)


def carried(device: str, dtype: str, w8a8: bool) -> dict[str, CppLibrary]:
    """The libraries the graphs of an artifact compiled for ``device`` call, over a cache of
    ``dtype`` (a config's name) and, where ``w8a8``, int8 projections of int8 activations: on a CPU
    the package call, the attention where ``cpu_attention``, and nb's projection kernels where
    ``linear_choice`` picked them (the graphs were traced for them then); by manifest name."""
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

"""Which kernel computes a CPU projection: decided here alone, from the CPU's feature flags.

A graph traced on a machine calls the kernel chosen here, the runtime packs the weights in that
kernel's layout, the artifact carries its library, and the inductor backend's versions (in every
graph key) name the choice, so graphs and weights agree and a graph cache shared by CPUs of
different kinds never hands one kind's graphs to another. Per CPU (/proc/cpuinfo's flags):

- bfloat16 projections: nb's kernel (``bf16_linear_cpu``) with AVX512-BF16 (and AVX512BW) and no
  AMX; otherwise oneDNN's path (``model/linear.py``), which drives AMX's tiles where there are any.
- W8A8 (int8 weights, int8 activations per token): nb's kernel (``int8_linear_cpu``) with
  AVX512-VNNI (and AVX512BW); oneDNN's u8s8 GEMM with AVX-VNNI only; without any VNNI the same
  products in float32 over the dense int8 weight, since oneDNN's u8s8 GEMM there does not sum the
  reference's products (``model/quant/quantized_linear.py``).

A projection whose shape a kernel does not take stays on the next path down (the W8A8 kernel's on
oneDNN's, which VNNI makes exact): the choice names the path a fitting projection takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import bf16_linear_cpu, int8_linear_cpu
from .cpp_library import cpu_has

KERNEL_BF16 = "nb avx512_bf16"
KERNEL_INT8 = "nb avx512_vnni"
ONEDNN = "onednn"
FLOAT32 = "float32"


@dataclass(frozen=True)
class LinearChoice:
    """The path each kind of projection takes on this CPU, by the names the backend's versions use."""

    bf16: str  # KERNEL_BF16 or ONEDNN
    int8_w8a8: str  # KERNEL_INT8, ONEDNN or FLOAT32


def linear_choice() -> LinearChoice:
    """This CPU's choice (its flags are read once per process: ``cpu_flags``)."""
    bf16 = KERNEL_BF16 if bf16_linear_cpu.cpu_has_bf16() and not cpu_has("amx_bf16") else ONEDNN
    if int8_linear_cpu.cpu_has_vnni():
        w8a8 = KERNEL_INT8
    elif cpu_has("avx512_vnni") or cpu_has("avx_vnni"):
        w8a8 = ONEDNN
    else:
        w8a8 = FLOAT32
    return LinearChoice(bf16, w8a8)

"""Which kernel computes a CPU projection, on every kind of CPU, whatever CPU runs the test.

The CPU's feature flags are faked (``cpu_flags``, /proc/cpuinfo's line) for each kind below, and
for each the test asks ``linear_choice`` (the one function that decides), then checks that
everything that follows the choice follows it: the op a bfloat16 and a W8A8 projection are traced
into, the layout the runtime packs a W8A8 weight in, the kernel libraries an artifact carries, and
the backend versions that enter every graph key. Nothing here runs a kernel (tracing uses the ops'
shape functions), so it passes on any CPU; the kernels' arithmetic keeps its own tests, gated on
the instruction sets they need (test_bf16_linear_kernel.py, test_int8_linear_kernel.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from neuron_buckets.backends.inductor import InductorBackend
from neuron_buckets.compile.artifact_writer import ArtifactWriter
from neuron_buckets.compile.build_plan import BuildPlan
from neuron_buckets.config import load_config
from neuron_buckets.kernels import cpp_library, int8_linear_cpu
from neuron_buckets.kernels.cpp_library import CppLibrary
from neuron_buckets.kernels.linear_choice import (
    FLOAT32,
    KERNEL_BF16,
    KERNEL_INT8,
    ONEDNN,
    LinearChoice,
    linear_choice,
)
from neuron_buckets.model import linear
from neuron_buckets.model.checkpoint import read_config
from neuron_buckets.model.quant.quant_scheme import QuantScheme
from neuron_buckets.model.quant.quantized_linear import pack_int8
from neuron_buckets.model.quant.quantized_weight import QuantizedWeight

BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx f16c fma avx2 bmi1 bmi2"
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"
# Each kind of CPU: its flags, and the path its bfloat16 and W8A8 projections take (README, "Quantized
# checkpoints" and the architectures' paragraph; kernels/linear_choice.py).
CPUS = {
    "amd-zen4-avx512": (f"{BASE} {AVX512} avx512_vnni avx512_bf16 avx512vbmi",
                        LinearChoice(KERNEL_BF16, KERNEL_INT8)),
    "avx2-only": (BASE, LinearChoice(ONEDNN, FLOAT32)),
    "avx-vnni-only": (f"{BASE} avx_vnni", LinearChoice(ONEDNN, ONEDNN)),
    "intel-avx512-vnni-no-bf16": (f"{BASE} {AVX512} avx512_vnni", LinearChoice(ONEDNN, KERNEL_INT8)),
    "intel-bf16-fp16-no-amx": (f"{BASE} {AVX512} avx512_vnni avx512_bf16 avx512_fp16 avx_vnni",
                               LinearChoice(KERNEL_BF16, KERNEL_INT8)),
    "intel-amx": (f"{BASE} {AVX512} avx512_vnni avx512_bf16 avx512_fp16 avx_vnni amx_bf16 amx_tile amx_int8",
                  LinearChoice(ONEDNN, KERNEL_INT8)),
}
W8A8 = QuantScheme("int8", "channel", "int8_token")


@pytest.fixture(params=list(CPUS))
def cpu(request, monkeypatch: pytest.MonkeyPatch) -> tuple[str, LinearChoice]:
    """This process made to see one kind of CPU: the flags function is replaced (its cache with it),
    so every ``cpu_has`` reads the fake line. Nothing is built under it (a build's name hashes the
    flags): tracing never builds a kernel."""
    flags, want = CPUS[request.param]
    monkeypatch.setattr(cpp_library, "cpu_flags", lambda: f"flags\t\t: {flags}")
    return request.param, want


class Projection(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return linear.linear(x, w)


class W8A8Projection(torch.nn.Module):
    def forward(self, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return linear.linear(x, QuantizedWeight(data, scale, W8A8))


def traced_ops(module: torch.nn.Module, *args: torch.Tensor) -> set[str]:
    """The ops a projection is traced into for inductor's CPU compiles (``linear.onednn``)."""
    with linear.onednn():
        program = torch.export.export(module, args, strict=False)
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def test_the_choice_is_the_cpus_and_the_backend_versions_name_it(cpu):
    name, want = cpu
    assert linear_choice() == want, name
    versions = InductorBackend().load_versions()
    assert (versions["bf16"], versions["int8_w8a8"]) == (want.bf16, want.int8_w8a8)


def test_a_bfloat16_projection_is_traced_into_the_chosen_kernel(cpu):
    """nb's kernel where chosen (a projection of 32-channel groups), else oneDNN's packed op where
    oneDNN has native bfloat16 kernels on the real CPU (oneDNN asks the CPU itself), else F.linear."""
    _, want = cpu
    x = torch.randn(5, 32).bfloat16()
    ops = traced_ops(Projection(), x, torch.randn(96, 32).bfloat16())
    odd = traced_ops(Projection(), x, torch.randn(48, 32).bfloat16())  # not 32-channel groups
    native = linear.available(torch.bfloat16, "cpu")
    onednn = "nb._linear_pointwise.default" if native else "aten.linear.default"
    assert onednn in odd and "nb.bf16_linear.default" not in odd
    if want.bf16 == KERNEL_BF16:
        assert "nb.bf16_linear.default" in ops and onednn not in ops
    else:
        assert onednn in ops and "nb.bf16_linear.default" not in ops


def test_a_w8a8_projection_is_traced_and_packed_for_the_chosen_path(cpu, monkeypatch: pytest.MonkeyPatch):
    """nb's kernel (with AVX512-VNNI, a projection of 64-channel groups), oneDNN's u8s8 GEMM (any
    VNNI; a shape the kernel does not take), or the int8 products in float32 over the dense weight
    (no VNNI); the runtime packs the weight for the same path."""
    _, want = cpu
    onednn_here = linear.available(torch.float32, "cpu")  # a torch without oneDNN: products everywhere
    chosen = want.int8_w8a8 if onednn_here else FLOAT32
    x, scale = torch.randn(3, 64), torch.rand(128) + 0.5
    data = torch.randint(-127, 128, (128, 64), dtype=torch.int8)
    ops = traced_ops(W8A8Projection(), x, data, scale)
    odd = traced_ops(W8A8Projection(), x, data[:96], scale[:96])  # not 64-channel groups
    kernel, onednn = "nb.int8_linear.default", "nb._qlinear_pointwise_tensor.default"
    products = "aten.matmul.default"  # the float32 products over the widened int8 weight
    paths = {KERNEL_INT8: kernel, ONEDNN: onednn, FLOAT32: products}
    assert {op for op in paths.values() if op in ops} == {paths[chosen]}
    odd_path = FLOAT32 if chosen == FLOAT32 else ONEDNN
    assert {op for op in paths.values() if op in odd} == {paths[odd_path]}

    # Packing: for nb's kernel where its library is registered (an artifact whose graphs call it)
    monkeypatch.setattr(CppLibrary, "registered", lambda self: self.op == int8_linear_cpu.OP)
    packed = pack_int8(QuantizedWeight(data, scale, W8A8), onednn=onednn_here)
    if chosen == KERNEL_INT8:
        assert packed.vnni and torch.equal(packed.data, int8_linear_cpu.pack(data))
    elif chosen == ONEDNN:
        assert not packed.vnni and packed.data.is_mkldnn
    else:
        assert not packed.vnni and packed.data is data


def test_an_artifact_carries_and_is_keyed_by_the_chosen_kernels(tiny_config_file: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """A bfloat16 W8A8 build's libraries hold nb's kernels exactly where chosen, and its graph keys
    differ between two kinds of CPU exactly where their choices differ (same torch, same ISA)."""
    config = load_config(tiny_config_file)
    config = replace(config, cache=replace(config.cache, dtype="bfloat16"))
    model = replace(read_config(config.model.path), quantization=W8A8)
    keys, libraries = {}, {}
    for name, (flags, want) in CPUS.items():
        monkeypatch.setattr(cpp_library, "cpu_flags", lambda flags=flags: f"flags\t\t: {flags}")
        plan = BuildPlan.make(config, Path("out"), InductorBackend(), model, None)
        keys[name] = frozenset(plan.keys.values())
        libraries[name] = set(ArtifactWriter(plan)._libraries())
        assert ("int8_linear_cpu" in libraries[name]) == (want.int8_w8a8 == KERNEL_INT8), name
        assert ("bf16_linear_cpu" in libraries[name]) == (want.bf16 == KERNEL_BF16), name
    assert len(keys) == len(CPUS) >= 6 and all(len(k) > 1 for k in keys.values())
    for a in CPUS:
        for b in CPUS:
            assert (keys[a] == keys[b]) == (CPUS[a][1] == CPUS[b][1]), (a, b)

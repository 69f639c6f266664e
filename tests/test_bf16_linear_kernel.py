"""nb's bfloat16 kernel (``kernels/bf16_linear_cpu``) against the product it stands for.

The kernel sums the bfloat16 products in float32 and rounds once to bfloat16, as oneDNN's bfloat16
GEMM does; the reference is the float32 product of the same values rounded once. The two sum in
different orders, so they may differ by a unit in the last place of bfloat16, no more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_buckets.kernels import bf16_linear_cpu, cpp_library
from neuron_buckets.kernels.linear_choice import KERNEL_BF16, linear_choice
from neuron_buckets.model import linear

pytestmark = pytest.mark.skipif(not bf16_linear_cpu.cpu_has_bf16(),
                                reason="nb's bfloat16 kernel needs AVX512-BF16, which this CPU lacks")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float()).bfloat16()


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 20), groups=st.integers(1, 4), pairs=st.integers(1, 80),
       seed=st.integers(0, 2**16))
def test_the_kernel_computes_the_rounded_float32_product(tokens, groups, pairs, seed):
    """Tile heights 1 to 8 and the tiles after them; one bfloat16 unit at most apart."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32 * groups, 2 * pairs, generator=gen).bfloat16()
    x = torch.randn(tokens, 2 * pairs, generator=gen).bfloat16()
    want = reference(x, w)
    torch.testing.assert_close(bf16_linear_cpu.bf16_linear(x, bf16_linear_cpu.pack(w)), want,
                               rtol=2**-7, atol=2**-7 * float(want.abs().max()))


def test_leading_dimensions_pass_through():
    w, x = torch.randn(64, 16).bfloat16(), torch.randn(2, 3, 16).bfloat16()
    packed = bf16_linear_cpu.pack(w)
    y = bf16_linear_cpu.bf16_linear(x, packed)
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    assert torch.equal(y, bf16_linear_cpu.bf16_linear(x.reshape(6, 16), packed).reshape(2, 3, 64))


def test_the_packed_layout_is_the_weight_reordered():
    """Group g, input pair p, channel block j, channel c, feature t: w[32g + 16j + c, 2p + t]."""
    w = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6).bfloat16()
    packed = bf16_linear_cpu.pack(w).flatten()
    assert packed.shape == (64 * 6,) and torch.equal(packed.sort().values, w.flatten().sort().values)
    g, p, j, c, t = 1, 2, 1, 5, 1
    assert packed[(((g * 3 + p) * 2 + j) * 16 + c) * 2 + t] == w[32 * g + 16 * j + c, 2 * p + t]


def test_a_shape_outside_the_kernel_is_not_taken_and_is_refused_if_called():
    """A graph traced here calls the kernel for the shapes it fits (and only on a CPU chosen for it:
    test_linear_choice.py), and the kernel refuses any other."""
    assert bf16_linear_cpu.fits(torch.zeros(64, 16, dtype=torch.bfloat16))
    assert not bf16_linear_cpu.fits(torch.zeros(48, 16, dtype=torch.bfloat16))  # not 32-channel groups
    assert not bf16_linear_cpu.fits(torch.zeros(64, 15, dtype=torch.bfloat16))
    assert not bf16_linear_cpu.fits(torch.zeros(64, 16))  # float32 stays on oneDNN
    with pytest.raises(RuntimeError, match="multiple of 32"):
        bf16_linear_cpu.bf16_linear(torch.randn(2, 16).bfloat16(), torch.zeros(48, 16, dtype=torch.bfloat16))


def test_a_bfloat16_projection_is_traced_as_the_kernel_where_it_is_chosen_here():
    """Inside a oneDNN trace a bfloat16 projection of 32-channel groups calls the kernel where it is
    chosen here, else oneDNN's op (a CPU with AMX); the kernel's graph over a weight packed for it
    computes what the kernel does."""
    w, x = torch.randn(96, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    with linear.onednn():
        program = torch.export.export(Projection(), (x, w), strict=False)
    called = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    if linear_choice().bf16 != KERNEL_BF16:
        assert "nb._linear_pointwise.default" in called and "nb.bf16_linear.default" not in called
        return
    assert "nb.bf16_linear.default" in called
    packed = bf16_linear_cpu.pack(w)
    assert torch.equal(program.module()(x, packed), bf16_linear_cpu.bf16_linear(x, packed))


def test_weights_are_packed_for_the_kernel_only_for_an_artifact_that_calls_it():
    """The runtime packs for the kernel only for an artifact whose graphs call it
    (``bf16_kernel_weights``), and an eager call on a weight packed for it runs it too (``nb verify``'s
    model)."""
    w, x = torch.randn(96, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    assert linear.pack_dense(w).is_mkldnn  # an artifact without the kernel: oneDNN's layout
    with linear.bf16_kernel_weights(True):
        packed = linear.pack_dense(w)
    assert not packed.is_mkldnn and torch.equal(packed, bf16_linear_cpu.pack(w))
    assert torch.equal(linear.linear(x, packed), bf16_linear_cpu.bf16_linear(x, packed))
    assert not bf16_linear_cpu.is_packed(w) and not bf16_linear_cpu.is_packed(packed.clone())


class Projection(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return linear.linear(x, w)


def test_an_artifact_library_is_refused_in_one_line_on_a_cpu_without_avx512_bf16(monkeypatch, tmp_path):
    monkeypatch.setattr(cpp_library, "cpu_flags", lambda: "flags\t\t: fpu sse sse2 avx avx2")  # no AVX-512
    with pytest.raises(RuntimeError, match="needs AVX512-BF16") as e:
        bf16_linear_cpu.LIBRARY.register(tmp_path / "bf16_linear_cpu.so")
    assert "\n" not in str(e.value)

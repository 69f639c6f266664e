"""nb's INT8 W8A8 kernel (``kernels/int8_linear_cpu``) against the arithmetic it stands for.

The reference is the graphs' own W8A8 path before the kernel: ``per_token_int8``, the integer
products summed in float32 (exact at these sizes: every partial sum is below 2**24), times the
weight's scales, then the token's, rounded once to the activations' dtype. The kernel sums in
int32 and scales in the same order, so the two agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_buckets.kernels import cpp_library, int8_linear_cpu
from neuron_buckets.model.quant.quantized_linear import per_token_int8

pytestmark = pytest.mark.skipif(not int8_linear_cpu.cpu_has_vnni(),
                                reason="nb's INT8 kernel needs AVX512-VNNI, which this CPU lacks")


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q, x_scale = per_token_int8(x)
    return (((q @ w.float().t()) * scale) * x_scale).to(x.dtype)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 9),
    groups=st.integers(1, 3),
    fours=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_equals_the_quantized_arithmetic_it_replaces(tokens, groups, fours, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    out, inp = 64 * groups, 4 * fours
    w = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=gen)
    scale = torch.rand(out, generator=gen) / 64
    x = (torch.randn(tokens, inp, generator=gen) * 4).to(dtype)
    assert torch.equal(int8_linear_cpu.int8_linear(x, int8_linear_cpu.pack(w), scale), reference(x, w, scale))


def test_leading_dimensions_pass_through_and_a_zero_token_gives_zeros():
    w = torch.randint(-127, 128, (128, 32), dtype=torch.int8)
    x = torch.randn(2, 3, 32)
    x[1, 2] = 0.0
    y = int8_linear_cpu.int8_linear(x, int8_linear_cpu.pack(w), torch.ones(128))
    assert y.shape == (2, 3, 128)
    assert torch.equal(y[1, 2], torch.zeros(128))
    assert torch.equal(y, reference(x.reshape(6, 32), w, torch.ones(128)).reshape(2, 3, 128))


def test_a_shape_outside_the_kernel_is_not_taken_and_is_refused_if_called():
    assert int8_linear_cpu.fits(torch.zeros(128, 64, dtype=torch.int8))
    assert not int8_linear_cpu.fits(torch.zeros(96, 64, dtype=torch.int8))  # not 64-channel groups
    assert not int8_linear_cpu.fits(torch.zeros(128, 66, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        int8_linear_cpu.int8_linear(torch.randn(2, 64), torch.zeros(96, 64, dtype=torch.int8), torch.ones(96))


def test_an_artifact_library_is_refused_in_one_line_on_a_cpu_without_vnni(monkeypatch, tmp_path):
    monkeypatch.setattr(cpp_library, "cpu_flags", lambda: "flags\t\t: fpu sse sse2 avx avx2")  # no AVX-512
    with pytest.raises(RuntimeError, match="needs AVX512-VNNI") as e:
        int8_linear_cpu.LIBRARY.register(tmp_path / "int8_linear_cpu.so")
    assert "\n" not in str(e.value)

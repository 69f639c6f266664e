"""The projections' oneDNN path: packed weights compute F.linear, and compiled graphs call oneDNN's
C shim directly, so a serving process needs nothing of ``model/linear.py`` registered."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from neuron_buckets.backends.inductor import InductorBackend
from neuron_buckets.model import linear
from neuron_buckets.model.weights import LayerWeights

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 40), k=st.sampled_from([16, 48, 64]), n=st.sampled_from([8, 32, 96]),
       bias=st.booleans())
def test_a_packed_weight_computes_f_linear(tokens: int, k: int, n: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(tokens * k + n)
    x, w = torch.randn(tokens, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, linear.PACK_TOKENS)
    torch.testing.assert_close(linear.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _layer(dtype: torch.dtype) -> LayerWeights:
    def t(*shape: int) -> Tensor:
        return torch.randn(shape).to(dtype)

    return LayerWeights(input_norm=t(16), qkv=t(32, 16), o=t(16, 16), post_norm=t(16), gate_up=t(48, 16),
                        down=t(16, 24), qkv_bias=t(32))


NATIVE_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pack_packs_the_projections_only(dtype: torch.dtype) -> None:
    """float32 always; bfloat16 where oneDNN has native bfloat16 kernels (else nothing to pack)."""
    dense = _layer(dtype)
    packed = linear.pack(dense)
    for name in ("input_norm", "post_norm", "qkv_bias"):
        assert getattr(packed, name) is getattr(dense, name)
    if dtype == torch.bfloat16 and not NATIVE_BF16:
        assert packed == dense
        return
    for name in linear.PROJECTIONS:
        assert getattr(packed, name).is_mkldnn and getattr(packed, name).dtype == dtype
        assert torch.equal(getattr(packed, name).to_dense(), getattr(dense, name))


def test_float16_stays_dense_on_every_cpu() -> None:
    """oneDNN packs float16 only where the CPU has native float16 (AVX512-FP16), and nb has not
    measured it there, so ``pack`` leaves float16 projections as they are everywhere."""
    fp16 = _layer(torch.float16)
    packed = linear.pack(fp16)
    assert all(getattr(packed, name) is getattr(fp16, name) for name in linear.PROJECTIONS)


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bfloat16 for oneDNN")
@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 40), k=st.sampled_from([16, 64]), n=st.sampled_from([8, 96]), bias=st.booleans())
def test_a_packed_bfloat16_weight_computes_f_linear(tokens: int, k: int, n: int, bias: bool) -> None:
    """Both sum in float32 and round once: equal to a unit in the last place of bfloat16."""
    gen = torch.Generator().manual_seed(tokens * k + n)
    x, w = torch.randn(tokens, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, linear.PACK_TOKENS)
    torch.testing.assert_close(linear.linear(x, packed, b), F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)


class Projection(nn.Module):
    def forward(self, x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return torch.relu(linear.linear(x, w, b))


RUN_WITHOUT_NB = """
import sys, torch
x, w, b = torch.load(sys.argv[2])
graph = torch._inductor.aoti_load_package(sys.argv[1])
packed = torch.ops.mkldnn._reorder_linear_weight(w, 512)
assert not hasattr(torch.ops, "nb") or not hasattr(torch.ops.nb, "_linear_pointwise")
torch.testing.assert_close(graph(x, packed, b), torch.relu(torch.nn.functional.linear(x, w, b)))
print("ok")
"""


def test_a_compiled_graph_calls_onednn_directly_on_packed_weights(tmp_path) -> None:
    x, w, b = torch.randn(12, 64), torch.randn(96, 64), torch.randn(96)
    out = tmp_path / "projection.pt2"
    InductorBackend().compile(Projection(), (x, w, b), out, {}, None)
    with zipfile.ZipFile(out) as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    assert "aoti_torch_cpu__linear_pointwise(" in wrapper
    assert "aoti_torch_proxy_executor_call_function" not in wrapper  # no call back into Python
    torch.save((x, w, b), tmp_path / "inputs.pt")
    run = subprocess.run([sys.executable, "-c", RUN_WITHOUT_NB, str(out), str(tmp_path / "inputs.pt")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_the_runtime_packs_the_head_and_computes_what_the_dense_head_does(compiled_dir) -> None:
    """The head's projection is read whole by every decode step, so the runtime packs it as it
    packs the layers'; the logits are the dense head's."""
    from conftest import decode_plan, prefill_plan

    from neuron_buckets import BucketRuntime

    runtime = BucketRuntime.open(compiled_dir)
    norm, packed = runtime.head_weights
    assert packed.is_mkldnn
    prompt = prefill_plan([(list(range(3, 15)), 0, [1, 2])])
    rows = decode_plan([([7], 12, [1, 2]), ([9], 5, [3])])
    runtime.run_plan(prompt)
    with_packed = runtime.run_plan(rows)
    runtime.head_weights = (norm, packed.to_dense())
    assert torch.equal(runtime.run_plan(rows), with_packed)

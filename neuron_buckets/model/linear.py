"""The model's projections: ``F.linear``, or oneDNN's kernels over weights packed at load.

``F.linear`` on float32 CPU tensors is MKL's sgemm, which on AMD runs far below the machine's
AVX-512 rate; oneDNN generates its kernels for the CPU it runs on, and reads a weight packed once
into its blocked layout faster still (it is what vLLM CPU calls). So where inductor compiles for a
CPU (``onednn()`` around the trace), each projection is one call of ``nb::_linear_pointwise``: an
op opaque to inductor, whose schema is oneDNN's ``mkldnn::_linear_pointwise``, so that AOTInductor
calls that op's C shim directly (``C_SHIMS``) and a loaded graph needs nothing registered from
Python. It computes the same product over a dense weight or over the packed one ``pack`` makes;
the runtime packs the layers' projections once, as it loads them, and keeps no dense copy. It packs
the head's projection too: a decode step reads the whole vocabulary's rows, and over the plain
layout oneDNN streams a few rows' product well below memory speed. A tied embedding is then held
twice, dense for the embed piece's gather and packed for the head; the memory estimates
(``runtime/memory.py``) count it once, as the lower bound they are.

bfloat16 takes the same path where oneDNN has native bfloat16 kernels (AVX512-BF16, AMX): its
``F.linear`` is oneDNN already, but over the plain layout a small batch reads the weight in a
shape oneDNN's kernels stream poorly, so the packed layout pays most at decode. Where the CPU has
AVX512-BF16 (and no AMX), a bfloat16 projection whose output channels are a multiple of 32 runs nb's own
kernel instead (``kernels/bf16_linear_cpu.py``), over a weight packed once for it: it streams a
decode step's few rows' weights nearer memory speed than oneDNN does, and a prefill call about as
fast. The graph takes it as it is traced; the runtime packs for it where the artifact carries its
library, so graphs and weights agree. float16 stays
``F.linear``: oneDNN packs it only on CPUs with native float16 arithmetic (AVX512-FP16), where
nb has not measured it.

A quantized projection (``QuantizedWeight``): int8 runs its scheme's kernel
(``model/quant/quantized_linear.py``). float8: no CPU kernel here reads it at speed
(``torch._scaled_mm`` and a per-call widening both ran many times slower than the bfloat16 GEMM;
CHANGELOG has the figures), so the runtime widens it once, at load, to the model dtype (exact),
packed as a dense weight is, and the scale multiplies the GEMM's output. The artifact keeps the
float8 bytes; the runtime holds the model dtype's. Static float8 activations (a stored input scale
per projection) are rounded to float8 in the graph as vLLM rounds them (``x / input_scale``,
clamped to float8's range), widened back (exact), and the GEMM's output is scaled by both scales:
the products ``torch._scaled_mm`` would sum, by the model dtype's GEMM.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from neuron_buckets.kernels import bf16_linear_cpu
from neuron_buckets.kernels.linear_choice import KERNEL_BF16, linear_choice
from neuron_buckets.model.lora_weight import AdaptedWeight
from neuron_buckets.model.quant.quantized_linear import QOP, QOP_SHIM, int8_linear, pack_int8
from neuron_buckets.model.quant.quantized_weight import QuantizedWeight, runtime_dtype
from neuron_buckets.model.weights import PROJECTIONS, LayerWeights, Weight

torch.library.define(
    "nb::_linear_pointwise",
    "(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, str? algorithm) -> Tensor",
)
OP = torch.ops.nb._linear_pointwise.default
# oneDNN's C shim of the same schema, as AOTInductor declares the shims of custom ops.
C_SHIMS = {
    OP: [
        "AOTITorchError aoti_torch_cpu__linear_pointwise(AtenTensorHandle X, AtenTensorHandle W, "
        "AtenTensorHandle* B, const char* attr, const double** scalars, int64_t scalars_len_, "
        "const char** algorithm, AtenTensorHandle* ret0)"
    ],
    QOP: [QOP_SHIM],
}
FLOAT8_MAX = 448.0  # float8_e4m3fn's largest finite value: what vLLM clamps the activations to
PACK_TOKENS = 512  # oneDNN's batch hint: one blocked layout serves every bucket (1 token and up)


@torch.library.impl("nb::_linear_pointwise", ("CPU", "MkldnnCPU"))  # dense and packed weights
def _linear_pointwise(x: Tensor, weight: Tensor, bias: Tensor | None, attr: str, scalars: list,
                      algorithm: str | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, scalars, algorithm)


@torch.library.register_fake("nb::_linear_pointwise")
def _linear_pointwise_fake(x: Tensor, weight: Tensor, bias: Tensor | None, attr: str, scalars: list,
                           algorithm: str | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# Set around a block by the context managers below: a trace for inductor's CPU compiles, and a
# runtime loading an artifact whose graphs call nb's bfloat16 kernel.
_mode = {"tracing_onednn": False, "bf16_kernel_weights": False, "portable": False}


@contextmanager
def _setting(key: str, value: bool) -> Iterator[None]:
    previous, _mode[key] = _mode[key], value
    try:
        yield
    finally:
        _mode[key] = previous


def available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether oneDNN computes this dtype's projections over packed weights here: float32 on a
    CPU, and bfloat16 where the CPU has oneDNN's native bfloat16 kernels."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    native_bf16 = dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32 or native_bf16


def onednn() -> AbstractContextManager[None]:
    """Trace the projections as oneDNN calls inside the block (inductor's CPU compiles), and
    bfloat16 ones as nb's kernel where it applies."""
    return _setting("tracing_onednn", True)


def portable() -> AbstractContextManager[None]:
    """Trace int8 projections as the plain products any compiler lowers (widen, matmul, scale)
    instead of torch's CPU-only int8 kernel: a graph for another compiler (StableHLO) traced on
    the CPU, as an XLA device trace gets them by its device."""
    return _setting("portable", True)


def bf16_kernel_weights(on: bool) -> AbstractContextManager[None]:
    """Inside the block, if ``on``, pack bfloat16 projections for nb's kernel: for an artifact whose
    graphs call it (its manifest carries the kernel's library), and for no other."""
    return _setting("bf16_kernel_weights", on)


def linear(x: Tensor, weight: Weight, bias: Tensor | None = None) -> Tensor:
    """``F.linear``, through oneDNN in a oneDNN trace or on a packed weight (the eager reference
    runs the runtime's packed weights too); a quantized weight by its scheme's kernel; a LoRA
    projection (``model/lora.py``) as its base plus each token's adapter's delta."""
    if isinstance(weight, AdaptedWeight):
        return linear(x, weight.base, bias) + weight.delta(x)
    if isinstance(weight, QuantizedWeight):
        if weight.scheme.weights == "int8":
            onednn = _mode["tracing_onednn"] and available(torch.float32, x.device)
            out = int8_linear(x, weight, onednn, _mode["portable"])
        elif weight.input_scale is None:  # float8, widened at load (a no-op here then)
            out = (linear(x, weight.data.to(x.dtype)) * weight.scale).to(x.dtype)
        else:  # and static float8 activations: x rounded to float8 by the stored scale, widened back
            qx = (x.float() / weight.input_scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)
            scale = weight.scale * weight.input_scale
            out = (linear(qx.to(x.dtype), weight.data.to(x.dtype)) * scale).to(x.dtype)
        return out if bias is None else out + bias
    tracing = _mode["tracing_onednn"]
    traced_bf16 = (tracing and x.dtype == torch.bfloat16 and bf16_linear_cpu.fits(weight)
                   and linear_choice().bf16 == KERNEL_BF16)
    if traced_bf16 or bf16_linear_cpu.is_packed(weight):
        out = bf16_linear_cpu.bf16_linear(x, weight)
        return out if bias is None else out + bias
    if weight.is_mkldnn or (tracing and available(weight.dtype, weight.device)):
        return OP(x, weight, bias, "none", [], None)
    return F.linear(x, weight, bias)


def pack_dense(weight: Tensor) -> Tensor:
    """A dense weight in the layout of the kernel its graphs call: nb's bfloat16 kernel's where the
    artifact's graphs call it (``bf16_kernel_weights``) and it fits, else oneDNN's blocked layout,
    where oneDNN computes its dtype here."""
    if _mode["bf16_kernel_weights"] and bf16_linear_cpu.fits(weight):
        return bf16_linear_cpu.pack(weight)
    if not available(weight.dtype, weight.device):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_TOKENS)


def pack(layer: LayerWeights) -> LayerWeights:
    """The layer's projections in the layout their kernels read (oneDNN's blocked layout, where
    oneDNN computes their dtype here); the loader packs each layer as it builds it, so the dense
    copies never pile up."""
    dtype = layer.input_norm.dtype
    onednn = available(torch.float32, layer.input_norm.device)

    def packed(w: Weight) -> Weight:
        if not isinstance(w, QuantizedWeight):
            return pack_dense(w)
        if w.scheme.weights == "int8":
            return pack_int8(w, onednn)
        return replace(w, data=pack_dense(w.data.to(runtime_dtype(w.scheme, dtype))))

    return replace(layer, **{name: packed(getattr(layer, name)) for name in PROJECTIONS})

"""The int8 projections of a quantized model: each scheme's GEMM, the dequantization inside it.

Chosen by measuring the candidates at the Llama-3.2-1B projections' shapes on this project's CPU
(AVX-512 with VNNI and BF16, no AMX, no FP16 arithmetic); CHANGELOG has the figures.

- int8 weights, model-dtype activations (W8A16): ``aten._weight_int8pack_mm``, torch's
  weight-only kernel. It reads the int8 weight and applies the per-channel scale in its epilogue,
  and inductor lowers it with the weight as a graph input.
- int8 weights and int8 per-token activations (W8A8), on a CPU with AVX512-VNNI: nb's own kernel,
  ``nb::int8_linear`` (``kernels/int8_linear_cpu.py``), which quantizes the activations per token
  and streams a weight packed once at load closer to memory speed than oneDNN's kernel below.
- W8A8 elsewhere on a CPU with VNNI (AVX-VNNI only, or a shape nb's kernel does not take): the
  step's activations are quantized per token in the graph, then oneDNN's u8s8 int8 GEMM (VNNI)
  runs over a weight packed once at load, the weight scales in its epilogue, the token scales
  after it. oneDNN's signed-int8 activation path
  is a reference loop, orders of magnitude slower, so the activations are shifted to u8 with a
  zero point of 128 (the same products). ``torch._int_mm`` reorders the weight on every call.
  Inductor's own lowering of oneDNN's op wants the packed weight as a graph constant, so the graph
  calls it as ``nb::_qlinear_pointwise_tensor``, opaque to inductor, whose schema and C shim are
  oneDNN's: weights stay inputs and a loaded graph needs nothing registered from Python.
- W8A8 on a CPU without VNNI: the same products in float32 over the dense int8 weight, widened in
  the graph. There oneDNN's u8s8 GEMM did not compute the reference's products (likely its int16
  pair sums saturating for activations shifted to u8; ``tests/test_quantized.py`` holds it).

Off the CPU (the XLA device the Neuron pieces lower on), and in a StableHLO trace (``portable``),
neither kernel exists: the graph widens the int8 weight and multiplies by the scales around a plain
matmul (W8A8: over its int8-valued activations), which XLA and StableHLO lower as convert, dot and
multiply with the weights and scales as inputs.

float8 weights are ``model/linear.py``'s: a dense GEMM over weights widened at load.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from neuron_buckets.kernels import int8_linear_cpu
from neuron_buckets.kernels.linear_choice import FLOAT32, KERNEL_INT8, linear_choice
from neuron_buckets.model.quant.quantized_weight import QuantizedWeight

torch.library.define(
    "nb::_qlinear_pointwise_tensor",
    "(Tensor qx, Tensor x_scale, Tensor x_zero_point, Tensor qw, Tensor w_scale, Tensor w_zero_point, "
    "Tensor? bias, float output_scale, int output_zero_point, ScalarType? output_dtype, "
    "str post_op_name, Scalar?[] post_op_args, str post_op_algorithm) -> Tensor",
)
QOP = torch.ops.nb._qlinear_pointwise_tensor.default
QOP_SHIM = (
    "AOTITorchError aoti_torch_cpu__qlinear_pointwise_tensor(AtenTensorHandle X, AtenTensorHandle act_scale, "
    "AtenTensorHandle act_zero_point, AtenTensorHandle onednn_weight, AtenTensorHandle weight_scales, "
    "AtenTensorHandle weight_zero_points, AtenTensorHandle* B, double output_scale, "
    "int64_t output_zero_point, "
    "const int32_t* output_dtype, const char* post_op_name, const double** post_op_args, "
    "int64_t post_op_args_len_, const char* post_op_algorithm, AtenTensorHandle* ret0)"
)
ZERO_POINT = 128  # the u8 activations' zero: int8 values shifted into u8's range
INT8_MAX = 127.0
PACK_TOKENS = 512  # oneDNN's batch hint for the packed int8 layout, as for the dense projections


@torch.library.impl("nb::_qlinear_pointwise_tensor", ("CPU", "MkldnnCPU"))
def _qlinear(qx: Tensor, x_scale: Tensor, x_zp: Tensor, qw: Tensor, w_scale: Tensor, w_zp: Tensor,
             bias: Tensor | None, out_scale: float, out_zp: int, out_dtype: torch.dtype | None,
             post_op: str, post_args: list, post_algorithm: str) -> Tensor:
    return torch.ops.onednn.qlinear_pointwise.tensor(qx, x_scale, x_zp, qw, w_scale, w_zp, bias, out_scale,
                                                     out_zp, out_dtype, post_op, post_args, post_algorithm)


@torch.library.register_fake("nb::_qlinear_pointwise_tensor")
def _qlinear_fake(qx: Tensor, x_scale: Tensor, x_zp: Tensor, qw: Tensor, w_scale: Tensor, w_zp: Tensor,
                  bias: Tensor | None, out_scale: float, out_zp: int, out_dtype: torch.dtype | None,
                  post_op: str, post_args: list, post_algorithm: str) -> Tensor:
    # The output channels are the scales' count: the packed weight is (in, out), the traced one (out, in).
    return qx.new_empty(*qx.shape[:-1], w_scale.shape[0], dtype=out_dtype)


def per_token_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric dynamic quantization per token (row): int8 values as float32, and the scales."""
    h = x.float()
    scale = h.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    return (h / scale).round().clamp(-INT8_MAX, INT8_MAX), scale


def int8_linear(x: Tensor, w: QuantizedWeight, onednn: bool, portable: bool = False) -> Tensor:
    """``x @ dequantized(w).T`` by the scheme's kernel; ``onednn``: trace the CPU's chosen calls
    (``linear_choice``): nb's kernel, oneDNN's, or float32 products; ``portable``: the plain
    products, as off the CPU (``linear.portable``)."""
    if w.scheme.activations == "int8_token":
        choice = linear_choice().int8_w8a8
        if w.vnni or (onednn and choice == KERNEL_INT8 and int8_linear_cpu.fits(w.data)):
            return int8_linear_cpu.int8_linear(x, w.data, w.scale)
        q, x_scale = per_token_int8(x)
        if (onednn and choice != FLOAT32) or w.data.is_mkldnn:
            u8 = (q + ZERO_POINT).to(torch.uint8)
            y = QOP(u8, torch.ones((), device=x.device), torch.full((), ZERO_POINT, dtype=torch.int32),
                    w.data, w.scale, torch.zeros(w.scale.shape, dtype=torch.int32, device=x.device), None,
                    1.0, 0, torch.float32, "none", [None], "")
        else:  # the same products, where oneDNN is not (a dense weight, another device)
            y = (q @ w.data.float().t()) * w.scale
        return (y * x_scale).to(x.dtype)
    if portable or x.device.type != "cpu":  # torch's kernel is a CPU op; XLA and StableHLO get products
        return torch.nn.functional.linear(x, w.data.to(x.dtype)) * w.scale.to(x.dtype)
    return torch.ops.aten._weight_int8pack_mm(x, w.data, w.scale.to(x.dtype))


def pack_int8(w: QuantizedWeight, onednn: bool) -> QuantizedWeight:
    """The weight in the layout its kernel reads: W8A8's packed once for nb's INT8 kernel where
    this process has it (an artifact whose graphs call it registered it), else for oneDNN where
    its INT8 GEMM is exact (VNNI), else dense for the graph's float32 products."""
    if w.scheme.activations != "int8_token" or not onednn:
        return w
    choice = linear_choice().int8_w8a8
    if choice == KERNEL_INT8 and int8_linear_cpu.LIBRARY.registered() and int8_linear_cpu.fits(w.data):
        return replace(w, data=int8_linear_cpu.pack(w.data), vnni=True)
    if choice == FLOAT32:
        return w  # dense: the graph computes in float32
    return replace(w, data=torch.ops.onednn.qlinear_prepack(w.data, [PACK_TOKENS, w.data.shape[1]]))

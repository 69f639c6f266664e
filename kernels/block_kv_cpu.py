"""Block-KV attention on the CPU, for every step: a C++ kernel, ``nb::block_kv_attention``.

Decode rows: a decode step reads every cached K and V vector of its rows once, so its attention
is bound by memory. Inductor's loops over ``block_kv_paged`` compute one 64-wide dot product per
score, reduced across the vector register each time, with the query's rotation recomputed inside
it. ``block_kv_cpu.cpp`` walks each row's blocks in order (all kv heads of a slot at once, the next
block prefetched), transposes each block's keys so that a query's scores are broadcast
multiply-adds with no reduction across the register, and keeps an online softmax per query
(faster than the inductor kernel it replaced; CHANGELOG has the figures).

Prompt chunks: their attention is compute, about a tenth of a prefill layer's work. Flex
attention's CPU template ran it far below the GEMM rate (CHANGELOG has the figures). Here each
tile of a segment's queries, the query heads of one kv head stacked, meets chunks of keys in two
GEMMs (scores, then weighted values; ``sgemm_`` of the BLAS torch links, MKL in its x86 wheels)
with an online softmax between; keys past the tile's last token or outside a window are never
computed, and the context is gathered from its blocks, never past its length.

Both keep the golden's contract, masking and NaN safety (``block_kv_torch``), tested against it.

bfloat16 and float16 models take the same kernel: the cache is read in its own dtype (half the
bytes a decode row streams) and widened to float32 block by block, so scores, softmax and sums run
in float32 and only the output is rounded. The torch paths it replaces there (flex attention and
its helpers) are generic CPU templates that a half-precision step with context ran several times
slower than this kernel.

The op is declared here (schema and shape function), so any process can trace and compile graphs
that call it. Its CPU kernel is C++, vectorised with ATen's ``Vectorized`` for the instruction set
inductor picks on this machine (AVX-512, AVX2, or none), built and shipped in the artifact as
``kernels/cpp_library.py`` says.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .cpp_library import CppLibrary

OP = "nb::block_kv_attention"
LIBRARY = CppLibrary(Path(__file__).with_suffix(".cpp"), OP, "nb's CPU attention kernel")

torch.library.define(
    OP,
    "(Tensor q, Tensor k_active, Tensor v_active, Tensor k_cache, Tensor v_cache, Tensor block_table, "
    "Tensor cache_lens, Tensor segment_ids, float scale, int? window) -> Tensor",
)


@torch.library.register_fake(OP)
def _block_kv_attention_fake(q: Tensor, *_: object) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


DTYPES = ("float32", "bfloat16", "float16")  # what the kernel reads, each computed in float32


def applies(device: torch.device | str, *dtypes: torch.dtype | str) -> bool:
    """Whether attention on ``device`` over tensors of ``dtypes`` runs in this kernel: one of
    ``DTYPES`` on a CPU (dtypes as torch dtypes, or their names as a config writes them)."""
    names = {str(d).removeprefix("torch.") for d in dtypes}
    return torch.device(device).type == "cpu" and len(names) == 1 and names <= set(DTYPES)


def block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None) -> Tensor:
    """An ``AttentionKernel``: the inputs, output and masking of ``block_kv_torch.block_kv_attention``."""
    LIBRARY.ensure()
    return torch.ops.nb.block_kv_attention(
        q, k_active, v_active, k_cache, v_cache, *step, scale, window
    )

"""Which implementation of the two block-KV ops the model runs: the torch paths, or a swap-in.

The model calls ``write_kv_cache`` and ``block_kv_attention`` from here. By default (``DEFAULT``)
the cache write is the golden of ``block_kv_torch`` and the attention a fast path
(``fast_attention``): on a CPU (float32, bfloat16, float16) the C++ kernel of ``block_kv_cpu`` for
every step, else
``block_kv_flex`` (block-sparse flex attention for long rows, the in-place reads of
``block_kv_paged`` for decode rows, the fused SDPA call of ``block_kv_sdpa`` between). Both agree
with the golden within float tolerance and compile to far less work; ``GOLDEN`` is the
readable reference every other implementation is tested against. A backend with its own kernels
(Neuron: the NKI kernels of ``block_kv_nki``) installs them with ``use(kernels)`` for the duration
of a trace, so the model code is identical on every backend and the swap is visible in one place.
The choice is a plain module global, which torch.compile and torch.export trace as a constant;
compiles run one per process, so no two traces ever share it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from . import block_kv_cpu, block_kv_flex, block_kv_torch
from .attention_kernel import AttentionKernel


@dataclass(frozen=True)
class KernelSet:
    """One implementation of both ops, with the goldens' signatures and semantics."""

    name: str
    write_kv_cache: Callable[..., None]
    block_kv_attention: AttentionKernel


def fast_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None) -> Tensor:
    """The golden's attention, fast: the C++ kernel where it applies (a CPU, in float32 or half
    precision: decode rows and prompt chunks alike, each segment at its own cost, faster than flex
    on both), else
    the torch paths of ``block_kv_flex``. The choice is made at trace time, on dtypes and device."""
    kernel = block_kv_cpu if block_kv_cpu.applies(q.device, q.dtype, k_cache.dtype) else block_kv_flex
    return kernel.block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window)


GOLDEN = KernelSet("torch", block_kv_torch.write_kv_cache, block_kv_torch.block_kv_attention)
DEFAULT = KernelSet("fast", block_kv_torch.write_kv_cache, fast_attention)
_active = DEFAULT


def active() -> KernelSet:
    """The kernel set the model calls right now."""
    return _active


@contextmanager
def use(kernels: KernelSet) -> Iterator[KernelSet]:
    """Run the model with ``kernels`` inside the ``with`` block; the previous set comes back after."""
    global _active
    previous, _active = _active, kernels
    try:
        yield kernels
    finally:
        _active = previous


def write_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write K/V into one layer's caches at ``slot_mapping`` in place (slot -1 writes nothing)."""
    _active.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window=None) -> Tensor:
    """Paged attention over the block table plus the step's own tokens, with the active kernels."""
    return _active.block_kv_attention(q, k_active, v_active, k_cache, v_cache, step, scale, window)

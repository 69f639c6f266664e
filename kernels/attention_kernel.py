"""The one signature every block-KV attention kernel has: golden, fast torch paths, C++ and NKI glue.

Stated here once; each kernel is a function of these eight arguments, in this order, and the
dispatcher (``dispatch.py``) holds whichever runs now as an ``AttentionKernel``.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from .attention_step import AttentionStep


class AttentionKernel(Protocol):
    def __call__(
        self,
        q: Tensor,
        k_active: Tensor,
        v_active: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        step: AttentionStep,
        scale: float,
        window: int | None = None,
    ) -> Tensor:
        """Attention of (B, S, H, D) queries over the paged context plus the step's own tokens.

        ``k_active``/``v_active`` (B, S, KVH, D) are the step's own K/V, so the result does not
        depend on whether the cache write happened first; ``k_cache``/``v_cache`` are one layer's
        (num_blocks, block_size, KVH, D) caches, read through ``step`` (``AttentionStep``). Query
        head h uses kv head ``h // (H // KVH)``; ``scale`` multiplies the scores; ``window`` is a
        sliding window (None: the whole context). The output is (B, S, H, D) in ``q.dtype``.
        """
        ...

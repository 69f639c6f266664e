"""``AttentionKernel``: the block-KV attention's eight arguments, stated once, taken by every kernel."""

from __future__ import annotations

import inspect
from pathlib import Path

from neuron_buckets import kernels
from neuron_buckets.kernels import (
    block_kv_cpu,
    block_kv_flex,
    block_kv_paged,
    block_kv_sdpa,
    block_kv_torch,
    dispatch,
    nki_ops,
)
from neuron_buckets.kernels.attention_kernel import AttentionKernel

KERNELS = (
    block_kv_torch.block_kv_attention,
    block_kv_sdpa.block_kv_attention,
    block_kv_flex.block_kv_attention,
    block_kv_paged.block_kv_attention,
    block_kv_cpu.block_kv_attention,
    nki_ops.block_kv_attention,
    dispatch.fast_attention,
    dispatch.block_kv_attention,
)


def test_every_attention_kernel_takes_the_protocols_arguments_in_its_order():
    want = list(inspect.signature(AttentionKernel.__call__).parameters.values())[1:]
    for kernel in KERNELS:
        got = list(inspect.signature(kernel).parameters.values())
        assert [(p.name, p.default) for p in got] == [(p.name, p.default) for p in want], kernel.__module__


def test_the_typed_signature_is_written_once():
    sources = {p.name: p.read_text() for p in Path(kernels.__path__[0]).glob("*.py")}
    spelled = "v_cache: Tensor,\n        step: AttentionStep,\n        scale: float,"
    typed = [name for name, text in sources.items() if spelled.replace("\n        ", "\n    ") in text
             or spelled in text]
    assert typed == ["attention_kernel.py"]

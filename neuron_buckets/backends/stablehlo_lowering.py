"""A piece lowered to StableHLO as Neuron's torch-mlir route lowers it, and run by IREE on the CPU.

Neuron SDK 2.33 made Dynamo FX -> torch-mlir -> StableHLO -> neuronx-cc its default compile route
(the torch-xla route is deprecated). ``lower`` follows it as far as a machine without the SDK
can: the piece is exported by ``torch.export`` with the goldens of ``kernels/block_kv_torch`` in
place of the NKI kernels (and int8 projections as plain products, ``linear.portable``), then
imported by torch-mlir's FX importer with its default decompositions and lowered to the StableHLO
dialect. Every input stays a function argument (the pieces hold no parameters, so nothing can
freeze into a constant), and the layer piece is made functional: its
KV cache slices come in and their updated copies go out as results 1 and 2. A tensor-parallel
piece's collectives become StableHLO collectives over the replicas of its degree as it is imported
(``stablehlo_collectives``: torch-mlir itself has no lowering of them).

IREE's ``llvm-cpu`` target then compiles the same bytecode and runs it, which is how the CPU
proves the StableHLO computes what the eager model does. Both are used as libraries; no MLIR text
is written by hand here.
"""

from __future__ import annotations

import functools
import hashlib
import io
import re
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from neuron_buckets.backends.base import BackendUnavailable

INSTALL_HINT = "pip install 'neuron-buckets[stablehlo]' (torch-mlir, iree-base-compiler, iree-base-runtime)"
IREE_TARGET = "llvm-cpu"
# The host's CPU: the vmfb is built at load time on the machine that runs it, never stored.
IREE_ARGS = ("--iree-llvmcpu-target-cpu=host",)
# How torch dtypes cross into numpy for IREE: those numpy lacks go through ml_dtypes, bit for bit.
_VIA_BITS = {
    torch.bfloat16: ("bfloat16", torch.int16, np.int16),
    torch.float8_e4m3fn: ("float8_e4m3fn", torch.uint8, np.uint8),
    torch.float8_e5m2: ("float8_e5m2", torch.uint8, np.uint8),
}


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _require(module: str, package: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        raise BackendUnavailable(f"{package} not importable ({exc}); {INSTALL_HINT}") from None


def decompositions() -> str:
    """A digest of what torch-mlir adds to and drops from torch's core ATen decompositions before
    import (with torch's version, in the key, that fixes the table): part of the toolchain, so a
    torch-mlir whose lists differ lowers every piece again. The table itself is not hashed: its
    contents depend on which torch modules the process imported before."""
    fx_decomp = _require("torch_mlir.extras.fx_decomp_util", "torch-mlir")
    lists = (fx_decomp.DEFAULT_DECOMPOSITIONS, fx_decomp._EXPANDED_DECOMP_EXCLUDE)
    text = "\n--\n".join("\n".join(sorted(map(str, ops))) for ops in lists)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def toolchain() -> dict[str, str]:
    """What shapes the StableHLO: hashed into every key and recorded in the manifest."""
    return {"torch-mlir": package_version("torch-mlir"), "torch-mlir-decompositions": decompositions()}


class FunctionalLayer(nn.Module):
    """The layer piece with its cache slices as inputs and their updated copies as outputs 1 and 2:
    StableHLO has no in-place update of an argument, so the write is a result the caller stores."""

    def __init__(self, piece: nn.Module) -> None:
        super().__init__()
        self.piece = piece

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor, block_table: Tensor,
                cache_lens: Tensor, segment_ids: Tensor, k_cache: Tensor, v_cache: Tensor,
                *weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        k, v = k_cache.clone(), v_cache.clone()
        out = self.piece(h, cos, sin, slot_mapping, block_table, cache_lens, segment_ids, k, v, weights)
        return out, k, v


class FlatPiece(nn.Module):
    """Embed and head, called with their inputs flat as IREE passes them."""

    def __init__(self, piece: nn.Module) -> None:
        super().__init__()
        self.piece = piece

    def forward(self, *args: Tensor) -> Any:
        return self.piece(*args)


def exportable(piece: nn.Module) -> nn.Module:
    from neuron_buckets.model.pieces import LayerPiece

    return FunctionalLayer(piece) if isinstance(piece, LayerPiece) else FlatPiece(piece)


@dataclass(frozen=True)
class Lowering:
    """One piece's StableHLO module as MLIR bytecode, and what a reader checks without parsing it."""

    bytecode: bytes
    summary: dict[str, Any]


def op_counts(text: str) -> dict[str, int]:
    """How often each StableHLO op occurs in the module's printed form."""
    return dict(sorted(Counter(re.findall(r"\bstablehlo\.([a-z_]+)\b", text)).items()))


def import_stablehlo(program: torch.export.ExportedProgram, size: int) -> Any:
    """``program`` through torch-mlir's FX importer to StableHLO; at a tensor-parallel degree its
    collectives become StableHLO ones over the ranks (``stablehlo_collectives``)."""
    fx = _require("torch_mlir.fx", "torch-mlir")
    from torch_mlir import ir
    from torch_mlir.extras.fx_importer import FxImporter

    from neuron_buckets.backends import stablehlo_collectives as collectives

    context = ir.Context()
    collectives.prepare_context(context)
    importer = FxImporter(context=context, graph_node_importer_cls=collectives.collective_importer(size))
    module = fx.export_and_import(program, output_type="stablehlo", fx_importer=importer)
    if size > 1:
        collectives.mark_replicas(module, size)
    return module


def lower(piece: nn.Module, example: tuple) -> Lowering:
    """``piece`` exported with the golden kernels at ``example``'s static shapes, lowered to StableHLO."""
    from neuron_buckets.kernels import dispatch
    from neuron_buckets.model import linear

    flat = tuple(tree_leaves(example))
    with torch.no_grad(), dispatch.use(dispatch.GOLDEN), linear.portable():
        program = torch.export.export(exportable(piece).eval(), flat)
        module = import_stablehlo(program, piece.tp.size)
    main = module.body.operations[0]
    signature = main.type
    buffer = io.BytesIO()
    module.operation.write_bytecode(buffer)
    text = str(module.operation)
    summary = {
        "arguments": [str(t) for t in signature.inputs],
        "results": [str(t) for t in signature.results],
        "input_shapes": [list(t.shape) for t in flat],
        "ops": op_counts(text),
        **toolchain(),
    }
    return Lowering(buffer.getvalue(), summary)


def to_numpy(t: Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype in _VIA_BITS:
        name, bits, _ = _VIA_BITS[t.dtype]
        return t.view(bits).numpy().view(getattr(_require("ml_dtypes", "ml-dtypes"), name))
    return t.numpy()


def to_torch(a: np.ndarray) -> Tensor:
    for dtype, (name, _, bits) in _VIA_BITS.items():
        if a.dtype.name == name:
            return torch.from_numpy(a.view(bits).copy()).view(dtype)
    return torch.from_numpy(np.array(a))


@functools.lru_cache(maxsize=64)
def iree_vmfb(bytecode: bytes) -> bytes:
    """The StableHLO compiled by IREE for this CPU; kept per process, since artifacts of one model
    share pieces (a prefill bucket's, with and without speculation) and IREE takes seconds each."""
    compiler = _require("iree.compiler", "iree-base-compiler")
    return compiler.compile_str(bytecode, target_backends=[IREE_TARGET], input_type="stablehlo",
                                extra_args=list(IREE_ARGS))


class IreeModule:
    """A piece's StableHLO compiled by IREE for this CPU, called with torch tensors."""

    def __init__(self, bytecode: bytes) -> None:
        runtime = _require("iree.runtime", "iree-base-runtime")
        self.main = runtime.load_vm_flatbuffer(iree_vmfb(bytecode), driver="local-task").main

    def __call__(self, *args: Any) -> tuple[Tensor, ...]:
        out = self.main(*(to_numpy(t) for t in tree_leaves(args)))
        return tuple(to_torch(o.to_host()) for o in (out if isinstance(out, tuple) else (out,)))

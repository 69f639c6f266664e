"""The stablehlo backend: every piece lowered to StableHLO as Neuron's torch-mlir route does, run by IREE.

``compile`` lowers the piece (``stablehlo_lowering.lower``: torch.export with the goldens, then
torch-mlir's FX importer) at the Neuron backend's static shapes (one embed and head per token
count) and writes one graph file: the StableHLO bytecode, its summary, and the ``neuronx-cc``
command line that would turn it into a NEFF on a machine with the Neuron SDK (the same
``[compile] flags`` as the neuron backend, validated and keyed the same way). That command has
not run here: no Neuron SDK is installable on the machines this project is built on.

``load`` compiles the StableHLO with IREE for this CPU and calls it as the runtime calls every
piece; the layer's updated cache slices come back as results and are written into the runtime's
cache, which stays the truth. It is a proof that the StableHLO computes what the model does, not
a serving backend.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from neuron_buckets.backends.base import BackendUnavailable, DenseWeights, GraphFn
from neuron_buckets.backends.eager import EagerGraph, piece_parallel
from neuron_buckets.backends.neuron import NeuronFlags
from neuron_buckets.backends.stablehlo_lowering import IreeModule, lower, package_version, toolchain


def neuronx_cc_command(piece_file: str, flags: dict[str, Any]) -> list[str]:
    """The neuronx-cc command line for one piece's StableHLO: recorded, never run here."""
    neff = piece_file.rsplit(".", 1)[0] + ".neff"
    args = NeuronFlags.from_dict(flags).compiler_args()
    return ["neuronx-cc", "compile", piece_file, "--framework", "XLA", *args, "--output", neff]


class IreeLayer:
    """The layer's IREE module called as the runtime calls every layer piece: the updated cache
    slices it returns are written into the runtime's slices."""

    def __init__(self, module: IreeModule) -> None:
        self.module = module

    def __call__(self, *args: Any) -> Tensor:
        *_, k_slice, v_slice, _weights = args
        out, k_new, v_new = self.module(*args)
        k_slice.copy_(k_new)
        v_slice.copy_(v_new)
        return out


class IreePiece:
    """Embed or head: one result as a tensor, several as a tuple, as the eager piece returns them."""

    def __init__(self, module: IreeModule) -> None:
        self.module = module

    def __call__(self, *args: Any) -> Any:
        out = self.module(*args)
        return out[0] if len(out) == 1 else out


class StableHloBackend(DenseWeights):
    name = "stablehlo"
    graph_ext = "json"  # the bytecode (base64), its summary and the neuronx-cc command line
    dynamic_shapes = False  # the Neuron backend's static pieces
    fresh_layers = False  # the Neuron backend's pieces
    cpu_kernels = False
    # what shapes its graphs, hashed into every key: the lowering, and the neuron flags it records
    source_modules = (__name__, "neuron_buckets.backends.neuron",
                      "neuron_buckets.backends.stablehlo_lowering")

    def available(self) -> tuple[bool, str]:
        try:
            versions = self.versions()
        except BackendUnavailable as exc:
            return False, str(exc)
        return True, ", ".join(f"{k} {v}" for k, v in versions.items())

    def versions(self) -> dict[str, str]:
        compiler = f"torch-mlir {package_version('torch-mlir')}"
        return {**self.load_versions(), **toolchain(), "compiler": compiler}

    def load_versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "iree-base-compiler": package_version("iree-base-compiler"),
                "iree-base-runtime": package_version("iree-base-runtime")}

    def resolved_flags(self, flags: dict[str, Any]) -> dict[str, Any]:
        """The neuron backend's flags: they make the recorded neuronx-cc command line."""
        return NeuronFlags.from_dict(flags).as_dict()

    def compile(
        self, piece: nn.Module, example: tuple, out_file: Path, flags: dict[str, Any], dynamic: tuple | None
    ) -> None:
        lowering = lower(piece, example)
        mlir_name = out_file.with_suffix(".mlirbc").name
        record = {
            "piece": type(piece).__name__,
            "input_shapes": [list(t.shape) for t in tree_leaves(example)],
            "summary": lowering.summary,
            "neuronx_cc": neuronx_cc_command(mlir_name, flags),
            "stablehlo": base64.b64encode(lowering.bytecode).decode(),
            **piece_parallel(piece),
        }
        out_file.write_text(json.dumps(record))

    def load(self, path: Path, model_config: dict[str, Any], device: str) -> GraphFn:
        record = json.loads(path.read_text())
        if (size := record.get("tensor_parallel_size", 1)) > 1:
            raise ValueError(f"{path.name}: a tensor-parallel piece (degree {size}); IREE's CPU drivers "
                             "cannot run its StableHLO collectives, so only neuronx-cc takes it (a TP=1 "
                             "build runs on this CPU)")
        module = IreeModule(base64.b64decode(record["stablehlo"]))
        fn: GraphFn = IreeLayer(module) if record["piece"] == "LayerPiece" else IreePiece(module)
        return EagerGraph(fn, [tuple(s) for s in record["input_shapes"]], path.name)


def stablehlo_of(path: Path) -> bytes:
    """The StableHLO bytecode a graph file of this backend holds."""
    return base64.b64decode(json.loads(path.read_text())["stablehlo"])

"""The xla backend: the Neuron backend's pieces lowered by torch-xla and executed on an XLA device.

It exists to run the Neuron path as far as a machine without the Neuron SDK allows. ``compile``
is the Neuron backend's compile up to the hand-off to neuronx-cc: the same static shapes (one
embed and head per token count), the same traced modules (``neuron.trace_spec``: the layer piece
over the stacked cache as aliased state, the layer an input), lowered by ``xla_lowering.lower``
with the goldens in place of the NKI kernels. A piece that would not lower to one static graph
without host fallbacks is refused, as it would fail or crawl on Neuron. The graph file holds the
HLO and its summary; ``load`` traces the same module again on the XLA device (``PJRT_DEVICE``,
CPU here), which torch-xla compiles once per shape and then reuses.

It is a test bed, not a serving backend: each call moves its inputs (weights included) to the
device and the stacked cache there and back, so that the runtime's host cache stays the truth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from neuron_buckets.backends.base import BackendUnavailable, DenseWeights, GraphFn
from neuron_buckets.backends.eager import EagerGraph, piece_of, piece_parallel
from neuron_buckets.backends.neuron import StackedLayer, layer_input, stacked_of, trace_spec
from neuron_buckets.backends.xla_lowering import (
    lower,
    to_device,
    torch_xla,
    torch_xla_version,
)


class XlaGraph:
    """A module run on the XLA device with the goldens: one graph per call, outputs on the host."""

    def __init__(self, module: nn.Module) -> None:
        self.xla = torch_xla()
        self.device = self.xla.device()
        self.module = module.eval().to(self.device)

    def __call__(self, *args: Any) -> Any:
        from neuron_buckets.kernels import dispatch

        with torch.no_grad(), dispatch.use(dispatch.GOLDEN):
            out = self.module(*to_device(args, self.device))
            self.xla.sync()
        return tree_map(lambda t: t.cpu() if isinstance(t, Tensor) else t, out)


class XlaLayer:
    """The layer graph called as the runtime calls every layer piece (as ``neuron.NeuronLayer``
    is): with one layer's cache slices, views of the stacked caches. The stacked caches go to the
    device as the module's state, the graph updates them in place, and they come back."""

    def __init__(self, graph: XlaGraph) -> None:
        self.graph = graph

    def __call__(self, h: Tensor, cos: Tensor, sin: Tensor, *args: Any) -> Tensor:
        *step, k_slice, v_slice, weights = args
        layer = k_slice.storage_offset() // k_slice.numel()
        k_host, v_host = stacked_of(k_slice), stacked_of(v_slice)
        state = self.graph.module
        state.k_cache.data = k_host.to(self.graph.device)
        state.v_cache.data = v_host.to(self.graph.device)
        out, k_new, v_new = self.graph(layer_input(layer), h, cos, sin, *step, *weights)
        k_host.copy_(k_new)
        v_host.copy_(v_new)
        return out


class XlaBackend(DenseWeights):
    name = "xla"
    graph_ext = "json"  # the HLO module and its summary; load traces the same module again
    dynamic_shapes = False  # the Neuron backend's static pieces
    fresh_layers = False  # the Neuron backend's pieces
    cpu_kernels = False
    # what shapes its graphs, hashed into every key: the Neuron backend's traced modules, the lowering
    source_modules = (__name__, "neuron_buckets.backends.neuron", "neuron_buckets.backends.xla_lowering")

    def available(self) -> tuple[bool, str]:
        try:
            torch_xla()
        except BackendUnavailable as exc:  # its message says what to install
            return False, str(exc)
        return True, f"torch {torch.__version__}, torch-xla {torch_xla_version()}"

    def versions(self) -> dict[str, str]:
        return {**self.load_versions(), "compiler": f"xla (torch-xla {torch_xla_version()})"}

    def load_versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "torch-xla": torch_xla_version()}

    def resolved_flags(self, flags: dict[str, Any]) -> dict[str, Any]:
        if flags:
            raise ValueError(f"compile.flags {sorted(flags)}: the xla backend takes none")
        return {}

    def compile(
        self, piece: nn.Module, example: tuple, out_file: Path, flags: dict[str, Any], dynamic: tuple | None
    ) -> None:
        self.resolved_flags(flags)
        lowering = lower(trace_spec(piece, example))
        if problems := lowering.problems:
            raise ValueError(f"{type(piece).__name__} does not lower as Neuron needs: {'; '.join(problems)}")
        shapes = [list(t.shape) for t in tree_leaves(example)]
        record = {"piece": type(piece).__name__, "input_shapes": shapes, "summary": lowering.summary,
                  "hlo": lowering.hlo, **piece_parallel(piece)}
        out_file.write_text(json.dumps(record))

    def load(self, path: Path, model_config: dict[str, Any], device: str) -> GraphFn:
        from neuron_buckets.model.pieces import LayerPiece

        record = json.loads(path.read_text())
        piece = piece_of(record, model_config)
        if isinstance(piece, LayerPiece):  # the state is the runtime's cache, placed at each call
            fn: GraphFn = XlaLayer(XlaGraph(StackedLayer(piece, torch.empty(0), torch.empty(0))))
        else:
            fn = XlaGraph(piece)
        return EagerGraph(fn, [tuple(s) for s in record["input_shapes"]], path.name)

"""The protocol every backend implements: whether it runs here, its versions and resolved flags,
compile a piece's graph, load it, and lay out the weights its graphs read.

The build plan records ``versions`` and ``resolved_flags`` in the manifest (and in every cache
key); the compiler drives ``compile`` in worker processes, once per piece (``model/pieces.py``:
embed, a decoder layer and its fresh twin, head or an embedding artifact's norm). The runtime
refuses graphs built for other ``load_versions`` and loads each graph on first use
(``runtime/piece_graphs.py``); it packs each layer's weights (``pack``) as it reads them, and a
generation artifact's head (``pack_head``, ``runtime/output_head.py``: the norm piece of an
embedding artifact projects nothing); it then calls a graph with the padded call, the caches and
the weights as inputs. Nothing here assumes a particular compiler, file format or device.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor, nn

from neuron_buckets.model.weights import LayerWeights
from neuron_buckets.utils.errors import UserError

GraphFn = Callable[..., Any]


class BackendUnavailable(UserError, RuntimeError):
    """The backend cannot run on this machine; the message says what to install or change."""


class Backend(Protocol):
    """A compiler and its runtime, named in the manifest (``backend.name``)."""

    name: str
    graph_ext: str  # file extension of one bucket's graph, e.g. "pt2"

    def available(self) -> tuple[bool, str]:
        """Whether this backend can compile and run here, and if not, why (an install hint)."""
        ...

    def versions(self) -> dict[str, str]:
        """Compiler and framework versions: recorded in the manifest and hashed into every key.

        ``load_versions()`` plus the build-only ``compiler``.
        """
        ...

    def load_versions(self) -> dict[str, str]:
        """What must equal the build's versions for a graph to load here (no build tools: a
        serving host needs no compiler, and asking for its version can cost seconds)."""
        ...

    def resolved_flags(self, flags: dict[str, Any]) -> dict[str, Any]:
        """``flags`` validated with defaults filled in: what the manifest records and keys hash."""
        ...

    dynamic_shapes: bool  # whether embed and head compile once for every token count
    # whether it compiles the fresh layers of packed buckets: a layer piece over no context
    # (``model/pieces.py``), where ``compile.fresh_layers`` asks for them
    fresh_layers: bool
    # whether its graphs run the model's default torch kernels, whose CPU attention
    # is the C++ op of ``kernels/block_kv_cpu.py`` (the artifact then carries its library)
    cpu_kernels: bool

    def compile(
        self, piece: nn.Module, example: tuple, out_file: Path, flags: dict[str, Any], dynamic: tuple | None
    ) -> None:
        """Compile ``piece`` for the shapes of ``example`` (``dynamic``: torch.export's dynamic
        dimensions, or None for all static) and write the graph to ``out_file``."""
        ...

    def pack(self, layer: LayerWeights) -> LayerWeights:
        """One layer's weights in the layout this backend's graphs read (the same record for
        most): the runtime applies it to each layer as it loads the weights."""
        ...

    def pack_head(self, weight: Tensor) -> Tensor:
        """The head's output projection in the layout its graph reads; a tied embedding keeps its
        dense tensor for the embed piece beside it."""
        ...

    def load(self, path: Path, model_config: dict[str, Any], device: str) -> GraphFn:
        """Load one piece's graph. It is called with the piece's inputs, weights included, as
        positional arguments (the weights tuple flattened last), and returns its outputs."""
        ...


class DenseWeights:
    """For a backend whose graphs take the checkpoint's dense tensors as they load: nothing to
    pack (eager, the lowered Neuron, XLA and StableHLO graphs)."""

    def pack(self, layer: LayerWeights) -> LayerWeights:
        return layer

    def pack_head(self, weight: Tensor) -> Tensor:
        return weight

"""The Neuron backend: one NEFF per piece via ``torch_neuronx.trace``, with the NKI kernels inside.

Written against the public torch-neuronx (XLA-based ``trace`` API) and NKI 0.3 APIs of Neuron SDK
2.29+; the SDK cannot be installed on the machines this project is built on, so none of this has
run on Neuron hardware. Without the SDK, ``available()`` says what to install and ``compile`` and
``load`` raise ``BackendUnavailable`` with the same message; nothing is emulated.

Pieces have static shapes here (``dynamic_shapes = False``: one embed and head per token count).
Weights are ordinary inputs of every call, so one layer NEFF serves every layer. The layer piece
runs with the NKI kernels swapped in for the goldens (``dispatch.use``) and holds the whole
stacked KV cache as module state aliased to outputs 1 and 2 (``input_output_aliases``: torch_neuronx
aliases only module state, and then updates it in device memory rather than copying it). The
layer to work on is an input: its slots and block ids are offset into the flattened
(layers * blocks) cache, so no call copies a layer out and back. A quantized layer takes its
projections as the checkpoint stores them (int8, float8) and their scales as inputs, as NxD
Inference does, and dequantizes them in the graph (``pack`` keeps them so).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from importlib import import_module, metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from neuron_buckets.backends.base import BackendUnavailable, DenseWeights, GraphFn
from neuron_buckets.model.weights import LayerWeights

INSTALL_HINT = (
    "install the AWS Neuron SDK 2.29 or later (on a Trn/Inf instance or the Neuron DLAMI): "
    "pip install torch-neuronx neuronx-cc nki --extra-index-url https://pip.repos.neuron.amazonaws.com"
)
SDK_MODULES = ("torch_neuronx", "nki")  # the tracer/compiler driver, and the NKI kernel compiler
SDK_PACKAGES = ("torch-neuronx", "neuronx-cc", "nki", "torch-xla")
TARGETS = ("trn1", "trn1n", "inf2", "trn2", "trn3")
LNC2_TARGETS = ("trn2", "trn3")  # logical NeuronCores of two physical cores exist from Trainium2
AUTO_CAST = ("none", "matmult", "all")


@dataclass(frozen=True)
class NeuronFlags:
    """The neuronx-cc options that shape a bucket's NEFF; all of them go into manifest and key."""

    target: str = "trn1"
    optlevel: int = 2
    lnc: int = 1
    auto_cast: str = "none"  # keep the model's dtypes: the goldens are the numerical reference
    model_type: str = "transformer"
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, flags: dict[str, Any]) -> NeuronFlags:
        """Validate ``[compile] flags`` for the neuron backend; defaults fill missing keys."""
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(flags) - known):
            raise ValueError(f"unknown neuron compile flags {unknown}; allowed: {sorted(known)}")
        out = cls(**{**flags, "extra_args": tuple(flags.get("extra_args", ()))})
        if out.target not in TARGETS:
            raise ValueError(f"flags.target={out.target!r}; allowed: {list(TARGETS)}")
        if out.optlevel not in (1, 2, 3):
            raise ValueError(f"flags.optlevel={out.optlevel!r}; allowed: 1, 2, 3")
        if out.lnc not in (1, 2) or (out.lnc == 2 and out.target not in LNC2_TARGETS):
            raise ValueError(
                f"flags.lnc={out.lnc!r} with target {out.target!r}; allowed: 1, or 2 on {list(LNC2_TARGETS)}"
            )
        if out.auto_cast not in AUTO_CAST:
            raise ValueError(f"flags.auto_cast={out.auto_cast!r}; allowed: {list(AUTO_CAST)}")
        if not all(isinstance(a, str) for a in out.extra_args):
            raise ValueError(f"flags.extra_args must be strings, got {list(out.extra_args)}")
        return out

    def compiler_args(self) -> list[str]:
        """The neuronx-cc command line these flags stand for."""
        return [
            "--target", self.target,
            "--optlevel", str(self.optlevel),
            "--logical-nc-config", str(self.lnc),
            "--auto-cast", self.auto_cast,
            "--model-type", self.model_type,
            *self.extra_args,
        ]  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, defaults filled in: what the manifest records and the key hashes."""
        return {**asdict(self), "extra_args": list(self.extra_args)}


def _import_error(module: str) -> str:
    """Empty if ``module`` imports, else the ImportError's text (placeholder wheels raise one)."""
    try:
        import_module(module)
    except ImportError as exc:
        return f"{module}: {exc}"
    return ""


def _sdk() -> Any:
    """``torch_neuronx`` with ``nki`` importable, or BackendUnavailable naming what to install."""
    if errors := [e for e in map(_import_error, SDK_MODULES) if e]:
        raise BackendUnavailable(f"Neuron SDK not importable ({'; '.join(errors)}); {INSTALL_HINT}")
    return import_module("torch_neuronx")


def neuron_device_present() -> bool:
    """Whether this machine exposes a Neuron device (the driver creates /dev/neuron0 and up)."""
    return Path("/dev/neuron0").exists()


def core_index(device: str) -> int:
    """NeuronCore index of ``'neuron'`` (0) or ``'neuron:N'``; anything else is an error."""
    kind, _, index = device.partition(":")
    if kind != "neuron" or not (index == "" or index.isdigit()):
        raise ValueError(f"neuron graphs run on a NeuronCore: device 'neuron' or 'neuron:N', got {device!r}")
    return int(index or 0)


def offset_to_layer(
    layer: Tensor, slot_mapping: Tensor, block_table: Tensor, num_blocks: int, block_size: int
) -> tuple[Tensor, Tensor]:
    """Slots and block ids of one layer in the stacked cache flattened to (L * NB, BS, KVH, D);
    pads (-1) stay -1."""
    slots = torch.where(slot_mapping >= 0, slot_mapping + layer * (num_blocks * block_size), -1)
    table = torch.where(block_table >= 0, block_table + layer * num_blocks, -1)
    return slots, table


class StackedLayer(nn.Module):
    """The layer piece over the stacked KV caches held as state and returned as outputs 1 and 2."""

    def __init__(self, piece: nn.Module, k_cache: Tensor, v_cache: Tensor) -> None:
        super().__init__()
        self.piece = piece
        self.k_cache = nn.Parameter(k_cache, requires_grad=False)
        self.v_cache = nn.Parameter(v_cache, requires_grad=False)

    def forward(self, layer: Tensor, h: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor,
                block_table: Tensor, cache_lens: Tensor, segment_ids: Tensor, *weights: Tensor) -> tuple:
        num_blocks, block_size = self.k_cache.shape[1:3]
        slots, table = offset_to_layer(layer, slot_mapping, block_table, num_blocks, block_size)
        k, v = (c.flatten(0, 1) for c in (self.k_cache, self.v_cache))
        out = self.piece(h, cos, sin, slots, table, cache_lens, segment_ids, k, v, weights)
        return out, self.k_cache, self.v_cache

    def aliases(self) -> dict[Tensor, int]:
        """``input_output_aliases`` of ``torch_neuronx.trace``: state tensor -> output index."""
        return {self.k_cache: 1, self.v_cache: 2}


@dataclass(frozen=True)
class TraceSpec:
    """What ``torch_neuronx.trace`` is given for one piece: the module, its example inputs and the
    aliases of its state. The XLA lowering (``backends/xla_lowering.py``) lowers the same."""

    module: nn.Module
    inputs: tuple
    aliases: dict[Tensor, int]


def layer_input(layer: int) -> Tensor:
    """The layer index as the layer graph takes it: shape (1,), never a 0-d tensor, which torch-xla
    folds into a constant when it is 0 or 1 (its "special scalars"), so that a graph traced with
    layer 0 would ignore its layer input and work on layer 0 whatever it is given."""
    return torch.tensor([layer])


def trace_spec(piece: nn.Module, example: tuple) -> TraceSpec:
    """The layer piece as a ``StackedLayer`` over a stacked cache of the model's depth, called with
    the layer index first and the weights flattened; embed and head as they are."""
    from neuron_buckets.model.pieces import LayerPiece

    if not isinstance(piece, LayerPiece):
        return TraceSpec(piece.eval(), example, {})
    *step, k_cache, v_cache, weights = example
    weights = LayerWeights.of(piece.config, weights).stored().tensors()  # float8 stays float8 on device
    layers = piece.config.num_layers
    module = StackedLayer(piece, k_cache.expand(layers, *k_cache.shape).clone(),
                          v_cache.expand(layers, *v_cache.shape).clone()).eval()
    return TraceSpec(module, (layer_input(0), *step, *weights), module.aliases())


class _SharedCache:
    """Keeps one logical KV cache across layer NEFFs that each hold their own device copy.

    The NEFF last run holds the newest cache on device. When another runs, the newest cache
    comes back to the runtime's host tensors and is placed into that NEFF's state first; the L
    calls of one step stay on one NEFF and copy nothing.
    """

    def __init__(self) -> None:
        self.holder: NeuronLayer | None = None
        self.newest: tuple[Tensor, Tensor] | None = None

    def hand_to(self, graph: NeuronLayer, k_cache: Tensor, v_cache: Tensor) -> None:
        if self.holder is graph:
            return
        if self.newest is not None:
            k_cache.copy_(self.newest[0])
            v_cache.copy_(self.newest[1])
        graph.sdk.replace_weights(graph.traced, {"k_cache": k_cache, "v_cache": v_cache})
        self.holder = graph


def stacked_of(layer_slice: Tensor) -> Tensor:
    """The stacked (L, NB, BS, KVH, D) cache that a contiguous layer slice is a view of."""
    layers = layer_slice.untyped_storage().nbytes() // (layer_slice.numel() * layer_slice.element_size())
    shape = (layers, *layer_slice.shape)
    return layer_slice.new_empty(0).set_(layer_slice.untyped_storage(), 0, shape)


class NeuronLayer:
    """One loaded layer NEFF, called as the runtime calls every layer piece: with one layer's
    cache slices, which are views of the stacked caches (the layer is their position in them)."""

    def __init__(self, sdk: Any, traced: Any, shared: _SharedCache) -> None:
        self.sdk, self.traced, self.shared = sdk, traced, shared

    def __call__(self, h: Tensor, cos: Tensor, sin: Tensor, *args: Any) -> Tensor:
        *step, k_slice, v_slice, weights = args
        layer = k_slice.storage_offset() // k_slice.numel()
        self.shared.hand_to(self, stacked_of(k_slice), stacked_of(v_slice))
        out, k_new, v_new = self.traced(layer_input(layer), h, cos, sin, *step, *weights)
        self.shared.newest = (k_new, v_new)
        return out


class NeuronBackend(DenseWeights):
    name = "neuron"
    graph_ext = "pt"  # a TorchScript archive around the NEFF, as torch.jit.save writes it
    dynamic_shapes = False  # a NEFF has static shapes
    fresh_layers = False  # not yet: one more NEFF per token bucket, and its kernels have not run
    cpu_kernels = False

    def __init__(self) -> None:
        self._shared = _SharedCache()  # one KV cache for every graph this backend loads

    def available(self) -> tuple[bool, str]:
        if errors := [e for e in map(_import_error, SDK_MODULES) if e]:
            return False, f"{'; '.join(errors)}; {INSTALL_HINT}"
        where = "a Neuron device" if neuron_device_present() else "no Neuron device (compile only)"
        return True, f"torch-neuronx {self.versions()['torch-neuronx']}, {where}"

    def versions(self) -> dict[str, str]:
        out = self.load_versions()
        return {**out, "compiler": f"neuronx-cc {out['neuronx-cc']}"}

    def load_versions(self) -> dict[str, str]:
        out = {"torch": torch.__version__}
        for package in SDK_PACKAGES:
            try:
                out[package] = metadata.version(package)
            except metadata.PackageNotFoundError:
                out[package] = "not installed"
        return out

    def resolved_flags(self, flags: dict[str, Any]) -> dict[str, Any]:
        """``flags`` validated, defaults filled: what the manifest should record and the key hash."""
        return NeuronFlags.from_dict(flags).as_dict()

    def compile(
        self, piece: nn.Module, example: tuple, out_file: Path, flags: dict[str, Any], dynamic: tuple | None
    ) -> None:
        sdk = _sdk()
        from neuron_buckets.kernels import dispatch, nki_ops

        args = NeuronFlags.from_dict(flags).compiler_args()
        cpu_only = not neuron_device_present()  # compile-only hosts trace on CPU
        trace = dict(compiler_args=args, inline_weights_to_neff=False, cpu_backend=cpu_only)
        with torch.no_grad(), dispatch.use(nki_ops.KERNELS):
            spec = trace_spec(piece, example)
            traced = sdk.trace(spec.module, spec.inputs, input_output_aliases=spec.aliases, **trace)
        sdk.async_load(traced)  # must precede jit.save: loading overlaps across piece graphs
        torch.jit.save(traced, str(out_file))

    def load(self, path: Path, model_config: dict[str, Any], device: str) -> GraphFn:
        sdk = _sdk()
        traced = torch.jit.load(str(path))
        sdk.move_trace_to_device(traced, core_index(device))
        if "k_cache" in dict(traced.named_parameters()):
            return NeuronLayer(sdk, traced, self._shared)
        return traced

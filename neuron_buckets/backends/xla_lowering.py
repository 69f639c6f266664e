"""A piece lowered as ``torch_neuronx.trace`` lowers it, stopping where neuronx-cc would start.

torch-neuronx's trace moves the example inputs and the module's state to an XLA device, runs the
module once (lazily: nothing executes), builds one HLO module of the outputs with torch-xla's
``LoweringContext`` and declares its aliases: state parameter -> output. ``lower`` does the same
with the goldens of ``kernels/block_kv_torch`` in place of the NKI kernels (on XLA those would be
custom calls to kernels that do not exist here), and records what a Neuron compile depends on:
whether the trace stayed one graph (nothing compiled or ran midway), which ops fell back to the
host (torch-xla's ``aten::*`` counters), whether every shape is static, and the aliases resolved
to HLO parameter numbers. The HLO is the ``HloModuleProto`` as JSON, aliases included.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from neuron_buckets.backends.base import BackendUnavailable
from neuron_buckets.backends.neuron import TraceSpec

XLA_INSTALL_HINT = (
    "pip install torch==2.9.0 torch-xla==2.9.0 (`make test-xla` builds such a virtualenv); "
    "PJRT_DEVICE=CPU runs its graphs on the CPU"
)


def torch_xla_version() -> str:
    try:
        return metadata.version("torch-xla")
    except metadata.PackageNotFoundError:
        return "not installed"


def torch_xla() -> Any:
    """The ``torch_xla`` module, or BackendUnavailable saying what to install."""
    try:
        import torch_xla as module
        import torch_xla.debug.metrics  # noqa: F401  (the counters ``lower`` reads)
    except ImportError as exc:
        raise BackendUnavailable(f"torch-xla not importable ({exc}); {XLA_INSTALL_HINT}") from None
    return module


def to_device(tree: Any, device: Any) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, tree)


@dataclass(frozen=True)
class Lowering:
    """One piece's HLO module (``HloModuleProto`` JSON, declared aliases included) and its summary."""

    hlo: dict[str, Any]
    summary: dict[str, Any]

    @property
    def problems(self) -> list[str]:
        """Why this piece would fail or crawl on Neuron; empty when it lowers cleanly."""
        s = self.summary
        out = []
        if s["graphs"] != 1:
            out.append(f"the trace ran {s['graphs']} graphs, not one (something synced midway)")
        if s["host_fallbacks"]:
            out.append(f"ops fell back to the host: {s['host_fallbacks']}")
        if not s["static"]:
            out.append("some shape is dynamic")
        return out


def shape_text(shape: dict[str, Any]) -> str:
    """``f32[2,4]``, as HLO text writes a shape (tuples in parentheses)."""
    if shape["elementType"] == "TUPLE":
        return "(" + ", ".join(map(shape_text, shape.get("tupleShapes", []))) + ")"
    return f"{shape['elementType'].lower()}[{','.join(shape.get('dimensions', []))}]"


def is_static(shape: dict[str, Any]) -> bool:
    return not any(shape.get("isDynamicDimension", [])) and all(map(is_static, shape.get("tupleShapes", [])))


def entry_computation(hlo: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in hlo["computations"] if c["id"] == hlo["entryComputationId"])


def lower(spec: TraceSpec) -> Lowering:
    """Lower ``spec`` on the XLA device (``spec.module`` moves there) with the golden kernels."""
    xla = torch_xla()
    from torch_xla.debug import metrics

    from neuron_buckets.kernels import dispatch

    device = xla.device()
    xla.sync()  # nothing pending from before may join this graph
    metrics.clear_all()
    handle = xla._XLAC._get_tensors_handle
    # By name, as torch-neuronx finds them: moving a module to XLA replaces its Parameter objects.
    named = {name: spec.aliases[p] for name, p in spec.module.named_parameters() if p in spec.aliases}
    with torch.no_grad(), dispatch.use(dispatch.GOLDEN):
        module = spec.module.to(device)
        inputs = to_device(spec.inputs, device)
        params = dict(module.named_parameters())
        state = {handle([params[name]])[0]: out for name, out in named.items()}  # before it mutates them
        outputs = module(*inputs)
    context = xla._XLAC.lowering.LoweringContext()
    context.build(tree_leaves(outputs))
    by_handle = {handle([t])[0]: i for i, t in context.device_parameter_id_tensor_mapping().items()}
    aliases = {out: by_handle[h] for h, out in state.items()}
    hlo = json.loads(context.hlo_json())
    hlo["inputOutputAlias"] = {"entries": [
        {"outputShapeIndex": [str(out)], "parameterNumber": str(param), "kind": "MUST_ALIAS"}
        for out, param in sorted(aliases.items())
    ]}  # fmt: skip
    program = hlo["hostProgramShape"]
    entry = entry_computation(hlo)
    synced = sum(metrics.counter_value(n) or 0 for n in ("UncachedCompile", "CachedCompile"))
    summary = {
        "graphs": 1 + synced,
        "host_fallbacks": sorted({n for n in metrics.counter_names() if n.startswith("aten::")}
                                 | set(metrics.executed_fallback_ops())),
        "static": is_static(program["result"]) and all(map(is_static, program["parameters"]))
        and all(is_static(i["shape"]) for i in entry["instructions"]),
        "parameters": [shape_text(p) for p in program["parameters"]],
        "outputs": [shape_text(s) for s in program["result"].get("tupleShapes", [program["result"]])],
        "input_shapes": [list(t.shape) for t in tree_leaves(spec.inputs)],  # as traced: layer index first
        "inputs": [context.tensor_parameter_id(t) for t in tree_leaves(inputs)],  # parameters; -1: unused
        "aliases": {str(out): param for out, param in sorted(aliases.items())},
        "ops": dict(sorted(Counter(i["opcode"] for i in entry["instructions"]).items())),
        "torch": torch.__version__,
        "torch-xla": torch_xla_version(),
    }
    return Lowering(hlo, summary)

"""A tensor-parallel piece's collectives imported as StableHLO collectives over the replicas of its degree.

torch-mlir's FX importer has no lowering of torch's functional collectives (``_c10d_functional``,
which ``model/tp/tensor_parallel.py`` calls): they import as ``torch.operator`` and fail its backend
pipeline. So ``collective_importer`` gives the FX importer a node importer that emits, for each
``all_reduce`` and ``all_gather_into_tensor`` node, the StableHLO collective itself (built by the
MLIR Python bindings that ship with torch-mlir), bridged to the torch dialect by torch-mlir's own
``torch_c`` casts, which its pipeline folds away; ``wait_tensor`` is the identity (StableHLO's
collectives return their result). Each collective has one replica group of every rank,
``[[0, ..., n-1]]``, and the module says ``mhlo.num_replicas = n``, ``mhlo.num_partitions = 1``:
cross-replica collectives, as torch-xla lowers them for Neuron.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.fx import Node
from torch_mlir import ir
from torch_mlir._mlir_libs import _stablehlo
from torch_mlir.dialects import torch as torch_d
from torch_mlir.extras.fx_importer import GraphNodeImporter
from torch_mlir.passmanager import PassManager

_ops = torch.ops._c10d_functional
# torch's reduce op name -> the StableHLO op of the all-reduce's reduction region
REDUCTIONS = {"sum": "stablehlo.add"}


def prepare_context(context: Any) -> None:
    """Load the dialects the collectives need: torch-mlir's Python bindings register only the torch
    dialect, so StableHLO is registered from the bindings torch-mlir ships, and ``torch_c`` is loaded
    by running one of torch-mlir's passes that depends on it on an empty module."""
    torch_d.register_dialect(context)
    _stablehlo.register_dialect(context)
    with context, ir.Location.unknown():
        PassManager.parse("builtin.module(torch-func-backend-type-conversion)").run(ir.Module.create().operation)


def mark_replicas(module: Any, size: int) -> None:
    """Record the degree on the module as XLA's and IREE's collective lowerings read it."""
    with module.context:
        i32 = ir.IntegerType.get_signless(32)
        module.operation.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, size)
        module.operation.attributes["mhlo.num_partitions"] = ir.IntegerAttr.get(i32, 1)


def collective_importer(size: int) -> type:
    """torch-mlir's FX node importer, with torch's functional collectives emitted as StableHLO ones
    over one replica group of ``size`` ranks."""
    class CollectiveImporter(GraphNodeImporter):
        __slots__ = ()

        def _import_torch_op_overload(self, loc: Any, node: Node, concrete_target: Any = None) -> None:
            if node.target == _ops.wait_tensor.default:
                self.bind_node_value(node, self.resolve_node_value(node.args[0]))
            elif node.target in (_ops.all_reduce.default, _ops.all_gather_into_tensor.default):
                with loc:
                    self.bind_node_value(node, self._collective(node))
            else:
                super()._import_torch_op_overload(loc, node, concrete_target)

        def _builtin(self, node: Node) -> Any:
            val = node.meta["val"]
            if not val.dtype.is_floating_point:
                raise ValueError(f"{node.name}: a collective of {val.dtype}; the pieces reduce floats only")
            return ir.RankedTensorType.get(list(val.shape), self._cc.dtype_to_type(val.dtype))

        def _collective(self, node: Node) -> Any:
            source = node.args[0]
            operand = ir.Operation.create("torch_c.to_builtin_tensor", results=[self._builtin(source)],
                                          operands=[self.resolve_node_value(source)]).result
            groups = ir.DenseIntElementsAttr.get(np.arange(size, dtype=np.int64).reshape(1, size))
            result = self._builtin(node)
            if node.target == _ops.all_reduce.default:
                op = ir.Operation.create("stablehlo.all_reduce", results=[result], operands=[operand],
                                         attributes={"replica_groups": groups}, regions=1)
                self._reduction(op, result.element_type, node.args[1])
            else:
                dim = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 0)
                op = ir.Operation.create("stablehlo.all_gather", results=[result], operands=[operand],
                                         attributes={"replica_groups": groups, "all_gather_dim": dim})
            back = self._cc.node_val_to_type(node)
            return ir.Operation.create("torch_c.from_builtin_tensor", results=[back],
                                       operands=[op.result]).result

        @staticmethod
        def _reduction(op: Any, element: Any, reduce_op: str) -> None:
            if reduce_op not in REDUCTIONS:
                raise ValueError(f"all_reduce {reduce_op!r}: only {', '.join(REDUCTIONS)} lowers here")
            scalar = ir.RankedTensorType.get([], element)
            block = op.regions[0].blocks.append(scalar, scalar)
            with ir.InsertionPoint(block):
                total = ir.Operation.create(REDUCTIONS[reduce_op], results=[scalar],
                                            operands=list(block.arguments))
                ir.Operation.create("stablehlo.return", operands=[total.result])

    return CollectiveImporter

"""The eager backend: compiles nothing and runs the PyTorch model as is.

It is the reference ``nb verify`` compares compiled graphs against, and the quickest way to try a
config. Its "graph" file records the bucket's input shapes so that it refuses a mis-padded step
exactly as a compiled fixed-shape graph would.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from neuron_buckets.backends.base import DenseWeights, GraphFn


class EagerBackend(DenseWeights):
    name = "eager"
    graph_ext = "json"
    dynamic_shapes = True
    fresh_layers = True
    cpu_kernels = True

    def available(self) -> tuple[bool, str]:
        return True, f"torch {torch.__version__}"

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "compiler": "none"}

    def load_versions(self) -> dict[str, str]:
        return {}  # the "graph" is a shape list; any torch runs the model

    def resolved_flags(self, flags: dict[str, Any]) -> dict[str, Any]:
        return dict(flags)  # nothing is compiled, so flags change nothing but the key

    def compile(
        self, piece: nn.Module, example: tuple, out_file: Path, flags: dict[str, Any], dynamic: tuple | None
    ) -> None:
        shapes = None if dynamic else [list(t.shape) for t in tree_leaves(example)]
        record = {"piece": type(piece).__name__, "input_shapes": shapes, **piece_parallel(piece),
                  **piece_lora(piece)}
        out_file.write_text(json.dumps(record))

    def load(self, path: Path, model_config: dict[str, Any], device: str) -> GraphFn:
        spec = json.loads(path.read_text())
        piece = piece_of(spec, model_config)
        shapes = spec["input_shapes"]
        return EagerGraph(piece, shapes and [tuple(s) for s in shapes], path.name)


def piece_parallel(piece: nn.Module) -> dict[str, int]:
    """What a graph file records of its piece's tensor-parallel degree (nothing at 1)."""
    size = piece.tp.size
    return {"tensor_parallel_size": size} if size > 1 else {}


def piece_lora(piece: nn.Module) -> dict[str, Any]:
    """What a graph file records of a layer piece's LoRA slots (nothing without)."""
    shape = getattr(piece, "lora", None)
    return {"piece": "layer", "lora": asdict(shape)} if shape is not None else {}


def piece_of(record: dict[str, Any], model_config: dict[str, Any]) -> nn.Module:
    """The piece a graph file of ``piece_parallel``'s record names, built again for the model."""
    from neuron_buckets.model.lora import LoraShape, adapt
    from neuron_buckets.model.model_config import LlamaConfig
    from neuron_buckets.model.pieces import build_piece
    from neuron_buckets.model.tp.tensor_parallel import TensorParallel

    tp = TensorParallel(record.get("tensor_parallel_size", 1))
    piece = build_piece(record["piece"], LlamaConfig.from_hf(model_config), tp)
    lora = record.get("lora")
    return adapt(piece, lora and LoraShape(lora["max_loras"], lora["max_rank"], tuple(lora["targets"])))


class EagerGraph:
    """A piece (or any graph) behind a fixed-shape front, so a mis-padded step fails as on a
    compiled graph."""

    def __init__(self, piece: GraphFn, shapes: list[tuple[int, ...]] | None, name: str) -> None:
        self.piece, self.shapes, self.name = piece, shapes, name

    @torch.no_grad()
    def __call__(self, *args: Any) -> Any:
        got = [tuple(t.shape) for t in tree_leaves(args)]
        if self.shapes is not None and got != self.shapes:
            raise ValueError(f"{self.name}: inputs {got} do not match the bucket's shapes {self.shapes}")
        return self.piece(*args)

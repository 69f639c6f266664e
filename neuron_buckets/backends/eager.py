"""The eager backend: compiles nothing and runs the PyTorch model as is.

It is the reference ``nb verify`` compares compiled graphs against, and the quickest way to try a
config. Its "graph" file records the bucket's input shapes so that it refuses a mis-padded step
exactly as a compiled fixed-shape graph would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from neuron_buckets.backends.base import GraphFn


class EagerBackend:
    name = "eager"
    graph_ext = "json"

    def available(self) -> tuple[bool, str]:
        return True, f"torch {torch.__version__}"

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "compiler": "none"}

    def load_versions(self) -> dict[str, str]:
        return {}  # the "graph" is a shape list; any torch runs the model

    def resolved_flags(self, flags: dict[str, Any]) -> dict[str, Any]:
        return dict(flags)  # nothing is compiled, so flags change nothing but the key

    def compile(
        self, model: nn.Module, example: tuple[Tensor, ...], out_file: Path, flags: dict[str, Any]
    ) -> None:
        out_file.write_text(json.dumps({"input_shapes": [list(t.shape) for t in example]}))

    def load(
        self, path: Path, weights: dict[str, Tensor], model_config: dict[str, Any], device: str
    ) -> GraphFn:
        from neuron_buckets.model.checkpoint import load_weights
        from neuron_buckets.model.llama import Llama, LlamaConfig

        with torch.device("meta"):  # no storage of its own: it uses the shared weights
            model = Llama(LlamaConfig.from_hf(model_config))
        load_weights(model, weights, share=True).eval()
        shapes = [tuple(s) for s in json.loads(path.read_text())["input_shapes"]]
        return EagerGraph(model, shapes, path.name)


class EagerGraph:
    """The model behind a fixed-shape front, so a mis-padded step fails as on a compiled graph."""

    def __init__(self, model: nn.Module, shapes: list[tuple[int, ...]], name: str) -> None:
        self.model, self.shapes, self.name = model, shapes, name

    @torch.no_grad()
    def __call__(self, *args: Tensor) -> Tensor:
        got = [tuple(t.shape) for t in args]
        if got != self.shapes:
            raise ValueError(f"{self.name}: inputs {got} do not match the bucket's shapes {self.shapes}")
        return self.model(*args)

"""``[model]``: which checkpoint the graphs are compiled for, and what the artifact computes.

``task = "embed"`` (vLLM's pooling runner) builds an embedding artifact: prefill buckets only, no
decode graphs, and a final-norm piece over every position in place of the LM head; ``nb serve``
answers ``/v1/embeddings`` with its ``pooling`` of each input's hidden states (the last token's or
the mean of all), L2-normalized unless ``normalize = false``. Neither pooling key shapes a graph:
pooling runs on the host, over the hidden states the graphs return.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.setting import TASKS, check_choice, check_types, setting

POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class ModelSource:
    SECTION: ClassVar[str] = "model"

    # A Hugging Face style directory or a .gguf file; None = the embedded default model. Not a
    # graph setting: the weights are loaded at run time, and the model's config enters every key
    # by its content.
    path: Path | None = setting(None, graph=False)
    # Which buckets and pieces exist (each piece's role is in its key), not what one computes.
    task: str = setting("generate", graph=False)
    pooling: str = setting("last", graph=False, tasks=("embed",))  # an embedding artifact's default pooling
    normalize: bool = setting(True, graph=False, tasks=("embed",))  # L2-normalize pooled embeddings

    def __post_init__(self) -> None:
        if isinstance(self.path, str):
            object.__setattr__(self, "path", Path(self.path))
        elif self.path is not None and not isinstance(self.path, Path):
            raise ConfigError(f"model.path must be a string (a directory or a .gguf file), got {self.path!r}")
        check_types(self)
        check_choice(self, "task", TASKS)
        check_choice(self, "pooling", POOLINGS)

    @property
    def embeds(self) -> bool:
        return self.task == "embed"

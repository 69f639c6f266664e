"""``[model]``: which checkpoint the graphs are compiled for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.setting import setting


@dataclass(frozen=True)
class ModelSource:
    SECTION: ClassVar[str] = "model"

    # A Hugging Face style directory; None = the embedded default model. Not a graph setting: the
    # weights are loaded at run time, and the model's config.json enters every key by its content.
    path: Path | None = setting(None, graph=False)

    def __post_init__(self) -> None:
        if isinstance(self.path, str):
            object.__setattr__(self, "path", Path(self.path))
        elif self.path is not None and not isinstance(self.path, Path):
            raise ConfigError(f"model.path must be a string (a directory), got {self.path!r}")

"""``[model]``: which checkpoint the graphs are compiled for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSource:
    path: Path | None = None  # Hugging Face style directory; None = the embedded default model

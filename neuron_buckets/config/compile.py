"""``[compile]``: which backend builds the graphs, where, and how many at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("inductor", "eager", "neuron")


@dataclass(frozen=True)
class CompileConfig:
    backend: str = "inductor"
    jobs: int = 1
    device: str = "cpu"
    flags: dict[str, Any] = field(default_factory=dict)

"""``[compile]``: which backend builds the graphs, where, and how many at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("inductor", "eager", "neuron", "xla")
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class CompileConfig:
    backend: str = "inductor"
    jobs: int = 1  # local worker processes
    device: str = "cpu"
    flags: dict[str, Any] = field(default_factory=dict)
    executor: str = "local"  # "local" worker processes, or "ray" tasks on a cluster
    task_cpus: int = 1  # CPUs each Ray task declares (and torch threads it uses)
    retries: int = 2  # times a piece whose worker or node died is compiled again

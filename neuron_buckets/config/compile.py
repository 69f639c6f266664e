"""``[compile]``: which backend builds the graphs, where, and how many at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.setting import check_choice, check_positive, check_types, setting

BACKENDS = ("inductor", "eager", "neuron", "xla", "stablehlo")
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class CompileConfig:
    SECTION: ClassVar[str] = "compile"

    backend: str = setting("inductor", graph=True)
    jobs: int = setting(1, graph=False)  # local worker processes
    device: str = setting("cpu", graph=True)
    flags: dict[str, Any] = setting(graph=True, factory=dict)  # keyed as the backend resolves them
    executor: str = setting("local", graph=False)  # "local" worker processes, or "ray" tasks on a cluster
    task_cpus: int = setting(1, graph=False)  # CPUs each Ray task declares (and torch threads it uses)
    retries: int = setting(2, graph=False)  # times a piece whose worker or node died is compiled again
    # packed prefill buckets also get a layer piece over no context, for calls with nothing cached
    # (where the backend has them: inductor, eager); unset: only where attention reads the whole
    # block table (flex), not on a CPU, whose C++ attention reads each context alone
    fresh_layers: bool | None = setting(None, graph=False)

    def __post_init__(self) -> None:
        check_types(self)
        if self.fresh_layers is not None and not isinstance(self.fresh_layers, bool):  # 1 == True
            raise ConfigError(f"compile.fresh_layers must be true or false, got {self.fresh_layers!r}")
        check_choice(self, "backend", BACKENDS)
        check_choice(self, "executor", EXECUTORS)
        check_positive(self, "jobs", "task_cpus")

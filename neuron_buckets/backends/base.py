"""The one small protocol every backend implements: compile a bucket's graph, load it, say versions.

The compiler drives ``compile`` in worker processes; the runtime calls ``load`` with the shared
weights. Nothing here assumes a particular compiler, file format or device.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor, nn

from neuron_buckets.core.errors import UserError

GraphFn = Callable[..., Tensor]


class BackendUnavailable(UserError, RuntimeError):
    """The backend cannot run on this machine; the message says what to install or change."""


class Backend(Protocol):
    name: str
    graph_ext: str  # file extension of one bucket's graph, e.g. "pt2"

    def available(self) -> tuple[bool, str]:
        """Whether this backend can compile and run here, and if not, why (an install hint)."""
        ...

    def versions(self) -> dict[str, str]:
        """Compiler and framework versions: recorded in the manifest and hashed into every key.

        ``load_versions()`` plus the build-only ``compiler``.
        """
        ...

    def load_versions(self) -> dict[str, str]:
        """What must equal the build's versions for a graph to load here (no build tools: a
        serving host needs no compiler, and asking for its version can cost seconds)."""
        ...

    def resolved_flags(self, flags: dict[str, Any]) -> dict[str, Any]:
        """``flags`` validated with defaults filled in: what the manifest records and keys hash."""
        ...

    def compile(
        self, model: nn.Module, example: tuple[Tensor, ...], out_file: Path, flags: dict[str, Any]
    ) -> None:
        """Compile ``model`` for the exact shapes of ``example`` and write the graph to ``out_file``."""
        ...

    def load(
        self, path: Path, weights: dict[str, Tensor], model_config: dict[str, Any], device: str
    ) -> GraphFn:
        """Load one graph; ``weights`` is shared by every graph and must not be copied per graph."""
        ...

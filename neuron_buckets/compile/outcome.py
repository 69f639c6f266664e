"""One piece's result, as it goes into the manifest: built, reused or failed, and what it cost."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from neuron_buckets.model.pieces import PieceShape


@dataclass
class Outcome:
    shape: PieceShape
    key: str
    status: str = "ok"
    compile_seconds: float = 0.0
    cached: bool = False
    error: str | None = None
    log: str | None = None
    sha256: str | None = None  # of the placed graph, hashed once: the manifest is rewritten often
    attempts: int = 0  # times handed to a worker

    @property
    def name(self) -> str:
        return self.shape.name


# Told of each event of a compile: "queued", "done", "retry" or "damaged" (``Compiler.run``).
Notify = Callable[[str, Outcome], None]

"""The rolling trace of what a server served, in the JSONL that ``nb plan``, ``nb inspect`` and
``nb replan`` read.

One record per finished request: its arrival (``timestamp``, milliseconds since the epoch, as a
Mooncake trace's), its prompt tokens (``input_length``), the prompt tokens its first admission
found in the prefix cache (``cached_tokens``: what its prefill did not compute) and its output
tokens (``output_length``). Never text or token ids: the trace may be handed to whoever plans
the buckets. It holds the last ``capacity`` requests, so a server that runs for months holds a
bounded window of its recent traffic, which is what a re-plan should fit.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from neuron_buckets.utils.files import atomic_write

TRACE_CAPACITY = 100_000  # requests kept: a few MB of JSONL


@dataclass(frozen=True)
class ServedRequest:
    arrival_ms: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    def to_json(self) -> dict[str, float | int]:
        return {"timestamp": round(self.arrival_ms, 3), "input_length": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_length": self.output_tokens}


class TraceRecorder:
    """Written by the engine thread, read by any (a route, the re-plan timer, shutdown)."""

    def __init__(self, capacity: int = TRACE_CAPACITY) -> None:
        self._records: deque[ServedRequest] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.served = 0  # requests recorded since start, the ones rolled out of the window too

    def add(self, record: ServedRequest) -> None:
        with self._lock:
            self._records.append(record)
            self.served += 1

    def __len__(self) -> int:
        return len(self._records)

    def jsonl(self) -> str:
        """The trace as JSONL, oldest first ('' with nothing served yet)."""
        with self._lock:
            records = list(self._records)
        return "".join(json.dumps(r.to_json()) + "\n" for r in records)

    def write(self, path: Path) -> int:
        """Write the trace to ``path`` atomically (a reader never sees half of it); its requests."""
        text = self.jsonl()
        atomic_write(Path(path), lambda p: p.write_text(text))
        return text.count("\n")

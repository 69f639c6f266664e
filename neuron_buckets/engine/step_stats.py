"""The engine's own count of its steps and their time: what a server's overhead is measured by.

Counted inside ``LLMEngine.step``, so a server and an in-process loop over the same requests read
the same clock at the same points: ``nb:engine_*`` in ``/metrics``, and
``bench/bench_serve_overhead.py``, which compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    steps: int = 0  # steps that ran a plan (a step with only aborts to report runs none)
    seconds: float = 0.0  # wall seconds in those steps: planning, graph calls, sampling, outputs
    graph_seconds: float = 0.0  # of which inside the runtime's ``run_plan``
    grammar_masks: int = 0  # logits rows masked by a request's grammar (structured outputs)
    grammar_seconds: float = 0.0  # host seconds filling and applying those masks

    def add(self, seconds: float, graph_seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.graph_seconds += graph_seconds

    def add_masks(self, rows: int, seconds: float) -> None:
        self.grammar_masks += rows
        self.grammar_seconds += seconds

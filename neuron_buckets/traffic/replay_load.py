"""How a replay's requests reach the scheduler: the client side of ``nb inspect``'s runtime replay.

A client adds requests to the engine between steps, so the replay adds them to the scheduler's
waiting queue between steps too:

- by default every request at once (``generate`` with every prompt);
- ``concurrency`` N: a closed loop, as load generators such as ``vllm bench serve`` run it. N
  requests are in flight (waiting or running); as one finishes, the next in trace order is added
  before the next step;
- ``arrivals``: each request joins when the replayed clock has passed its arrival. With a
  concurrency as well, at most N are in flight and the others queue in the client.

The replayed clock is a step-time model, kept simple on purpose: a step costs ``step_s`` plus
``token_s`` per token its plan computes (prefill chunks and decode rows). Real tokens, not padded
ones: then the schedule does not depend on the smaller token buckets, so ``nb plan`` scores
every candidate bucket list on one replay exactly. The runtime's real step time also grows with
padding, context length and the number of graph calls, which this model leaves out; the
defaults are round figures of a 135M-parameter model on two CPU cores (about 0.1 s of fixed cost
per step, 2 ms per token) and are meant to be set to the machine's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neuron_buckets.core.step_plan import StepPlan

STEP_S, TOKEN_S = 0.1, 0.002  # the clock's defaults: seconds per step, and per token it computes


@dataclass(frozen=True)
class ReplayLoad:
    concurrency: int | None = None  # requests in flight at most; None: no bound
    arrivals: tuple[float, ...] | None = None  # seconds, one per request; None: all present at 0
    step_s: float = STEP_S  # replayed seconds per step
    token_s: float = TOKEN_S  # replayed seconds per token a step computes

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"a replay's concurrency must be at least 1, got {self.concurrency}")
        if self.step_s < 0 or self.token_s < 0:
            raise ValueError(f"step times must be >= 0, got {self.step_s} s/step and {self.token_s} s/token")

    @classmethod
    def of(
        cls,
        concurrency: int | None,
        arrivals: np.ndarray | None,
        step_s: float = STEP_S,
        token_s: float = TOKEN_S,
    ) -> ReplayLoad:
        """A load from the trace's arrival array (or None)."""
        times = None if arrivals is None else tuple(float(t) for t in arrivals)
        return cls(concurrency, times, step_s, token_s)

    def order(self, n: int) -> list[int]:
        """The order in which the first ``n`` requests are offered: by arrival (stable), else as
        listed."""
        if self.arrivals is None:
            return list(range(n))
        return [int(i) for i in np.argsort(np.asarray(self.arrivals[:n]), kind="stable")]

    def admits(self, in_flight: int, request: int, clock: float) -> bool:
        """Whether ``request`` joins the waiting queue now, with ``in_flight`` requests unfinished."""
        room = self.concurrency is None or in_flight < self.concurrency
        return room and (self.arrivals is None or self.arrivals[request] <= clock)

    def step_seconds(self, plan: StepPlan) -> float:
        return self.step_s + self.token_s * sum(len(s.token_ids) for s in plan)

    def to_json(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "arrivals": self.arrivals is not None,
            "step_seconds": self.step_s,
            "token_seconds": self.token_s,
        }


ALL_AT_ONCE = ReplayLoad()

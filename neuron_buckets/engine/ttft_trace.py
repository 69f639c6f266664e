"""Where an arriving request's time to first token goes, request by request: an opt-in trace.

Off unless ``NB_TRACE_TTFT=1`` (``TTFTTrace.from_env`` is then None and the engine's step pays one
``is None`` test). On, every request the server admits gets a record, in seconds of one clock
(``time.perf_counter``):

- ``http_s``: from the HTTP handler's start to the engine loop's queue: the body, the tokenizer
  and the request's checks;
- ``queue_s``: from the queue to the engine: the wait for the step that was running;
- ``wait_steps``, ``wait_s``: steps that ran after it was added without any of its prompt (it
  waited behind others);
- ``prompt_steps`` and ``prompt_step_s``: the steps that computed its prompt, each one's cost;
  ``prompt_tokens``: its real tokens in them; ``decode_rows``: other requests' decode rows riding
  in those steps;
- ``host_s``: host time between those steps (the loop's commands, outputs, metrics);
- ``ttft_s``: from the HTTP handler's start to the end of the step that sampled its first token.

The parts add up to ``ttft_s`` (the delivery of the token to the client is not in it). Records of
the newest ``KEEP`` requests are kept; the server shows them at ``/debug/ttft``.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from neuron_buckets.core.step_plan import StepPlan
from neuron_buckets.engine.request_output import RequestOutput

ENV = "NB_TRACE_TTFT"
KEEP = 1024


@dataclass
class TTFTRecord:
    """One request's time to first token in parts (the module's docstring says which)."""

    request_id: int
    prompt_len: int
    received: float
    submitted: float
    added: float
    http_s: float = 0.0
    queue_s: float = 0.0
    wait_steps: int = 0
    wait_s: float = 0.0
    prompt_steps: int = 0
    prompt_step_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    decode_rows: int = 0
    host_s: float = 0.0
    ttft_s: float = 0.0

    @property
    def parts_s(self) -> float:
        """The parts' sum: ``ttft_s`` up to the clock's rounding."""
        return self.http_s + self.queue_s + self.wait_s + sum(self.prompt_step_s) + self.host_s


class TTFTTrace:
    """The records of the requests still waiting for their first token, and of the last ``KEEP``."""

    def __init__(self, keep: int = KEEP) -> None:
        self.open: dict[int, TTFTRecord] = {}
        self.done: deque[TTFTRecord] = deque(maxlen=keep)
        self._last_end: float | None = None  # when the previous step ended

    @classmethod
    def from_env(cls) -> TTFTTrace | None:
        """A trace when ``NB_TRACE_TTFT=1``, else None (tracing off costs nothing)."""
        return cls() if os.environ.get(ENV) == "1" else None

    def added(self, request_id: int, prompt_len: int, received: float, submitted: float) -> None:
        """A request just added to the engine, received by the HTTP handler at ``received`` and queued
        for the engine at ``submitted`` (``time.perf_counter`` both)."""
        now = time.perf_counter()
        self.open[request_id] = TTFTRecord(request_id, prompt_len, received, submitted, now,
                                           http_s=submitted - received, queue_s=now - submitted)

    def stepped(self, plan: StepPlan, began: float, outputs: Sequence[RequestOutput]) -> None:
        """One engine step that began at ``began`` (``time.perf_counter``), ended now: charge it to
        every open request, and close those that got their first token."""
        ended = time.perf_counter()
        cost = ended - began
        chunks = {s.request_id: len(s.token_ids) for s in plan if s.request_id in self.open}
        decode_rows = sum(1 for s in plan if s.request_id not in self.open)
        for rid, record in self.open.items():
            record.host_s += began - max(record.added, self._last_end or record.added)
            if rid in chunks:
                record.prompt_steps += 1
                record.prompt_step_s.append(cost)
                record.prompt_tokens += chunks[rid]
                record.decode_rows += decode_rows
            else:
                record.wait_steps += 1
                record.wait_s += cost
        self._last_end = ended
        for out in outputs:
            if out.request_id not in self.open:
                continue
            if out.new_token_ids:
                record = self.open.pop(out.request_id)
                record.ttft_s = ended - record.received
                self.done.append(record)
            elif out.finished:  # aborted before its first token: no TTFT to explain
                del self.open[out.request_id]

    def report(self) -> dict:
        """The kept records, oldest first, in milliseconds, and their means."""
        rows = [dict(_ms(k, v) for k, v in asdict(r).items() if k not in ("received", "submitted", "added"))
                for r in self.done]
        numeric = [k for k in (rows[0] if rows else {}) if isinstance(rows[0][k], int | float)]
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in numeric if k != "request_id"}
        return {"requests": rows, "mean": mean, "open": len(self.open)}


def _ms(key: str, value: object) -> tuple[str, object]:
    """A field in the report: seconds as milliseconds (``*_s`` renamed ``*_ms``), counts as they are."""
    if not key.endswith("_s"):
        return key, value
    ms = [1e3 * v for v in value] if isinstance(value, list) else 1e3 * value
    return key.removesuffix("_s") + "_ms", ms

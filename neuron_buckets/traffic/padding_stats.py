"""What a bucket set costs on a trace: padded prefill tokens and padded decode rows.

Prefill: a prompt is padded to the smallest bucket that holds it; a prompt longer than the
largest bucket runs as full chunks of the largest bucket plus its remainder padded (the runtime's
chunked prefill). Decode: arrivals are replayed through at most ``max_num_seqs`` slots, each
request decoding its output at a fixed rate, and every step's batch is padded to a ``num_seqs``
bucket (a batch above the largest bucket is split into several calls, like a long prompt).
Everything is one ``np.searchsorted`` plus ``np.bincount``; no per-token Python.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from neuron_buckets.core.bucket import validate_buckets
from neuron_buckets.runtime.bucket_stats import padding_share
from neuron_buckets.traffic.compile_cost import CompileCost
from neuron_buckets.traffic.traces import Trace


@dataclass(frozen=True)
class PaddingStats:
    """Real and padded work per bucket. Counts are exact ints for unweighted items (prompts);
    decode uses steps as weights, so its counts are floats."""

    buckets: tuple[int, ...]
    items: float  # prompts (prefill) or decode steps
    chunked: float  # items larger than the largest bucket
    calls: tuple[float, ...]  # graph calls per bucket
    real: tuple[float, ...]  # real tokens (rows) per bucket
    padded: tuple[float, ...]  # tokens (rows) the graph computes per bucket: bucket x calls

    @property
    def real_total(self) -> float:
        return sum(self.real)

    @property
    def padded_total(self) -> float:
        return sum(self.padded)

    @property
    def padding_ratio(self) -> float:
        """Padding over real work, (P - R) / R: the contract's ratio (0.44: 44% extra compute)."""
        return (self.padded_total - self.real_total) / self.real_total

    @property
    def padding_share(self) -> float:
        """Padding over computed work, (P - R) / P: the share of the compute that was padding."""
        return padding_share(self.real_total, self.padded_total)

    def to_json(self, item: str, unit: str) -> dict:
        """The ``--json`` document: ``{"buckets", item, "real_<unit>", "computed_<unit>",
        "padding_share", ...}``, with the contract's ``padded_<unit>`` (= computed) and
        ``padding_ratio`` beside them."""
        per_bucket = [
            {
                "seq" if unit == "tokens" else "batch": b,
                "calls": c,
                f"real_{unit}": r,
                f"computed_{unit}": p,
                "padding_share": padding_share(r, p) if p else None,
                f"padded_{unit}": p,
                "padding_ratio": (p - r) / r if r else None,
            }
            for b, c, r, p in zip(self.buckets, self.calls, self.real, self.padded, strict=True)
        ]
        return {
            "buckets": list(self.buckets),
            item: self.items,
            f"real_{unit}": self.real_total,
            f"computed_{unit}": self.padded_total,
            "padding_share": self.padding_share,
            f"padded_{unit}": self.padded_total,
            "padding_ratio": self.padding_ratio,
            f"chunked_{item}": self.chunked,
            "per_bucket": per_bucket,
        }


def padding_stats(
    sizes: np.ndarray, buckets: Sequence[int], weights: np.ndarray | None = None
) -> PaddingStats:
    """Pad every size (prompt length or batch size) onto ``buckets`` with chunking semantics."""
    table = np.asarray(validate_buckets("buckets", [int(b) for b in buckets]), dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.size and sizes.min() < 1:
        raise ValueError(f"sizes to pad must be >= 1, got {int(sizes.min())}")
    exact = weights is None
    w = np.ones(len(sizes), dtype=np.int64) if exact else np.asarray(weights, dtype=np.float64)
    top = table[-1]
    full, rest = np.divmod(sizes, top)
    has_rest = rest > 0
    slot = np.searchsorted(table, rest[has_rest])  # index of the smallest bucket >= remainder
    n = len(table)
    calls = np.bincount(slot, weights=w[has_rest], minlength=n)
    real = np.bincount(slot, weights=(rest * w)[has_rest], minlength=n)
    calls[-1] += (full * w).sum()
    real[-1] += (full * top * w).sum()
    padded = calls * table

    def out(values: np.ndarray) -> tuple[float, ...]:
        return tuple(int(v) if exact else float(v) for v in values)

    return PaddingStats(
        buckets=tuple(int(b) for b in table),
        items=int(w.sum()) if exact else float(w.sum()),
        chunked=int(w[sizes > top].sum()) if exact else float(w[sizes > top].sum()),
        calls=out(calls),
        real=out(real),
        padded=out(padded),
    )


@dataclass(frozen=True)
class Concurrency:
    """The replayed decode load: ``steps[b]`` decode steps ran with batch size ``b``."""

    steps: np.ndarray
    tokens_per_s: float
    max_num_seqs: int
    queued: int  # requests that waited for a free slot
    mean_wait_s: float

    @property
    def peak(self) -> int:
        return int(np.flatnonzero(self.steps)[-1]) if self.steps[1:].any() else 0

    def stats(self, buckets: Sequence[int]) -> PaddingStats:
        batch = np.arange(1, len(self.steps))
        return padding_stats(batch, buckets, weights=self.steps[1:])

    def to_json(self, buckets: Sequence[int]) -> dict:
        hist = [[int(b), float(s)] for b, s in enumerate(self.steps) if b and s]
        return {
            **self.stats(buckets).to_json("steps", "rows"),
            "tokens_per_s": self.tokens_per_s,
            "max_num_seqs": self.max_num_seqs,
            "peak_batch": self.peak,
            "queued_requests": self.queued,
            "mean_wait_s": self.mean_wait_s,
            "batch_histogram": hist,
        }


def replay_decode(trace: Trace, tokens_per_s: float, max_num_seqs: int) -> Concurrency:
    """Replay arrivals FIFO through ``max_num_seqs`` decode slots; a request holds its slot for
    ``output_tokens / tokens_per_s`` seconds. Prefill time is not modelled: decode dominates."""
    keep, arrive, start, hold = _fifo_replay(trace, tokens_per_s, max_num_seqs)
    times, level = _concurrency(start, start + hold)
    seconds = np.bincount(level[:-1], weights=np.diff(times), minlength=max_num_seqs + 1)
    wait = start - arrive
    return Concurrency(
        steps=seconds * tokens_per_s,
        tokens_per_s=float(tokens_per_s),
        max_num_seqs=int(max_num_seqs),
        queued=int((wait > 0).sum()),
        mean_wait_s=float(wait.mean()) if len(wait) else 0.0,
    )


def peak_blocks(trace: Trace, tokens_per_s: float, max_num_seqs: int, block_size: int) -> int:
    """The most KV blocks the requests in flight hold at once, each its whole prompt and output
    from start to end: with arrivals, over ``replay_decode``'s replay; without, the
    ``max_num_seqs`` longest requests together (all at once). Block 0 not counted."""
    need = -(-(trace.prompt_lens + np.maximum(trace.output_lens, 1)) // block_size)
    if trace.arrivals is None:
        return int(np.sort(need)[::-1][:max_num_seqs].sum())
    keep, _, start, hold = _fifo_replay(trace, tokens_per_s, max_num_seqs)
    if not len(keep):
        return int(need.max())
    return int(_concurrency(start, start + hold, need[keep])[1].max())


def _fifo_replay(
    trace: Trace, tokens_per_s: float, max_num_seqs: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The requests that decode (their indices, by arrival), their arrivals, start times in
    the FIFO replay, and the seconds each holds its slot."""
    if trace.arrivals is None:
        raise ValueError("decode replay needs arrival times; this trace has no timestamp column")
    if tokens_per_s <= 0 or max_num_seqs < 1:
        raise ValueError(f"need tokens_per_s > 0 and max_num_seqs >= 1, got {tokens_per_s}, {max_num_seqs}")
    order = np.argsort(trace.arrivals, kind="stable")
    keep = order[trace.output_lens[order] > 0]
    arrive = trace.arrivals[keep]
    hold = trace.output_lens[keep] / tokens_per_s
    return keep, arrive, _fifo_starts(arrive, hold, max_num_seqs), hold


def _fifo_starts(arrive: np.ndarray, hold: np.ndarray, slots: int) -> np.ndarray:
    """Start times in a FIFO queue with ``slots`` servers. Without saturation a request starts on
    arrival (vectorised check); otherwise one heap pass over requests (not tokens)."""
    if len(arrive) == 0:
        return arrive.copy()
    if _concurrency(arrive, arrive + hold)[1].max() <= slots:
        return arrive.copy()
    start = np.empty_like(arrive)
    busy: list[float] = []
    for i, (a, h) in enumerate(zip(arrive.tolist(), hold.tolist(), strict=True)):
        s = max(a, heapq.heappop(busy)) if len(busy) == slots else a
        heapq.heappush(busy, s + h)
        start[i] = s
    return start


def _concurrency(
    start: np.ndarray, end: np.ndarray, weight: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Event times in order and the number of running requests (or the sum of their ``weight``)
    after each event (a request ending at t frees its slot before one starting at t takes it)."""
    w = np.ones(len(start), np.int64) if weight is None else np.asarray(weight, np.int64)
    times = np.concatenate([end, start])
    delta = np.concatenate([-w, w])
    order = np.lexsort((np.sign(delta), times))
    return times[order], np.cumsum(delta[order])


def inspect_trace(
    trace: Trace,
    prefill: Sequence[int],
    num_seqs: Sequence[int],
    max_num_seqs: int,
    tokens_per_s: float,
    cost: CompileCost | None = None,
) -> dict:
    """The ``nb inspect --json`` document: prefill padding, replayed decode padding (None without
    arrivals), and each graph's compile seconds and bytes (None without a manifest)."""
    doc: dict = {"prefill": padding_stats(trace.prompt_lens, prefill).to_json("requests", "tokens")}
    conc = replay_decode(trace, tokens_per_s, max_num_seqs) if trace.arrivals is not None else None
    doc["decode"] = conc.to_json(num_seqs) if conc is not None and conc.peak else None
    doc["graphs"] = None
    if cost is not None:
        doc["graphs"] = [asdict(b) | asdict(cost.estimate(b)) for b in cost.shapes(prefill, num_seqs)]
    return doc

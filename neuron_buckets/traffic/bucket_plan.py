"""What ``nb plan`` chooses, as typed records: the planner builds them, ``to_json`` writes the
``--json`` document they always were, and nothing between reads a dict by key."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neuron_buckets.traffic.padding_stats import Concurrency, PaddingStats, padding_stats


@dataclass(frozen=True)
class ParetoRow:
    """The padding-minimal set of one graph count, and, with a compile-time model, its price."""

    stats: PaddingStats
    compile_seconds: float | None = None  # its prefill graphs
    graph_bytes: int | None = None
    total_compile_seconds: float | None = None  # with every decode graph of the plan

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.stats.buckets

    def padding_json(self) -> dict:
        s = self.stats
        return {"graphs": len(s.buckets), "buckets": list(s.buckets), "computed_tokens": s.padded_total,
                "padding_share": s.padding_share, "padded_tokens": s.padded_total,
                "padding_ratio": s.padding_ratio}  # fmt: skip

    def to_json(self) -> dict:
        price = {"compile_seconds": self.compile_seconds, "graph_bytes": self.graph_bytes,
                 "total_compile_seconds": self.total_compile_seconds}
        return self.padding_json() | price


def decode_json(conc: Concurrency, buckets: tuple[int, ...], baseline: tuple[int, ...]) -> dict:
    """A decode load's rows padded by ``buckets``, beside the ``baseline`` set's."""
    return conc.to_json(buckets) | {"baseline": conc.stats(baseline).to_json("steps", "rows")}


@dataclass(frozen=True)
class DecodePlan:
    """``num_seqs_buckets`` for a replayed decode load, against the powers-of-two ``baseline``;
    ``why_not`` says which light-load batches got no graph of their own."""

    conc: Concurrency
    buckets: tuple[int, ...]
    baseline: tuple[int, ...]
    why_not: str | None = None

    def to_json(self) -> dict:
        return decode_json(self.conc, self.buckets, self.baseline) | {"why_not": self.why_not}


@dataclass(frozen=True)
class ContextPlan:
    """``decode_context_length_buckets`` for the decode rows reaching each context (``rows``),
    against the grid's default ``baseline``; the largest is ``max_model_len``."""

    contexts: np.ndarray
    rows: np.ndarray
    buckets: tuple[int, ...]
    baseline: tuple[int, ...]
    max_model_len: int

    def to_json(self) -> dict:
        stats = padding_stats(self.contexts, self.buckets, self.rows).to_json("rows", "positions")
        return stats | {
            "max_model_len": self.max_model_len,
            "baseline": padding_stats(self.contexts, self.baseline, self.rows).to_json("rows", "positions"),
        }


@dataclass(frozen=True)
class BucketPlan:
    """The chosen prefill set (a Pareto row: how the fitted prompts pad), the powers-of-two
    baseline's padding, every per-K optimum, the decode and context sets (None where the trace
    has no arrivals, or no request decodes), and how the held-out requests pad, when asked."""

    chosen: ParetoRow
    baseline: PaddingStats
    align: int
    pareto: tuple[ParetoRow, ...]
    decode: DecodePlan | None
    context: ContextPlan | None
    holdout: dict | None = None

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.chosen.buckets

    def to_json(self) -> dict:
        """The ``nb plan --json`` document: chosen sets, baselines, Pareto table, budget, holdout."""
        prefill = self.chosen.stats.to_json("requests", "tokens") | {
            "align": self.align,
            "max_num_batched_tokens": self.buckets[-1],
            "baseline": self.baseline.to_json("requests", "tokens"),
        }
        out: dict = {
            "prefill": prefill,
            "decode": self.decode.to_json() if self.decode else None,
            "pareto": [row.to_json() for row in self.pareto],
            "context": self.context.to_json() if self.context else None,
            "compile_seconds": self.chosen.total_compile_seconds,
        }
        if self.holdout is not None:
            out["holdout"] = self.holdout
        return out

"""Repeated, alternating rounds: every server (or variant) measured at least 3 times, in an order
that changes each round, and the figures reported as min / median / max per server with the ratio
taken between medians.

One run of each server, always in the same order, let the first server warm the machine for the
second (or find it still cooling) and left no sign of how far a figure moves between runs (on
unchanged code, a matrix cell's ratio moved by a quarter between two runs). Round ``r`` runs the
servers rotated by ``r``, so each starts first as often as any other and every pair meets in both
orders; with two servers the order simply alternates.

A runner is called once per (server, round) and returns its figures by cell and metric (a cell is
whatever the bench measures under one start of a server, e.g. a workload at a concurrency).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

MIN_ROUNDS = 3

Figures = Mapping[Hashable, Mapping[str, float]]  # one run of one server: cell -> metric -> value
Runner = Callable[[str, int], Figures]  # (server, round) -> its figures
Samples = dict[str, dict[Hashable, dict[str, list[float]]]]  # server -> cell -> metric -> per round


def add_rounds_argument(parser: argparse.ArgumentParser) -> None:
    """``--rounds N``: how many alternating rounds each cell runs (``MIN_ROUNDS`` at least)."""
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS,
                        help=f"alternating rounds per cell, at least {MIN_ROUNDS} (ratios are of medians)")


def order(servers: Sequence[str], round_index: int) -> list[str]:
    """The servers in the order round ``round_index`` starts them: rotated by the round."""
    k = round_index % len(servers)
    return [*servers[k:], *servers[:k]]


def run_rounds(servers: Sequence[str], rounds: int, run: Runner) -> Samples:
    """Call ``run`` for every server in every round, in ``order``; each figure's values by round."""
    if rounds < MIN_ROUNDS:
        raise ValueError(f"{rounds} rounds: a median needs at least {MIN_ROUNDS}")
    if len(set(servers)) != len(servers) or not servers:
        raise ValueError(f"servers must be distinct and not none: {list(servers)}")
    samples: Samples = {s: {} for s in servers}
    for r in range(rounds):
        for server in order(servers, r):
            for cell, metrics in run(server, r).items():
                for metric, value in metrics.items():
                    samples[server].setdefault(cell, {}).setdefault(metric, []).append(value)
    return samples


@dataclass(frozen=True)
class Spread:
    """One figure over its rounds."""

    low: float
    median: float
    high: float
    rounds: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no values to spread")
        return cls(min(values), statistics.median(values), max(values), len(values))

    def cell(self, fmt: str) -> str:
        """``min-max`` as a table cell, in ``fmt`` (the median has a column of its own)."""
        return f"{self.low:{fmt}}-{self.high:{fmt}}"


def spreads(samples: Samples) -> dict[str, dict[Hashable, dict[str, Spread]]]:
    """Every figure of ``run_rounds`` as its ``Spread``."""
    return {s: {c: {m: Spread.of(v) for m, v in ms.items()} for c, ms in cells.items()}
            for s, cells in samples.items()}


def median_ratio(samples: Samples, top: str, bottom: str, cell: Hashable, metric: str) -> float:
    """``top``'s median over ``bottom``'s: the ratio a table reports (never a ratio of one round)."""
    a = statistics.median(samples[top][cell][metric])
    b = statistics.median(samples[bottom][cell][metric])
    return a / b if b else float("nan")


def best(samples: Samples, candidates: Sequence[str], cell: Hashable, metric: str,
         higher: bool = True) -> str:
    """The candidate whose median ``metric`` is best in ``cell`` (highest unless ``higher`` is False):
    the peer setting a server is compared with."""
    def key(server: str) -> float:
        m = statistics.median(samples[server][cell][metric])
        return m if higher else -m
    return max(candidates, key=key)

"""``nb compile --dry-run``: where each bucket's pieces would come from, and what compiling costs.

A piece is in the output directory (its graph intact, by sha256), in the local or the remote
cache (a record whose graph is there at its recorded size; bytes are checked when it is used),
or still to compile. Its estimate is the median compile time recorded for the same piece and
backend (in the stores' records and the old manifest), else for the same role; none without
history. Nothing is written, and no executor is started.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass

from neuron_buckets.compile.artifact_writer import kept_pieces
from neuron_buckets.compile.build_plan import BuildPlan
from neuron_buckets.compile.graph_cache import GraphCache
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.store_entry import StoreEntry
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.model.pieces import PieceShape

PLACES = ("output dir", "local cache", "remote cache", "to compile")  # best first


@dataclass(frozen=True)
class BucketPlan:
    bucket: Bucket
    place: str  # the worst place among its pieces
    estimate_s: float | None  # compile seconds of its pieces still to compile (None: no history)


@dataclass(frozen=True)
class CompilePlan:
    buckets: list[BucketPlan]
    places: dict[PieceShape, str]
    estimates: dict[PieceShape, float | None]  # of the pieces to compile

    @property
    def estimate_s(self) -> float | None:
        """All pieces to compile, each once; None when one of them has no history."""
        values = list(self.estimates.values())
        return None if None in values else sum(values)

    def wall_s(self, jobs: int) -> float | None:
        """The wall time of ``estimate_s`` on ``jobs`` parallel workers: each piece, longest
        first, onto the worker free first (what a pool does); None without history. The sum
        alone overstates a parallel compile by about the number of jobs."""
        if self.estimate_s is None:
            return None
        free = [0.0] * max(1, jobs)
        for seconds in sorted(self.estimates.values(), reverse=True):
            heapq.heapreplace(free, free[0] + seconds)
        return max(free)


def _present(store: GraphStore, names: dict[str, dict], entry: StoreEntry | None) -> bool:
    return entry is not None and names.get(entry.graph_name, {}).get("size") == entry.bytes


def _listing(store: GraphStore | None) -> tuple[dict[str, dict], dict[tuple[str, str], StoreEntry]]:
    if store is None:
        return {}, {}
    names = store.names()
    return names, {(e.key, e.ext): e for e in store.entries(names)}


def plan_compile(build: BuildPlan, cache: GraphCache) -> CompilePlan:
    """Where each piece of ``build`` would come from, with ``cache`` as the graph cache."""
    ext = build.backend.graph_ext
    intact = kept_pieces(build.out, build.previous)
    stores = [("local cache", cache.local), ("remote cache", cache.remote)]
    listings = [(place, store, *_listing(store)) for place, store in stores]
    places: dict[PieceShape, str] = {}
    for shape, key in build.keys.items():
        places[shape] = "output dir" if key in intact else next(
            (place for place, store, names, entries in listings
             if store and _present(store, names, entries.get((key, ext)))),
            "to compile",
        )
    history = [(e.piece, e.backend, e.compile_seconds) for *_, entries in listings for e in entries.values()]
    old = build.previous
    history += [(r.name, old.backend.name, r.compile_seconds) for r in (old.pieces.values() if old else ())]
    backend = build.backend.name
    estimates = {s: _estimate(s, backend, history) for s, p in places.items() if p == "to compile"}
    buckets = []
    for b in build.buckets:
        shapes = set(build.bucket_pieces[b].values())
        place = max((places[s] for s in shapes), key=PLACES.index)
        missing = [estimates[s] for s in shapes if s in estimates]
        buckets.append(BucketPlan(b, place, None if None in missing else sum(missing)))
    return CompilePlan(buckets, places, estimates)


def _estimate(shape: PieceShape, backend: str, history: list[tuple[str, str, float]]) -> float | None:
    for same in (lambda name: name == shape.name, lambda name: name.split("_")[0] == shape.role):
        seconds = [s for name, b, s in history if b == backend and s > 0 and same(name)]
        if seconds:
            return statistics.median(seconds)
    return None

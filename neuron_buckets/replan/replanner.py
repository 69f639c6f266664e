"""``nb replan``: a new bucket set for an artifact, fitted to the traffic it served, as a new
manifest version beside the old one.

Within the artifact's fixed geometry (model, dtype, block size, cache, limits: ``config_of``)
only the token buckets change. A set is kept only when it removes more than ``threshold`` of the
padding the current one computes on the trace (``bucket_choice.py``); otherwise nothing is
compiled. A kept set is built like ``nb compile`` builds one, with the same keys: the pieces the
artifact already has (every decode bucket's and every kept token bucket's) are reused from its
``graphs/``, those in the graph cache are linked, and only the rest compile, in background
workers at the lowest CPU priority (``background_compile.py``), never in the serving process. The
pieces to compile must fit ``budget_s`` by their estimate (the median recorded compile time of
the same piece, else the same role). A failing piece stops the run (fail-fast): no version is
written, the old set keeps serving, and the report says which piece failed and why. Nothing is
overwritten: the new version is ``manifest.vN.json`` (``artifact/manifest_versions.py``), and
its new graphs are new files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from neuron_buckets.artifact.manifest import Manifest
from neuron_buckets.artifact.manifest_versions import newest_complete, write_version
from neuron_buckets.compile.artifact_writer import ArtifactWriter, kept_pieces
from neuron_buckets.compile.build_plan import BuildPlan
from neuron_buckets.compile.compile_plan import plan_compile
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.compile.directory_lock import directory_lock
from neuron_buckets.compile.outcome import Notify, Outcome
from neuron_buckets.model.pieces import PieceShape
from neuron_buckets.replan.artifact_config import config_of
from neuron_buckets.replan.background_compile import BackgroundPieceQueue
from neuron_buckets.replan.bucket_choice import BucketChoice, choose_buckets
from neuron_buckets.traffic.traces import Trace
from neuron_buckets.utils.cache_dir import default_cache_dir
from neuron_buckets.utils.errors import UserError

DEFAULT_THRESHOLD = 0.1  # a new set must remove more than this share of the current padding


class ReplanError(UserError, ValueError):
    """An artifact that cannot be re-planned in place."""


@dataclass(frozen=True)
class ReplanReport:
    outcome: str  # "new_version", "no_better", "over_budget" or "failed"
    reason: str
    version_before: int
    version: int  # the version serving after the run: the new one, or the one before
    choice: BucketChoice | None
    compiled: tuple[str, ...] = ()  # pieces built by a worker (or failed there)
    reused: int = 0  # pieces from the artifact or the graph cache
    estimate_s: float | None = None
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"outcome": self.outcome, "reason": self.reason, "version_before": self.version_before,
                "version": self.version, "choice": self.choice.to_json() if self.choice else None,
                "compiled": list(self.compiled), "reused": self.reused, "estimate_s": self.estimate_s,
                "seconds": self.seconds}


class VersionWriter(ArtifactWriter):
    """The artifact writer of a re-plan: the weights, tokenizer and kernel libraries are the current
    version's, and the manifest stays in memory until every piece is built (``save`` writes no
    ``manifest.json``)."""

    def __init__(self, plan: BuildPlan, current: Manifest) -> None:
        super().__init__(plan)
        self.manifest.weights, self.manifest.text = current.weights, current.text
        self.manifest.libraries = current.libraries

    def save(self, done: dict[PieceShape, Outcome]) -> None:
        self.update(done)


def replan(
    directory: Path, trace: Trace, budget_s: float, threshold: float = DEFAULT_THRESHOLD, *,
    graphs: int | None = None, align: int | None = None, jobs: int = 1, cache_dir: str | Path | None = None,
    on_event: Notify | None = None,
) -> ReplanReport:
    """Re-plan ``directory``'s token buckets on ``trace`` (see the module's docstring)."""
    start = time.perf_counter()
    directory = Path(directory)
    newest_complete(directory)  # not an artifact: refused before the lock would create the directory
    with directory_lock(directory):
        version, current = newest_complete(directory)
        if current.parallel.tensor_parallel_size > 1:
            raise ReplanError(f"{directory}: the ranks of a tensor-parallel artifact read manifest.json; "
                              "nb replan re-plans one-rank artifacts only")
        config = config_of(current, jobs)
        choice = choose_buckets(config, trace, graphs, align)

        def report(outcome: str, reason: str, written: int | None = None, **more: object) -> ReplanReport:
            seconds = round(time.perf_counter() - start, 3)
            base = ReplanReport(outcome, reason, version, written or version, choice, seconds=seconds)
            return replace(base, **more)

        if choice.gain <= threshold:
            return report("no_better", f"the best set {list(choice.chosen)} removes {choice.gain:.0%} of the "
                                       f"padding of {list(choice.current)}, not more than {threshold:.0%}")
        new = replace(config, buckets=replace(config.buckets, num_batched_tokens_buckets=choice.chosen))
        compiler = Compiler(new, directory, cache_dir or default_cache_dir(), fail_fast=True)
        build = compiler.plan
        _check_same_pieces(build, current)
        estimate = plan_compile(build, compiler.cache).wall_s(jobs)
        if estimate is not None and estimate > budget_s:
            return report("over_budget", f"its pieces take about {estimate:.0f} s to compile, over the "
                                         f"budget of {budget_s:g} s", estimate_s=estimate)
        writer = VersionWriter(build, current)
        notify = on_event or (lambda *_: None)
        done: dict[PieceShape, Outcome] = {}
        kept = kept_pieces(directory, current)
        for shape, key in build.keys.items():
            if (o := compiler.found(shape, key, kept, writer, notify)) is not None:
                done[shape] = o
        reused = len(done)
        todo = [Outcome(s, key) for s, key in build.keys.items() if s not in done]
        if todo:
            queue = BackgroundPieceQueue(new, build.model_config, compiler.cache, build.toolchain, True, None)
            queue.run(todo, done, lambda o, err: compiler.finish(o, err, writer, done, notify), notify, jobs)
        compiled = tuple(o.name for o in todo)
        writer.update(done)
        if failed := [o for o in done.values() if o.status != "ok"]:
            return report("failed", f"piece {failed[0].name} failed: {failed[0].error} (log: "
                                    f"{failed[0].log}); the old buckets keep serving",
                          compiled=compiled, reused=reused, estimate_s=estimate)
        written = write_version(directory, writer.manifest)
        return report("new_version", f"{list(choice.chosen)} removes {choice.gain:.0%} of the padding of "
                                     f"{list(choice.current)}", written, compiled=compiled,
                      reused=reused, estimate_s=estimate)


def _check_same_pieces(build: BuildPlan, current: Manifest) -> None:
    """Every bucket both sets hold must be run by the same pieces, under the same keys: else the
    toolchain or the artifact changed since ``nb compile``, and the whole grid would recompile."""
    old = {r.bucket: r.pieces for r in current.buckets}
    for bucket, roles in build.bucket_pieces.items():
        if bucket in old and {role: build.keys[s] for role, s in roles.items()} != old[bucket]:
            raise ReplanError(f"{build.out}: bucket {bucket.name}'s pieces have other keys than when it was "
                              "compiled (another nb version or backend); run nb compile again")

"""``nb compile``: config -> ``BuildPlan`` -> pieces from the artifact, the cache or a worker -> artifact.

Three parts, one job each: the plan says which pieces, under which keys (``build_plan.py``); the
artifact writer writes the directory (``artifact_writer.py``); the piece queue compiles what
neither the artifact directory nor the graph cache (local, or remote and pulled) holds
(``piece_queue.py``). The compiler checks that the run can start, then joins them under the
directory's lock.

With a draft model (``[speculative] method = "draft_model"``) a second compiler builds the draft's
sub-artifact, ``<out>/draft/``, from ``config/draft.py``'s config, after the target and under the
target's lock: the same pipeline, its own manifest, weights and buckets, its pieces keyed and
cached like any other (a draft with the target's shapes reuses the target's prefill graphs).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

from neuron_buckets.artifact.manifest import PieceRecord
from neuron_buckets.backends import BackendUnavailable, get_backend
from neuron_buckets.compile.artifact_writer import ArtifactWriter, kept_pieces
from neuron_buckets.compile.build_plan import BuildPlan
from neuron_buckets.compile.compile_report import CompileReport
from neuron_buckets.compile.graph_cache import Damaged, GraphCache
from neuron_buckets.compile.outcome import Notify, Outcome
from neuron_buckets.compile.output_dir import check_owned, owned_directory
from neuron_buckets.compile.piece_queue import PieceQueue
from neuron_buckets.compile.store_sweep import remove_stale_temps
from neuron_buckets.compile.text_files import eos_token_ids, text_sources
from neuron_buckets.config import Config, ConfigError
from neuron_buckets.config.draft import DRAFT, draft_config
from neuron_buckets.model.model_source import model_config_of
from neuron_buckets.model.pieces import PieceShape
from neuron_buckets.runtime.memory import check_compile_memory


class Compiler:
    def __init__(
        self, config: Config, out: Path, cache_dir: str | Path, fail_fast: bool = False, *,
        local_cache: Path | None = None, ray_address: str | None = None,
    ) -> None:
        """Check everything a run needs before it writes a byte. ``cache_dir``: the graph cache, a
        local directory or a URL (then ``local_cache``, by default the user cache, holds the graphs
        pulled from it)."""
        previous = check_owned(Path(out))  # a directory that is not ours is refused first
        backend = get_backend(config.compile.backend)
        ok, why = backend.available()
        if not ok:
            raise BackendUnavailable(f"backend {backend.name!r} is not usable here: {why}")
        self.cache = GraphCache.open(cache_dir, local_cache)
        if config.compile.executor == "ray":
            from neuron_buckets.compile.ray_executor import check_ray

            check_ray(ray_address)  # a missing extra or a wrong address fails before anything starts
        model = model_config_of(config.model.path)
        self.text_sources = text_sources(config.model.path)
        self.eos_token_ids = eos_token_ids(config.model.path, model.vocab_size)
        local_jobs = config.compile.jobs if config.compile.executor == "local" else 0
        plan = BuildPlan.make(config, Path(out), backend, model, previous)
        check_compile_memory(config, model, local_jobs)
        self.queue = PieceQueue(config, model, self.cache, plan.toolchain, fail_fast, ray_address)
        self.cache.check()  # an unusable store fails here, before anything is written
        self.draft = self._draft_compiler(plan, cache_dir, local_cache)
        self.plan = replace(plan, draft=self.draft.plan) if self.draft else plan

    def _draft_compiler(
        self, plan: BuildPlan, cache_dir: str | Path, local_cache: Path | None
    ) -> Compiler | None:
        """The compiler of the draft model's sub-artifact; a draft of another vocabulary is refused."""
        if (config := draft_config(plan.config)) is None:
            return None
        draft = Compiler(config, plan.out / DRAFT, cache_dir, self.queue.fail_fast, local_cache=local_cache,
                         ray_address=self.queue.ray_address)
        if (got := draft.plan.model_config.vocab_size) != (want := plan.model_config.vocab_size):
            raise ConfigError(
                f"speculative.draft_model: {config.model.path} has vocab_size {got}, the target "
                f"{want}; a draft model must share the target's vocabulary"
            )
        return draft

    def run(self, jobs: int | None = None, on_event: Notify | None = None) -> CompileReport:
        """Compile the pieces that are missing; ``on_event`` sees (event, outcome): "queued" when
        a piece goes to a worker, "done" when it is finished (compiled, reused or failed), "retry"
        when its worker died and it is queued again, "damaged" when a cache entry of it was
        discarded. Queued minus done (and retries) is what is compiling."""
        notify = on_event or (lambda *_: None)
        plan = self.plan
        with owned_directory(plan.out) as previous:
            remove_stale_temps(self.cache.local)
            writer = ArtifactWriter(plan)
            kept = kept_pieces(plan.out, previous)
            writer.write_files(previous, self.text_sources, self.eos_token_ids)
            done: dict[PieceShape, Outcome] = {}
            for s, key in plan.keys.items():
                if (o := self.found(s, key, kept, writer, notify)) is not None:
                    done[s] = o
            todo = [Outcome(s, key) for s, key in plan.keys.items() if s not in done]
            writer.save(done)
            for o in done.values():
                notify("done", o)
            if todo:
                finish = partial(self.finish, writer=writer, done=done, notify=notify)
                self.queue.run(todo, done, finish, notify, jobs)
            writer.prune(previous, done)
            outcomes = [done[s] for s in plan.shapes if s in done]
            report = CompileReport(plan.out, outcomes, writer.manifest.buckets)
            if self.draft is not None and not self.queue.stopped(done):
                report.draft = self.draft.run(jobs, on_event)
            return report

    def found(self, shape: PieceShape, key: str, kept: dict[str, PieceRecord], writer: ArtifactWriter,
               notify: Notify) -> Outcome | None:
        """The piece, reused: from the artifact directory (shared with the remote store if that
        lacks it) or from the graph cache; None when it must be compiled."""
        if rec := kept.get(key):
            o = Outcome(shape, key, compile_seconds=rec.compile_seconds, cached=True, sha256=rec.sha256)
            self.cache.share(self.plan.out / rec.file, writer.entry(o, self.plan.out / rec.file))
            return o
        if hit := self.cache.get(key, self.plan.backend.graph_ext, self._damaged(shape, notify)):
            secs = hit.entry.compile_seconds
            return writer.place(Outcome(shape, key, compile_seconds=secs, cached=True), hit)
        return None

    def finish(self, o: Outcome, err: str | None, writer: ArtifactWriter, done: dict[PieceShape, Outcome],
                notify: Notify) -> None:
        """Place a compiled piece from the store it was published to, or record its failure."""
        if err is None:
            ext = self.plan.backend.graph_ext
            if hit := self.cache.get(o.key, ext, self._damaged(o.shape, notify), listed=False):
                done[o.shape] = writer.place(o, hit)
                writer.save(done)
                return
            err = f"compiled, but the graph is not in the store {self.cache.shared.location}"
        done[o.shape] = writer.fail(o, err)
        writer.save(done)

    def _damaged(self, shape: PieceShape, notify: Notify) -> Damaged:
        return lambda why: notify("damaged", Outcome(shape, self.plan.keys[shape], error=why))

"""What nb compile says it will take: the dry run's wall time on its jobs, and a progress ETA
that reused pieces do not make look short."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from neuron_buckets.cli.progress import CompileProgress
from neuron_buckets.compile.compile_plan import CompilePlan


def test_the_dry_run_estimate_is_the_wall_time_of_its_jobs() -> None:
    plan = CompilePlan(buckets=[], places={}, estimates={"a": 4.0, "b": 3.0, "c": 3.0, "d": 2.0})
    assert plan.estimate_s == 12.0  # every piece's compile, one after another
    assert plan.wall_s(1) == 12.0
    assert plan.wall_s(2) == 6.0  # 4 + 2 beside 3 + 3
    assert plan.wall_s(8) == 4.0  # the longest piece bounds it
    assert CompilePlan([], {}, {"a": 1.0, "b": None}).wall_s(2) is None  # no history for b


def test_reused_pieces_leave_the_bar_instead_of_speeding_its_eta() -> None:
    def outcome(cached: bool) -> SimpleNamespace:
        return SimpleNamespace(cached=cached, status="ok", name="layer", compile_seconds=2.0)

    with CompileProgress(5, Console(file=io.StringIO())) as progress:
        for _ in range(3):
            progress("done", outcome(cached=True))
        task = progress.progress.tasks[0]
        assert (task.total, task.completed, task.fields["reused"]) == (2, 0, 3)
        progress("queued", outcome(cached=False))
        progress("done", outcome(cached=False))
        assert (task.total, task.completed) == (2, 1)

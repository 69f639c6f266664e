"""``nb replan``: fit an artifact's token buckets to the traffic it served, as a new manifest version.

``--json`` prints the report as one document on stdout (``nb serve --replan-every`` reads it);
without it, one line says what happened and why. A compile that failed exits 1, after its report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from neuron_buckets.cli.console import out
from neuron_buckets.cli.traffic import TRACE_HELP
from neuron_buckets.replan.replanner import DEFAULT_THRESHOLD, ReplanReport, replan
from neuron_buckets.traffic.traces import load_trace


def replan_cmd(
    directory: Annotated[Path, typer.Argument(help="Artifact directory (nb compile's --out)")],
    trace: Annotated[Path, typer.Option("--trace", help=TRACE_HELP + "; nb serve --record-trace writes one")],
    budget_s: Annotated[
        float, typer.Option("--budget-s", min=0.0, help="Most seconds the new pieces may take to compile")
    ],
    threshold: Annotated[
        float,
        typer.Option(
            min=0.0, max=1.0, help="Keep a new set only if it removes more than this share of the padding"
        ),
    ] = DEFAULT_THRESHOLD,
    graphs: Annotated[
        int | None, typer.Option(min=1, help="At most this many token buckets (default: as many as now)")
    ] = None,
    align: Annotated[
        int | None, typer.Option(min=1, help="Token buckets are multiples of this (default: the block size)")
    ] = None,
    jobs: Annotated[int, typer.Option(min=1, help="Background compile workers (nice 19)")] = 1,
    cache_dir: Annotated[
        str | None, typer.Option("--cache-dir", help="Graph cache (default: $NB_CACHE_DIR or the user cache)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON document")] = False,
) -> None:
    """Re-plan an artifact's token buckets on a served trace, within its fixed geometry: keep a new set
    only if it pads less by more than --threshold, compile only the pieces it lacks (in the
    background, within --budget-s), and write it as a new manifest version beside the old."""
    report = replan(directory, load_trace(trace), budget_s, threshold, graphs=graphs, align=align, jobs=jobs,
                    cache_dir=cache_dir)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        out.print(summary(report), highlight=False)
    if report.outcome == "failed":
        raise typer.Exit(1)


def summary(report: ReplanReport) -> str:
    """One line: what the re-plan did, and why."""
    where = {"new_version": f"wrote manifest version {report.version}",
             "no_better": f"kept version {report.version}: nothing better",
             "over_budget": f"kept version {report.version}: over budget",
             "failed": f"kept version {report.version}: the compile failed"}[report.outcome]
    pieces = f" ({len(report.compiled)} pieces compiled, {report.reused} reused)" if report.compiled else ""
    return f"{where}{pieces}: {report.reason}"


def register(app: typer.Typer) -> None:
    """Add ``replan`` to the ``nb`` app."""
    app.command("replan", short_help="Re-plan an artifact's buckets on the traffic it served.")(replan_cmd)

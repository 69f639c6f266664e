"""The ``nb`` command line: thin typer wrappers over the library, rich output, clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from neuron_buckets._version import __version__
from neuron_buckets.artifact.manifest import MANIFEST, EmbeddingInfo, read_manifest
from neuron_buckets.cli.cache import register as register_cache
from neuron_buckets.cli.console import ErrorHandlingGroup, err, fail
from neuron_buckets.cli.console import out as console
from neuron_buckets.cli.generate import register as register_generate
from neuron_buckets.cli.replan import register as register_replan
from neuron_buckets.cli.serve import register as register_serve
from neuron_buckets.cli.traffic import register as register_traffic
from neuron_buckets.config import enumerate_grid, load_config
from neuron_buckets.config.draft import DRAFT, draft_config
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.model.quant.quant_scheme import QuantScheme
from neuron_buckets.runtime.memory import ranks_line, ranks_report

if TYPE_CHECKING:
    from neuron_buckets.compile.build_plan import BuildPlan
    from neuron_buckets.compile.graph_cache import GraphCache

app = typer.Typer(
    cls=ErrorHandlingGroup,
    help="Compile fixed-shape LLM graphs, one set per bucket, over a paged block-KV cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: option names are never cut at 80 columns
)

ConfigArg = Annotated[Path | None, typer.Argument(help="TOML config; default: the embedded default config")]


def _print_version(value: bool) -> None:
    if value:
        console.print(f"neuron-buckets {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version")
    ] = False,
) -> None:
    """A callback keeps ``nb`` a command group even while it has a single command."""


@app.command(short_help="The bucket grid a config compiles.")
def grid(config: ConfigArg = None) -> None:
    """Show the bucket grid a config compiles: one row per bucket (its embed, layer and head
    pieces), and with a draft model the draft's buckets in a table of their own."""
    cfg = load_config(config)
    buckets = enumerate_grid(cfg)
    _print_grid(f"bucket grid ({config or 'embedded default'})", buckets)
    if (draft := draft_config(cfg)) is None:
        console.print(f"{len(buckets)} buckets")
        return
    drafts = enumerate_grid(draft)
    _print_grid(f"draft model's bucket grid ({draft.model.path})", drafts)
    console.print(f"{len(buckets) + len(drafts)} buckets, {len(drafts)} of them the draft model's")


def _print_grid(title: str, buckets: list[Bucket]) -> None:
    table = Table(title=title)
    for col in ("kind", "batch", "seq", "ctx", "tokens per step"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for b in buckets:
        table.add_row(b.kind, str(b.batch), str(b.seq), str(b.ctx), str(b.tokens))
    console.print(table)


CacheDirOpt = Annotated[
    str | None,
    typer.Option(
        "--cache-dir",
        help="Graph cache: a directory, or a URL of a store that machines share (s3://bucket/prefix, any "
        "fsspec protocol; endpoint and credentials from the AWS_* variables); default: $NB_CACHE_DIR or "
        "the user cache",
    ),
]


@app.command("compile", short_help="Compile a config's buckets into an artifact directory.")
def compile_(
    config: ConfigArg = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Artifact directory")] = Path("nb-artifacts"),
    jobs: Annotated[
        int | None, typer.Option("--jobs", "-j", min=1, help="Parallel compile processes (local executor)")
    ] = None,
    backend: Annotated[str | None, typer.Option(help="inductor, eager, neuron, xla or stablehlo")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (inductor), neuron")] = None,
    cache_dir: CacheDirOpt = None,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop at the first failed bucket")] = False,
    executor: Annotated[
        str | None, typer.Option(help="local (worker processes) or ray (tasks on a Ray cluster)")
    ] = None,
    ray_address: Annotated[
        str | None, typer.Option(help="Ray cluster to use (default: $RAY_ADDRESS, else a local instance)")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Where each bucket would come from, what is left to build")
    ] = False,
) -> None:
    """Compile each bucket's pieces into an artifact directory; pieces already built are reused."""
    from dataclasses import replace

    from neuron_buckets.cli.neuron_route import neff_line, without_sdk
    from neuron_buckets.cli.progress import CompileProgress
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.model.gguf_checkpoint import dequantization_line, is_gguf
    from neuron_buckets.utils.cache_dir import default_cache_dir

    cfg = load_config(config)
    options = (("jobs", jobs), ("backend", backend), ("device", device), ("executor", executor))
    overrides = {k: v for k, v in options if v is not None}
    cfg = replace(cfg, compile=replace(cfg.compile, **overrides))
    if stablehlo := without_sdk(cfg):
        err.print("no Neuron SDK here: every piece is lowered to StableHLO (backend stablehlo) instead")
        cfg = stablehlo
    cache = cache_dir or default_cache_dir()
    compiler = Compiler(cfg, out, cache, fail_fast=fail_fast, ray_address=ray_address)
    plan = compiler.plan
    if dry_run:
        print_dry_run(plan, compiler.cache)
        return
    c = cfg.compile
    runs = f"{c.jobs} jobs" if c.executor == "local" else f"Ray tasks of {c.task_cpus} CPUs"
    shared = compiler.cache.remote
    draft = plan.draft
    of_draft = f" ({len(draft.buckets)} buckets, {len(draft.keys)} pieces the draft's)" if draft else ""
    err.print(
        f"{plan.num_buckets} buckets in {plan.num_pieces} pieces{of_draft}"
        + f", backend {c.backend} on {c.device}, {runs} -> {out}"
        + (f", sharing {shared.location}" if shared else "")
    )
    if is_gguf(cfg.model.path) and (line := dequantization_line(cfg.model.path, cfg.cache.dtype)):
        err.print(line, highlight=False, soft_wrap=True)  # one line, however narrow the terminal
    with CompileProgress(plan.num_pieces, err) as progress:
        report = compiler.run(c.jobs, progress)
    reused = len(report.all_outcomes) - len(report.compiled) - len(report.failed)
    err.print(
        f"compiled {len(report.compiled)}, reused {reused}, failed {len(report.failed)}; "
        f"manifest: {out / 'manifest.json'}"
    )
    if report.failed or len(report.all_outcomes) < plan.num_pieces:
        raise typer.Exit(1)
    if stablehlo:
        raise fail(neff_line(out))


def embedding_line(e: EmbeddingInfo) -> str:
    """What an embedding artifact is, for ``nb compile --dry-run`` and ``nb ls``."""
    return (f"embedding artifact: prefill buckets only, each ending in a norm piece (no decode graphs, "
            f"no LM head); pooling {e.pooling}, {'L2-normalized' if e.normalize else 'not normalized'}")


def print_dry_run(build: BuildPlan, cache: GraphCache) -> None:
    """The dry run's table: each bucket, where its pieces are, what compiling it would cost; then
    the draft model's, as a table of its own."""
    from neuron_buckets.compile.compile_plan import PLACES, plan_compile

    plan = plan_compile(build, cache)
    table = Table(title=f"nb compile --dry-run -> {build.out}")
    for col in ("bucket", "from", "estimated compile s"):
        table.add_column(col, justify="right" if col.startswith("est") else "left")
    for b in plan.buckets:
        estimate = "-" if b.place != "to compile" else "?" if b.estimate_s is None else f"{b.estimate_s:.1f}"
        table.add_row(b.bucket.name, b.place, estimate)
    console.print(table)
    if build.header.embedding is not None:
        console.print(embedding_line(build.header.embedding), highlight=False)
    counts = {p: sum(place == p for place in plan.places.values()) for p in PLACES}
    jobs = build.config.compile.jobs
    total = "time unknown (no history)"
    if (wall := plan.wall_s(jobs)) is not None:
        total = f"about {wall:.0f} s with {jobs} jobs ({plan.estimate_s:.0f} s of compile in all)"
    console.print(
        f"{counts['to compile']} of {len(plan.places)} pieces to compile, {total}; "
        f"{counts['output dir']} in the output dir, {counts['local cache']} in the local cache, "
        f"{counts['remote cache']} in the remote cache"
    )
    c = build.config.cache
    ranks = ranks_report(build.model_config, build.config.parallel.tensor_parallel_size, build.buckets,
                         c.num_blocks, c.block_size, c.dtype, len(build.keys))
    console.print(ranks_line(ranks), highlight=False)
    if build.draft is not None:
        print_dry_run(build.draft, cache)


@app.command("ls", short_help="An artifact's buckets and pieces: sizes, compile times.")
def ls_(directory: Annotated[Path, typer.Argument(help="Artifact directory")]) -> None:
    """List an artifact directory's buckets and the pieces that run them: status, size, compile
    time. A piece several buckets run (marked *) is counted once, in the shared row, so the rows
    add up to the total."""
    m = read_manifest(directory)
    b = m.backend
    table = Table(title=f"{directory}: {b.name} on {b.device}, torch {b.versions['torch']}")
    for col in ("bucket", "status", "pieces", "size", "compile s"):
        table.add_column(col, justify="right" if col in ("size", "compile s") else "left")
    users: dict[str, int] = {}
    for r in m.buckets:
        for k in set(r.pieces.values()) & m.pieces.keys():
            users[k] = users.get(k, 0) + 1
    shared = [m.pieces[k] for k, n in users.items() if n > 1]

    def cells(pieces: list) -> tuple[str, str]:
        return f"{sum(p.bytes for p in pieces) / 1e6:.1f} MB", f"{sum(p.compile_seconds for p in pieces):.1f}"

    for r in m.buckets:
        keys = [k for k in r.pieces.values() if k in m.pieces]
        ok = r.status == "ok"
        status = Text("ok", "green") if ok else Text.assemble(("failed", "red"), f" {r.error}")
        names = " ".join(m.pieces[k].name + ("*" if users[k] > 1 else "") for k in keys)
        own = [m.pieces[k] for k in set(keys) if users[k] == 1]
        table.add_row(r.bucket.name, status, names, *cells(own))
    if shared:
        table.add_section()
        table.add_row("shared *", "", " ".join(sorted(p.name for p in shared)), *cells(shared))
    console.print(table)
    counted = [m.pieces[k] for k in users]
    ok = [p for p in m.pieces.values() if p.status == "ok"]
    buckets_ok = sum(r.status == "ok" for r in m.buckets)
    size, secs = cells(counted)
    scheme = m.model.config.get("quantization")
    quantized = f" (projections {QuantScheme.of(scheme).name})" if scheme else ""
    console.print(
        f"{buckets_ok} of {len(m.buckets)} buckets ok, {len(ok)} of {len(m.pieces)} pieces ok; "
        f"the rows' pieces: {size}, {secs} s of compile; "
        f"weights {m.weights.bytes / 1e6:.1f} MB{quantized}, sha256 {m.weights.sha256[:12]}"
    )
    if m.embedding is not None:
        console.print(embedding_line(m.embedding), highlight=False)
    if (directory / DRAFT / MANIFEST).is_file():
        draft = read_manifest(directory / DRAFT)
        console.print(f"draft model: {len(draft.buckets)} buckets in {DRAFT}/ (nb ls {directory / DRAFT})")


@app.command(short_help="Check an artifact's files, then each bucket against eager.")
def verify(
    directory: Annotated[Path, typer.Argument(help="Artifact directory")],
    trials: Annotated[int, typer.Option(min=1, help="Random padded steps per bucket")] = 2,
    stablehlo: Annotated[bool, typer.Option(
        "--stablehlo", help="The pieces are StableHLO (backend stablehlo): IREE runs them on this CPU, "
        "over caches NaN-poisoned outside each step's blocks")] = False,
) -> None:
    """Check every file's sha256 and the schema, then run each bucket against the eager model."""
    from neuron_buckets.artifact.manifest import read_manifest
    from neuron_buckets.runtime.verify import file_problems, verify_graphs

    if stablehlo and (backend := read_manifest(directory).backend.name) != "stablehlo":
        raise ValueError(f"{directory}: --stablehlo needs an artifact of backend stablehlo, "
                         f"this one's is {backend} (nb compile --backend stablehlo)")
    problems = file_problems(directory)
    for p in problems:
        err.print(Text.assemble(("problem:", "red"), f" {p}"))
    if problems:
        raise typer.Exit(1)
    table = Table(title=f"{directory}: buckets against the eager model")
    for col in ("bucket", "result", "max |diff|"):
        table.add_column(col)
    checks = verify_graphs(directory, trials=trials, poisoned=stablehlo)
    for c in checks:
        diff = "-" if c.max_diff is None else f"{c.max_diff:.2e}"
        result = Text("ok", "green") if c.ok else Text.assemble(("FAIL", "red"), f" {c.detail}")
        table.add_row(c.name, result, diff)
    console.print(table)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


@app.command(short_help="Which backends and devices are usable here, and why not.")
def doctor() -> None:
    """Which backends and devices are usable on this machine, and why not."""
    from neuron_buckets.cli.doctor import doctor_report

    table = Table(title="nb doctor")
    for col in ("component", "usable", "detail"):
        table.add_column(col)
    for name, ok, why in doctor_report():
        table.add_row(name, Text("yes", "green") if ok else Text("no", "yellow"), why)
    console.print(table)


register_generate(app)
register_traffic(app)
register_cache(app)
register_serve(app)
register_replan(app)

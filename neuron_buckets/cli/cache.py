"""``nb cache ls | prune | push | pull``: the graph stores, local or remote, seen and tended.

Every command takes ``--cache-dir`` as ``nb compile`` does (a directory or a URL; default the user
cache). ``push`` and ``pull`` copy between that local store and the remote one named by URL,
each graph checked against its sha256 on the way, each entry published as a compile would.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from neuron_buckets.cli.console import err, out
from neuron_buckets.compile.graph_cache import GraphCache, SyncCount
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.store_entry import StoreEntry
from neuron_buckets.compile.store_sweep import prune_store
from neuron_buckets.runtime.memory import human
from neuron_buckets.utils.cache_dir import default_cache_dir

cache_app = typer.Typer(
    help="The graph cache: list, prune, and copy to or from a shared store.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help, as the rest of nb
)

DEFAULT = "default: $NB_CACHE_DIR or the user cache"
StoreOpt = Annotated[str | None, typer.Option("--cache-dir", help=f"A directory or a store URL ({DEFAULT})")]
LocalOpt = Annotated[Path | None, typer.Option("--cache-dir", help=f"The local store ({DEFAULT})")]
RemoteArg = Annotated[str, typer.Argument(help="The remote store's URL, e.g. s3://bucket/prefix")]
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(text: str) -> int:
    """'10GB' -> 10_000_000_000 (decimal units, as ``nb cache ls`` prints them)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?B?)", text.strip().upper())
    if not match:
        raise ValueError(f"--max-size: expected a size such as 500MB or 10GB, got {text!r}")
    return int(float(match[1]) * UNITS[match[2]])


def age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f} {unit}"
    return f"{seconds:.0f} s"


def _store(location: str | None) -> GraphStore:
    store = GraphStore(location or default_cache_dir())
    store.check()
    return store


def made_by(e: StoreEntry) -> str:
    """The toolchain that compiled an entry, in full: backend, nb version, compiler versions."""
    versions = (f"{k} {v}" for k, v in sorted(e.versions.items()))
    return ", ".join([f"{e.backend} with neuron-buckets {e.toolchain}", *versions])


def toolchain_id(e: StoreEntry) -> str:
    """A short id of ``made_by``: entries from one toolchain share it, and a row stays one line."""
    return hashlib.sha256(made_by(e).encode()).hexdigest()[:8]


@cache_app.command("ls", short_help="List the entries, one line each.")
def ls_(
    cache_dir: StoreOpt = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show each entry's full toolchain, not its short id")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the entries as one JSON document")] = False,
) -> None:
    """List the entries: piece, size, age, and the toolchain that compiled each (a short id,
    spelled out once below the table)."""
    store = _store(cache_dir)
    names = store.names()
    entries = sorted(store.entries(names), key=lambda e: e.created, reverse=True)
    present = {e.key: names.get(e.graph_name, {}).get("size") == e.bytes for e in entries}
    if as_json:
        docs = [
            asdict(e) | {"made_by": made_by(e), "toolchain_id": toolchain_id(e), "present": present[e.key]}
            for e in entries
        ]
        typer.echo(json.dumps({"location": store.location, "entries": docs}, indent=2))
        return
    table = Table(title=f"graph store {store.location}", box=box.SIMPLE, title_justify="left")
    for col in ("key", "piece", "size", "age", "graph", "toolchain"):
        table.add_column(col, justify="right" if col in ("size", "age") else "left", no_wrap=not verbose)
    now = time.time()
    for e in entries:
        tool = made_by(e) if verbose else toolchain_id(e)
        graph = "ok" if present[e.key] else "missing"
        table.add_row(e.key[:10], e.piece, human(e.bytes), age(now - e.created), graph, tool)
    out.print(table)
    out.print(f"{len(entries)} entries, {human(sum(e.bytes for e in entries))}")
    if not verbose:
        for tid, full in sorted({(toolchain_id(e), made_by(e)) for e in entries}):
            out.print(f"toolchain {tid}: {full}", highlight=False)


@cache_app.command(short_help="Remove old entries, or the oldest beyond a size.")
def prune(
    cache_dir: StoreOpt = None,
    older_than_days: Annotated[
        float | None, typer.Option(min=0, help="Remove entries compiled more than this many days ago")
    ] = None,
    max_size: Annotated[
        str | None, typer.Option(help="Then remove the oldest entries until the rest fit, e.g. 10GB")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List what would be removed; remove nothing")
    ] = False,
) -> None:
    """Remove old entries, or the oldest beyond a size; artifact directories keep their own links."""
    if older_than_days is None and max_size is None:
        raise ValueError("nb cache prune: give --older-than-days, --max-size or both")
    store = _store(cache_dir)
    older = None if older_than_days is None else older_than_days * 86400
    removed = prune_store(store, older, None if max_size is None else parse_size(max_size), dry_run=dry_run)
    freed = human(sum(e.bytes for e in removed))
    if dry_run:
        for e in removed:
            out.print(f"would remove {e.key[:10]} {e.piece} ({human(e.bytes)})", highlight=False)
        out.print(f"would remove {len(removed)} entries, {freed}, from {store.location} (dry run)")
        return
    out.print(f"removed {len(removed)} entries, {freed}, from {store.location}")


def _sync(direction: str, remote: str, local: Path | None) -> None:
    cache = GraphCache.open(remote, local)
    if cache.remote is None:
        raise ValueError(f"nb cache {direction}: {remote} is not a URL; give the remote store as s3://... or file://...")
    cache.check()
    if direction == "pull" and not cache.remote.exists():
        raise cache.remote.error("nothing is there to pull")
    damaged = lambda why: err.print(f"damaged: {why}")  # noqa: E731
    count: SyncCount = cache.push(damaged) if direction == "push" else cache.pull(damaged)
    source, dest = (cache.local, cache.remote) if direction == "push" else (cache.remote, cache.local)
    out.print(
        f"copied {count.copied} entries from {source.location} to {dest.location}; "
        f"{count.present} were there already, {count.damaged} damaged (discarded)"
    )


@cache_app.command()
def push(remote: RemoteArg, cache_dir: LocalOpt = None) -> None:
    """Copy the local entries the remote store lacks to it."""
    _sync("push", remote, cache_dir)


@cache_app.command(short_help="Copy the remote entries the local store lacks, checked.")
def pull(remote: RemoteArg, cache_dir: LocalOpt = None) -> None:
    """Copy the remote entries the local store lacks from it, each checked against its sha256."""
    _sync("pull", remote, cache_dir)


def register(app: typer.Typer) -> None:
    """Add ``nb cache`` to the ``nb`` app."""
    app.add_typer(cache_app, name="cache", short_help="The graph cache: list, prune, push, pull.")

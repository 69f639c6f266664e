"""Clearing a graph store: ``nb cache prune``, and what killed compiles left behind.

Other compiles share a store, so a temp file, or a graph whose record is not written yet, is
stale only once no compile could still be writing it: far longer than any one piece's compile.
"""

from __future__ import annotations

import datetime as dt
import re
import shutil
import time
from pathlib import Path

from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.store_entry import SHA_IN_NAME, StoreEntry

GRAPH_NAME = re.compile(rf"[0-9a-f]{{64}}\.[0-9a-f]{{{SHA_IN_NAME}}}\.\w+")
# A local store's temp files (".<name>.<random>.tmp") and compile scratch dirs (".scratch-<random>.tmp").
TEMP_NAME = re.compile(r"\.([0-9a-f]{64}\.[\w.]+|scratch-\w+)\.tmp")
STALE_AFTER_S = 24 * 3600


def remove_stale_temps(store: GraphStore, older_than_s: float = STALE_AFTER_S) -> list[str]:
    """Delete what killed compiles left in a local store (a graph's size each), by name and age."""
    root = Path(store.root)
    if not store.local or not root.is_dir():
        return []
    cutoff = time.time() - older_than_s
    stale = [
        p for p in root.iterdir()
        if TEMP_NAME.fullmatch(p.name) and not p.is_symlink() and p.lstat().st_mtime < cutoff
    ]
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return [p.name for p in stale]


def prune_store(store: GraphStore, older_than_s: float | None = None,
                max_bytes: int | None = None, dry_run: bool = False) -> list[StoreEntry]:
    """Remove entries made more than ``older_than_s`` ago, then the oldest until the rest hold
    at most ``max_bytes``; also graphs that no record names once they are a day old (a publish
    killed between its graph and its record) and stale temps. Returns the entries removed, or
    with ``dry_run`` those it would remove, removing nothing."""
    now = time.time()
    names = store.names()
    entries = sorted(store.entries(names), key=lambda e: e.created)
    doomed = [e for e in entries if older_than_s is not None and now - e.created > older_than_s]
    kept = [e for e in entries if e not in doomed]
    total = sum(e.bytes for e in kept)
    while max_bytes is not None and kept and total > max_bytes:
        doomed.append(victim := kept.pop(0))
        total -= victim.bytes
    if dry_run:
        return doomed
    for e in doomed:
        store.discard(e.key, e.ext, e)
    named = {e.graph_name for e in entries}  # the doomed ones' graphs are gone already
    with store.io("cannot remove orphaned graphs"):
        for name, info in names.items():
            if GRAPH_NAME.fullmatch(name) and name not in named and now - _mtime(info) > STALE_AFTER_S:
                store.fs.rm_file(store.path(name))
    remove_stale_temps(store)
    return doomed


def _mtime(info: dict) -> float:
    """An object's modification time from fsspec's info: local stores give seconds, S3 a datetime."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if isinstance(value, dt.datetime):
        return value.timestamp()
    return float(value) if value is not None else time.time()

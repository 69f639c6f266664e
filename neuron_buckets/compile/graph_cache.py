"""The graph cache a compile uses: this machine's store and, optionally, a shared remote one.

Artifact directories hard-link graphs from the local store, so a graph found only in the remote
store is pulled into the local one first, its sha256 checked. With a remote store, every graph a
compile uses ends up there too (local hits it lacks are pushed), so the next machine finds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.store_entry import StoreEntry
from neuron_buckets.utils.cache_dir import default_cache_dir

Damaged = Callable[[str], None]  # told of each damaged entry that is discarded


@dataclass(frozen=True)
class Hit:
    path: Path  # the verified graph in the local store
    entry: StoreEntry
    source: str  # "local" or "remote"


@dataclass
class SyncCount:
    copied: int = 0
    present: int = 0
    damaged: int = 0


class GraphCache:
    def __init__(self, local: GraphStore, remote: GraphStore | None = None) -> None:
        self.local, self.remote = local, remote
        self.remote_names: set[str] = set()

    @classmethod
    def open(cls, cache_dir: str | Path, local_dir: Path | None = None) -> GraphCache:
        """A path is the local store; a URL is a remote store, with ``local_dir`` (default: the
        user cache) as the local one."""
        store = GraphStore(cache_dir)
        if not store.is_url:
            return cls(store)
        return cls(GraphStore(local_dir or default_cache_dir()), store)

    @property
    def shared(self) -> GraphStore:
        """Where compiles publish: the remote store if there is one."""
        return self.remote or self.local

    def check(self) -> None:
        """Reach the remote store once before any work, and list what it holds; the local store
        must take writes (every compile and pull publishes into it)."""
        self.local.check_writable()
        if self.remote:
            self.remote.check()
            self.remote_names = set(self.remote.names())

    def get(self, key: str, ext: str, damaged: Damaged, listed: bool = True) -> Hit | None:
        """The verified graph of ``key``, pulled from the remote store if only it has it.

        ``listed``: trust the listing taken by ``check`` for what the remote holds (one request
        for a whole grid); False asks the remote store itself: after a compile, which has just
        published the graph there (so the local hit needs no push).
        """
        if self.remote and not listed:
            self.remote_names.add(StoreEntry.record_name(key, ext))
        if hit := self._local(key, ext, damaged):
            self.share(hit.path, hit.entry)
            return hit
        if self.remote and (not listed or StoreEntry.record_name(key, ext) in self.remote_names):
            return self._pull(key, ext, damaged)
        return None

    def share(self, graph: Path, entry: StoreEntry) -> None:
        """Push a graph to the remote store unless its listing has the entry already."""
        name = StoreEntry.record_name(entry.key, entry.ext)
        if self.remote and name not in self.remote_names:
            self.remote.publish(graph, entry)
            self.remote_names.add(name)

    def _record(self, store: GraphStore, key: str, ext: str, damaged: Damaged) -> StoreEntry | None:
        try:
            return store.read_record(key, ext)
        except ValueError as e:
            self._discard(store, key, ext, None, str(e), damaged)
            return None

    def _discard(self, store: GraphStore, key: str, ext: str, entry: StoreEntry | None, why: str,
                 damaged: Damaged) -> None:
        damaged(f"{store.location}: entry {key[:12]} is damaged ({why}); discarded")
        store.discard(key, ext, entry)

    def _local(self, key: str, ext: str, damaged: Damaged) -> Hit | None:
        entry = self._record(self.local, key, ext, damaged)
        if entry is None:
            return None
        if path := self.local.verified(entry):
            return Hit(path, entry, "local")
        self._discard(self.local, key, ext, entry, "its graph does not match its sha256", damaged)
        return None

    def _pull(self, key: str, ext: str, damaged: Damaged) -> Hit | None:
        assert self.remote is not None
        entry = self._record(self.remote, key, ext, damaged)
        if entry is None:
            return None
        with self.local.scratch() as scratch:
            copy = scratch / entry.graph_name
            if not self.remote.fetch(entry, copy):
                self._discard(self.remote, key, ext, entry, "its graph does not match its sha256", damaged)
                return None
            self.remote_names.add(StoreEntry.record_name(key, ext))
            held = self.local.publish(copy, entry)
        if held.sha256 == entry.sha256:  # the bytes just checked, now linked into the local store
            return Hit(self.local.graph_file(held), held, "remote")
        return self._local(key, ext, damaged)  # another compile here published first: check theirs

    def push(self, damaged: Damaged) -> SyncCount:
        """Copy every local entry the remote store lacks (``nb cache push``)."""
        assert self.remote is not None
        return self._sync(self.local, self.remote, lambda entry: self._push(entry, damaged))

    def pull(self, damaged: Damaged) -> SyncCount:
        """Copy every remote entry the local store lacks (``nb cache pull``), each one checked."""
        assert self.remote is not None
        return self._sync(self.remote, self.local, lambda e: self._pull(e.key, e.ext, damaged) is not None)

    @staticmethod
    def _sync(source: GraphStore, dest: GraphStore, copy: Callable[[StoreEntry], bool]) -> SyncCount:
        count = SyncCount()
        there = {(e.key, e.ext) for e in dest.entries()}
        for entry in source.entries():
            if (entry.key, entry.ext) in there:
                count.present += 1
            elif copy(entry):
                count.copied += 1
            else:
                count.damaged += 1
        return count

    def _push(self, entry: StoreEntry, damaged: Damaged) -> bool:
        assert self.remote is not None
        if path := self.local.verified(entry):
            self.remote.publish(path, entry)
            return True
        self._discard(self.local, entry.key, entry.ext, entry, "its graph does not match its sha256", damaged)
        return False

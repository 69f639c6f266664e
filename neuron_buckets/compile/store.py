"""A graph store: compiled graphs by key, in a local directory or behind any fsspec URL (s3://...).

An entry is two objects: the graph, named by its key and content, and its record (``StoreEntry``),
the commit point, created exclusively once the graph is complete. So a reader sees a whole entry
or none, two writers of one key never overwrite each other's bytes, and the first record wins:
the other writer removes its graph and uses the winner's. Every graph is used only after its
bytes match the record's sha256; a damaged entry is discarded and compiled again. Only finished
compiles are published, so a failure is never cached.

How "exclusively" is kept depends on the store. A local directory creates the record by a hard
link, which fails when the name exists (atomic, first wins). s3fs sends a conditional put
(``If-None-Match: *``), which S3 and its compatible servers refuse once the key exists. Other
fsspec protocols get fsspec's ``mode="create"``, which checks and then writes: two writers in
the same instant may both write, the last record stays, and each record still points at its own
intact graph, so nothing is corrupted, but a store that does not write objects whole may show a
reader a partial record, which counts as damaged and costs one compile.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import fsspec
from fsspec.implementations.local import LocalFileSystem

from neuron_buckets.compile.store_entry import StoreEntry, signing_key
from neuron_buckets.utils.errors import UserError
from neuron_buckets.utils.files import fsync, intact, link_or_copy, temp_beside
from neuron_buckets.utils.owner_only import check_owner_only

RECORD_NAME = re.compile(r"([0-9a-f]{64})\.(\w+)\.json")


class StoreError(UserError, RuntimeError):
    """A graph store cannot be used: a bad URL, missing credentials, an unreachable endpoint."""


def _why(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class GraphStore:
    def __init__(self, location: str | Path) -> None:
        self.location = str(location)
        self.is_url = "://" in self.location
        try:
            if self.is_url:
                # Fresh instances, no listing cache: other machines write the store meanwhile.
                fs, root = fsspec.url_to_fs(self.location, skip_instance_cache=True, use_listings_cache=False)
            else:
                fs, root = LocalFileSystem(), str(Path(self.location).absolute())
        except Exception as e:  # the protocol's own too: an ftp:// store connects as it is made
            raise self.error(_why(e)) from None
        if not root.strip("/"):
            raise self.error("the URL names no bucket or path")
        self.fs, self.root = fs, root.rstrip("/") or "/"
        self.local = isinstance(fs, LocalFileSystem)
        if self.local and Path(self.root).exists() and not Path(self.root).is_dir():
            raise self.error("it is a file, not a directory")

    def error(self, what: str) -> StoreError:
        return StoreError(f"graph store {self.location}: {what}")

    @contextlib.contextmanager
    def io(self, doing: str) -> Iterator[None]:
        """Whatever the storage raises (its clients have their own error types: credentials,
        endpoints, HTTP) becomes one StoreError naming the store and what was being done."""
        try:
            yield
        except StoreError:
            raise
        except Exception as e:
            raise self.error(f"{doing}: {_why(e)}") from e

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def graph_file(self, entry: StoreEntry) -> Path:
        """The graph of an entry in a local store (where it can be hard-linked from)."""
        return Path(self.path(entry.graph_name))

    def check(self) -> None:
        """Reach the store once, before any work: endpoint, credentials, bucket. A prefix that
        holds nothing yet is an empty store; a bucket that does not exist is an error."""
        self.names()
        if not self.local:
            bucket = self.root.split("/", 1)[0]
            with self.io("cannot reach it"):
                exists = self.fs.exists(bucket)
            if not exists:
                raise self.error(f"{bucket!r} does not exist")

    def exists(self) -> bool:
        """Whether anything is at the root: a store to pull from must exist, one to publish to may not yet."""
        with self.io("cannot reach it"):
            return bool(self.fs.exists(self.root))

    def check_writable(self) -> None:
        """A local store this compile will publish into can be written, said once up front instead
        of as a traceback per piece (a read-only cache directory, a full or foreign disk). Nothing
        is created: a store not made yet needs its nearest existing parent writable."""
        root = Path(self.root)
        while not root.exists() and root != root.parent:
            root = root.parent
        try:
            with tempfile.NamedTemporaryFile(dir=root, prefix=".scratch-probe.", suffix=".tmp"):
                pass
        except OSError as e:
            raise self.error(f"cannot write into it ({e.strerror or e}); give --cache-dir a writable "
                             f"directory") from None

    def names(self) -> dict[str, dict]:
        """Every object directly under the root, by name, with fsspec's info (size, times)."""
        with self.io("cannot list it"):
            try:
                infos = self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                return {}
        return {PurePosixPath(i["name"]).name: i for i in infos}

    def read_record(self, key: str, ext: str) -> StoreEntry | None:
        """The entry's record; None if there is none (or something else sits at its name);
        ValueError if it is there but not a whole record."""
        with self.io(f"cannot read the record of {key[:12]}"):
            try:
                data = self.fs.cat_file(self.path(StoreEntry.record_name(key, ext)))
            except (FileNotFoundError, IsADirectoryError):
                return None
        return StoreEntry.from_json(data).check_signature(signing_key())

    def entries(self, names: dict[str, dict] | None = None) -> list[StoreEntry]:
        """Every readable record (one listing, one batched read); damaged records are skipped."""
        names = self.names() if names is None else names
        paths = [self.path(n) for n in sorted(names) if RECORD_NAME.fullmatch(n)]
        with self.io("cannot read its records"):
            data = self.fs.cat(paths, on_error="omit") if paths else {}
        entries = []
        key = signing_key()
        for raw in data.values():
            with contextlib.suppress(ValueError):
                entries.append(StoreEntry.from_json(raw).check_signature(key))
        return entries

    def fetch(self, entry: StoreEntry, dest: Path) -> bool:
        """Copy an entry's graph to the local file ``dest``; True only if its bytes match the record."""
        with self.io(f"cannot read the graph of {entry.piece}"):
            try:
                self.fs.get_file(self.path(entry.graph_name), str(dest))
            except FileNotFoundError:
                return False
        return intact(dest, entry.sha256, entry.bytes)

    def verified(self, entry: StoreEntry) -> Path | None:
        """A local store's graph of ``entry`` if its bytes still match the record, else None.
        The store, the record and the graph must be owner-writable only (``owner_only.py``):
        what is linked from here into an artifact directory runs as native code there."""
        path = self.graph_file(entry)
        for what, p in (("graph store", Path(self.root)), ("graph store record", Path(self.path(
                StoreEntry.record_name(entry.key, entry.ext)))), ("graph store entry", path)):
            check_owner_only(p, what)
        return path if intact(path, entry.sha256, entry.bytes) else None

    def publish(self, graph: Path, entry: StoreEntry) -> StoreEntry:
        """Put the graph, then create its record exclusively. Returns the entry the store now holds:
        ours, or the one another compile published first (then our graph goes, unless it is theirs).
        With ``NB_STORE_SIGNING_KEY`` set, the record is signed (``store_entry.py``)."""
        entry = entry.signed(signing_key())
        graph_path = self.path(entry.graph_name)
        record_path = self.path(StoreEntry.record_name(entry.key, entry.ext))
        with self.io(f"cannot publish {entry.piece}"):
            self._put(graph, graph_path)
            try:
                self._create(record_path, entry.to_json())
                return entry
            except FileExistsError:
                pass
        try:
            winner = self.read_record(entry.key, entry.ext)
        except ValueError as e:
            raise self.error(f"cannot publish {entry.piece}: {record_path} is damaged ({e})") from None
        if winner is None:
            raise self.error(f"cannot publish {entry.piece}: {record_path} exists and is not a record")
        if winner.graph_name != entry.graph_name:
            with self.io(f"cannot remove a duplicate of {entry.piece}"):
                self.fs.rm_file(graph_path)
        return winner

    def discard(self, key: str, ext: str, entry: StoreEntry | None = None) -> None:
        """Remove a damaged entry: its record, then its graph when the record still named one."""
        names = [StoreEntry.record_name(key, ext)] + ([entry.graph_name] if entry else [])
        with self.io(f"cannot remove the damaged entry {key[:12]}"):
            for name in names:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    self.fs.rm_file(self.path(name))

    def _put(self, graph: Path, dest: str) -> None:
        """Put a graph object. Its name holds its sha256, so replacing one only rewrites the same bytes."""
        if not self.local:
            self.fs.put_file(str(graph), dest)
            return
        # Same disk (the compile scratch lives in the store): a link, no copy. Whatever the
        # umask, 0644: a group-writable entry is refused on use.
        link_or_copy(graph, Path(dest), mode=0o644)

    def _create(self, dest: str, data: bytes) -> None:
        """Write ``dest`` whole, only if nothing is there yet (FileExistsError otherwise)."""
        if not self.local:
            self.fs.pipe_file(dest, data, mode="create")
            return
        with temp_beside(Path(dest)) as tmp:
            tmp.write_bytes(data)
            tmp.chmod(0o644)
            fsync(tmp)
            try:
                os.link(tmp, dest)  # atomic, and refuses an existing name
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links: atomic, but the last writer wins
                os.replace(tmp, dest)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        """A private directory to compile into: inside a local store (publishing is then a link,
        not a copy of what may be a large graph), in the system's temp dir for a remote one."""
        if self.local:
            Path(self.root).mkdir(parents=True, exist_ok=True)
        where = self.root if self.local else None
        with tempfile.TemporaryDirectory(prefix=".scratch-", suffix=".tmp", dir=where) as d:
            yield Path(d)

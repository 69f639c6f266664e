"""``GraphStore``: atomic, exclusive publishing, checked reads, pruning and clear errors, on a local
directory and on S3 (moto's server on 127.0.0.1, reached through s3fs)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from neuron_buckets.compile.graph_cache import GraphCache
from neuron_buckets.compile.store import GraphStore, StoreError
from neuron_buckets.compile.store_entry import StoreEntry
from neuron_buckets.compile.store_sweep import STALE_AFTER_S, prune_store

KEY = "ab" * 32


def entry_for(graph: Path, key: str = KEY, created: float | None = None, piece: str = "layer_t16_b1_c128"):
    data = graph.read_bytes()
    return StoreEntry(
        key=key,
        ext="pt2",
        sha256=hashlib.sha256(data).hexdigest(),
        bytes=len(data),
        compile_seconds=3.5,
        piece=piece,
        backend="inductor",
        versions={"torch": "x"},
        toolchain="0.1.0",
        created=time.time() if created is None else created,
    )


def graph_file(directory: Path, data: bytes, name: str = "g.pt2") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (path := directory / name).write_bytes(data)
    return path


@pytest.fixture(params=["local", "file-url", "s3"])
def store(request, tmp_path) -> GraphStore:
    if request.param == "local":
        return GraphStore(tmp_path / "store")
    if request.param == "file-url":  # a shared filesystem, named as a URL: the remote tier
        return GraphStore(f"file://{tmp_path}/store")
    bucket = request.getfixturevalue("s3_bucket")
    return GraphStore(f"s3://{bucket}/graphs")


def test_a_published_entry_reads_back_whole_and_checked(store, tmp_path):
    store.check()
    assert store.names() == {} and store.read_record(KEY, "pt2") is None  # an empty store
    graph = graph_file(tmp_path / "w", b"graph bytes" * 100)
    entry = entry_for(graph)
    assert store.publish(graph, entry) == entry
    assert store.read_record(KEY, "pt2") == entry
    assert set(store.names()) == {entry.graph_name, StoreEntry.record_name(KEY, "pt2")}
    assert store.entries() == [entry]
    assert store.fetch(entry, tmp_path / "copy") and (tmp_path / "copy").read_bytes() == graph.read_bytes()


def test_the_first_record_wins_and_the_loser_uses_it(store, tmp_path):
    first = graph_file(tmp_path / "a", b"first compile")
    second = graph_file(tmp_path / "b", b"second compile, other bytes")
    winner = store.publish(first, entry_for(first))
    assert store.publish(second, entry_for(second)) == winner
    assert set(store.names()) == {
        winner.graph_name,
        StoreEntry.record_name(KEY, "pt2"),
    }  # the loser's graph went


def _publish_at_once(location: str, data: bytes, barrier, results) -> None:
    graph = graph_file(Path(location.replace("://", "_").replace("/", "_")) / str(os.getpid()), data)
    barrier.wait()
    results.put(GraphStore(location).publish(graph, entry_for(graph)).sha256)


def test_writers_of_one_key_at_the_same_instant_leave_exactly_one_entry(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(4), context.Queue()
    writers = [
        context.Process(
            target=_publish_at_once, args=(store.location, f"compile {i}".encode() * 50, barrier, results)
        )
        for i in range(4)
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    held = {results.get(timeout=10) for _ in writers}
    record = store.read_record(KEY, "pt2")
    assert held == {record.sha256}  # every writer ends up using the one entry that won
    assert set(store.names()) == {record.graph_name, StoreEntry.record_name(KEY, "pt2")}
    assert store.fetch(record, tmp_path / "check")


def test_a_damaged_entry_is_caught_discarded_and_published_again(store, tmp_path):
    def cache_on(local: Path) -> GraphCache:  # a machine: its local store, and the shared one
        cache = GraphCache(GraphStore(local), store) if store.is_url else GraphCache(store)
        cache.check()
        return cache

    good = b"good graph" * 10
    graph = graph_file(tmp_path / "w", good)
    entry = store.publish(graph, entry_for(graph))  # in a local store, a hard link of ``graph``
    with store.fs.open(store.path(entry.graph_name), "wb") as f:  # truncated behind the record's back
        f.write(b"good")
    damaged = []
    assert cache_on(tmp_path / "a").get(KEY, "pt2", damaged.append) is None
    assert len(damaged) == 1 and "does not match its sha256" in damaged[0] and store.location in damaged[0]
    assert store.names() == {}  # discarded: the next compile publishes afresh
    assert store.publish(graph_file(tmp_path / "again", good), entry) == entry
    hit = cache_on(tmp_path / "b").get(KEY, "pt2", damaged.append)
    assert hit and hit.path.read_bytes() == good and len(damaged) == 1


def test_a_truncated_record_counts_as_damaged(store, tmp_path):
    graph = graph_file(tmp_path / "w", b"graph")
    store.publish(graph, entry_for(graph))
    record = store.path(StoreEntry.record_name(KEY, "pt2"))
    store.fs.pipe_file(record, store.fs.cat_file(record)[:20])
    with pytest.raises(ValueError, match="not a graph store record"):
        store.read_record(KEY, "pt2")
    assert store.entries() == []


def test_prune_by_age_then_size_keeps_the_newest(store, tmp_path):
    now = time.time()
    entries = []
    for i, days in enumerate((40, 20, 10, 1)):
        graph = graph_file(tmp_path / str(i), bytes([i]) * 1000)
        entries.append(store.publish(graph, entry_for(graph, key=f"{i:x}" * 64, created=now - days * 86400)))
    assert prune_store(store, older_than_s=30 * 86400) == entries[:1]
    assert prune_store(store, max_bytes=2500) == entries[1:2]
    assert sorted(e.key for e in store.entries()) == sorted(e.key for e in entries[2:])
    assert len(store.names()) == 4  # two records, two graphs


def test_prune_removes_graphs_no_record_names_only_once_they_are_old(tmp_path):
    store = GraphStore(tmp_path)
    orphan = graph_file(tmp_path, b"killed between graph and record", f"{KEY}.{'1' * 16}.pt2")
    young = graph_file(tmp_path, b"a publish in flight", f"{KEY}.{'2' * 16}.pt2")
    old = time.time() - STALE_AFTER_S - 60
    os.utime(orphan, (old, old))
    assert prune_store(store, older_than_s=1) == []
    assert not orphan.exists() and young.exists()


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("foo://bucket/x", "graph store foo://bucket/x: Protocol not known: foo"),
        ("s3://", "graph store s3://: the URL names no bucket or path"),
        ("gcs://bucket/x", "graph store gcs://bucket/x: "),
        ("ftp://no-such-host.invalid/x", "graph store ftp://no-such-host.invalid/x: "),
    ],
    ids=["unknown-protocol", "no-bucket", "protocol-not-installed", "protocol-connects-as-made"],
)
def test_a_bad_url_is_one_error_naming_the_store(location, message):
    with pytest.raises(StoreError) as refused:
        GraphStore(location).check()
    assert str(refused.value).startswith(message)


def test_a_missing_bucket_is_an_error_not_an_empty_store(s3_bucket):
    with pytest.raises(
        StoreError, match="graph store s3://no-such-bucket-here/g: 'no-such-bucket-here' does not"
    ):
        GraphStore("s3://no-such-bucket-here/g").check()


def test_records_are_plain_json_with_what_ls_shows(tmp_path):
    store = GraphStore(tmp_path)
    graph = graph_file(tmp_path / "w", b"x")
    entry = store.publish(graph, entry_for(graph))
    raw = json.loads((tmp_path / StoreEntry.record_name(KEY, "pt2")).read_text())
    assert raw["sha256"] == entry.sha256 and raw["piece"] == "layer_t16_b1_c128"
    assert raw["toolchain"] == "0.1.0" and raw["versions"] == {"torch": "x"}


@pytest.mark.parametrize("target", ["store", "record", "graph"])
def test_a_local_entry_others_can_write_is_refused_with_the_chmod_that_fixes_it(tmp_path, target):
    """An entry is native code an artifact links: a group-writable one is never used."""
    from neuron_buckets.utils.owner_only import LoosePermissions

    store = GraphStore(tmp_path / "store")
    graph = graph_file(tmp_path / "w", b"graph bytes")
    entry = store.publish(graph, entry_for(graph))
    assert store.verified(entry) == store.graph_file(entry)
    path = {"store": tmp_path / "store", "record": tmp_path / "store" / StoreEntry.record_name(KEY, "pt2"),
            "graph": store.graph_file(entry)}[target]
    path.chmod(path.stat().st_mode | 0o020)
    with pytest.raises(LoosePermissions, match=f"chmod go-w {path}"):
        store.verified(entry)


def test_a_store_named_by_a_file_or_unwritable_or_missing_is_one_error_up_front(tmp_path, monkeypatch):
    """Probes 8 and 10: a file as --cache-dir, a read-only one, a pull from nowhere (which said
    "copied 0 entries" and exited 0)."""
    (afile := tmp_path / "afile").write_text("")
    with pytest.raises(StoreError, match=f"graph store {afile}: it is a file, not a directory"):
        GraphStore(afile)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    store = GraphStore(tmp_path / "ro")
    monkeypatch.setattr("tempfile.NamedTemporaryFile", refuse)  # a read-only directory, even for root
    with pytest.raises(StoreError, match=r"ro: cannot write into it \(Permission denied\)"):
        GraphCache(store).check()
    monkeypatch.undo()
    assert not GraphStore(f"file://{tmp_path}/nowhere").exists()


def test_nb_cache_pull_from_a_store_that_is_not_there_is_an_error(tmp_path):
    from typer.testing import CliRunner

    from neuron_buckets.cli import app
    from tests.conftest import error_line

    args = ["cache", "pull", f"file://{tmp_path}/nowhere", "--cache-dir", str(tmp_path / "c")]
    result = CliRunner().invoke(app, args)
    assert "nothing is there to pull" in error_line(result)


def test_with_a_signing_key_only_records_signed_with_it_are_used(tmp_path, monkeypatch):
    """Probe 13: anyone who can write a shared store could publish code under a key not built yet.
    With NB_STORE_SIGNING_KEY, an unsigned or forged record is damaged: discarded, then rebuilt."""
    from neuron_buckets.compile.store_entry import SIGNING_KEY_ENV

    shared = GraphStore(f"file://{tmp_path}/shared")
    evil = graph_file(tmp_path / "evil", b"attacker's code")
    shared.publish(evil, entry_for(evil))  # written without the key: what an intruder can do
    monkeypatch.setenv(SIGNING_KEY_ENV, "team secret")
    with pytest.raises(ValueError, match="unsigned: not published with this machine's NB_STORE_SIGNING_KEY"):
        shared.read_record(KEY, "pt2")
    assert shared.entries() == []
    damaged: list[str] = []
    cache = GraphCache(GraphStore(tmp_path / "local"), shared)
    assert cache.get(KEY, "pt2", damaged.append, listed=False) is None and "unsigned" in damaged[0]
    assert StoreEntry.record_name(KEY, "pt2") not in shared.names()  # the key is free for a signed compile
    good = graph_file(tmp_path / "good", b"our graph")
    held = shared.publish(good, entry_for(good))
    assert held.signature and shared.read_record(KEY, "pt2") == held
    monkeypatch.setenv(SIGNING_KEY_ENV, "another secret")  # a forger's key
    with pytest.raises(ValueError, match="its signature does not match"):
        shared.read_record(KEY, "pt2")
    monkeypatch.delenv(SIGNING_KEY_ENV)
    assert json.loads(shared.fs.cat_file(shared.path(StoreEntry.record_name(KEY, "pt2"))))["signature"]

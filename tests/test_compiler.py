"""``Compiler``: reuse, incremental builds, failures, fail-fast, kill and resume, the lock, the manifest.

Most tests use the eager backend, whose "compile" takes milliseconds, so they exercise the real
worker processes, store and manifest without compile time. Failures are injected where a real
compile can fail: a cache entry that cannot be written, a worker process that dies. The slow tests
use inductor and reuse the session's compiled pieces, so together they compile one layer piece.

The tiny grid's four buckets run as eight pieces: the dynamic embed and head every bucket shares,
one decoder-layer piece per bucket shape, and each packed bucket's fresh layer (over no context).
Outcomes, cache entries and graph files are per piece; the manifest's buckets say which pieces run
them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import jsonschema
import pytest
import torch

from neuron_buckets.artifact.manifest import ManifestError, PieceRecord, read_manifest, read_manifest_dict
from neuron_buckets.compile.compile_report import CompileReport
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.compile.directory_lock import DirectoryLocked, directory_lock
from neuron_buckets.compile.local_executor import LocalExecutor
from neuron_buckets.compile.outcome import Outcome
from neuron_buckets.compile.output_dir import OutputDirError
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.store_entry import StoreEntry
from neuron_buckets.config import Config, load_config
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.model.pieces import PieceShape
from neuron_buckets.runtime.bucket_runtime import ArtifactError, BucketRuntime
from neuron_buckets.utils import files
from neuron_buckets.utils.files import sha256_file
from neuron_buckets.utils.package_data import read_package_data
from tests.conftest import TINY_CONFIG, prefill_plan, save_tiny_llama, write_config
from tests.worker_stops import dies_on, stopped

EAGER = TINY_CONFIG.replace('backend = "inductor"', 'backend = "eager"')
PREFILL_16, PREFILL_32 = Bucket("prefill", 2, 16, 128), Bucket("prefill", 2, 32, 128)
DECODE_1, DECODE_2 = Bucket("decode", 1, 1, 128), Bucket("decode", 2, 1, 128)
BUCKETS = (PREFILL_16, PREFILL_32, DECODE_1, DECODE_2)
EMBED, HEAD = PieceShape("embed", 0), PieceShape("head", 0)  # dynamic: one for every bucket
LAYER_16 = PieceShape("layer", 16, rows=2, ctx=128, packed=True)
LAYER_32 = PieceShape("layer", 32, rows=2, ctx=128, packed=True)
FRESH_16 = PieceShape("layer", 16, rows=2, ctx=0, packed=True)  # the fresh layers: no context
FRESH_32 = PieceShape("layer", 32, rows=2, ctx=0, packed=True)
LAYER_D1, LAYER_D2 = PieceShape("layer", 1, rows=1, ctx=128), PieceShape("layer", 2, rows=2, ctx=128)
PIECES = (EMBED, HEAD, LAYER_D1, LAYER_D2, FRESH_16, LAYER_16, FRESH_32, LAYER_32)  # the compiler's order


@pytest.fixture
def eager(hf_model_dir: Path, tmp_path: Path) -> Config:
    return load_config(write_config(tmp_path, hf_model_dir, EAGER))


def compile_(config: Config, out: Path, cache: Path, jobs: int = 1, **kw) -> CompileReport:
    fail_fast = kw.pop("fail_fast", False)
    return Compiler(config, out, cache, fail_fast=fail_fast).run(jobs, **kw)


def names(outcomes: list[Outcome]) -> list[str]:
    return [o.name for o in outcomes]


def pieces(out: Path) -> dict[str, tuple[str, PieceRecord]]:
    """The manifest's pieces by name: (key, record)."""
    return {rec.name: (key, rec) for key, rec in read_manifest(out).pieces.items()}


def records(out: Path) -> dict[str, dict]:
    """The manifest's buckets by name, as the JSON holds them."""
    return {
        Bucket(r["kind"], r["batch"], r["seq"], r["ctx"]).name: r for r in read_manifest_dict(out)["buckets"]
    }


def piece_file(out: Path, shape: PieceShape) -> Path:
    return out / pieces(out)[shape.name][1].file


def block_cache_entry(config: Config, cache: Path, shape: PieceShape) -> Path:
    """A directory where the piece's cache record must go: its compile fails at publish, alone."""
    compiler = Compiler(config, cache.parent / "out", cache)  # computes keys, writes nothing
    record = cache / StoreEntry.record_name(compiler.plan.keys[shape], compiler.plan.backend.graph_ext)
    record.mkdir(parents=True)
    return record


def test_the_tiny_grid_is_four_buckets_over_eight_shared_pieces(eager, tmp_path):
    c = Compiler(eager, tmp_path / "out", tmp_path / "cache")
    assert c.plan.buckets == list(BUCKETS)
    assert c.plan.shapes == list(PIECES)
    assert set(c.plan.keys) == set(PIECES)
    assert c.plan.bucket_pieces == {
        PREFILL_16: {"embed": EMBED, "layer": LAYER_16, "head": HEAD, "fresh_layer": FRESH_16},
        PREFILL_32: {"embed": EMBED, "layer": LAYER_32, "head": HEAD, "fresh_layer": FRESH_32},
        DECODE_1: {"embed": EMBED, "layer": LAYER_D1, "head": HEAD},
        DECODE_2: {"embed": EMBED, "layer": LAYER_D2, "head": HEAD},
    }
    assert [s.name for s in PIECES] == [
        "embed", "head", "layer_t1_b1_c128", "layer_t2_b2_c128", "layer_t16_b2_c0_packed",
        "layer_t16_b2_c128_packed", "layer_t32_b2_c0_packed", "layer_t32_b2_c128_packed",
    ]


def test_shared_pieces_appear_once_in_the_manifest_and_every_bucket_references_them(eager, tmp_path):
    out = tmp_path / "out"
    report = compile_(eager, out, tmp_path / "cache", jobs=2)
    m = read_manifest(out)
    assert sorted(r.name for r in m.pieces.values()) == sorted(s.name for s in PIECES)
    assert len({r.file for r in m.pieces.values()}) == len(m.pieces) == 8  # one file per piece
    by_name = pieces(out)
    embed_key, head_key = by_name["embed"][0], by_name["head"][0]
    assert [(b.kind, b.batch, b.seq, b.ctx) for b in m.buckets] == [
        (b.kind, b.batch, b.seq, b.ctx) for b in BUCKETS
    ]
    fresh = {PREFILL_16: FRESH_16, PREFILL_32: FRESH_32}
    for b, bucket, layer in zip(m.buckets, BUCKETS, (LAYER_16, LAYER_32, LAYER_D1, LAYER_D2), strict=True):
        want = {"embed": embed_key, "layer": by_name[layer.name][0], "head": head_key}
        if bucket in fresh:
            want["fresh_layer"] = by_name[fresh[bucket].name][0]
        assert b.pieces == want
        assert (b.status, b.error) == ("ok", None)
    assert report.buckets == m.buckets
    for key, rec in m.pieces.items():
        assert rec.role == next(s.role for s in PIECES if s.name == rec.name)
        assert rec.file == f"graphs/{key}.json" and rec.sha256 == sha256_file(out / rec.file)
        assert rec.bytes == (out / rec.file).stat().st_size > 0
    # the eager "graph" of a dynamic piece fixes no shape; a layer piece fixes its bucket's
    embed = json.loads(piece_file(out, EMBED).read_text())
    assert embed == {"piece": "EmbedPiece", "input_shapes": None}
    layer = json.loads(piece_file(out, LAYER_16).read_text())
    assert layer["piece"] == "LayerPiece" and layer["input_shapes"][0] == [16, 64]  # (tokens, hidden)


def test_second_run_compiles_nothing_and_touches_no_graph(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    first = compile_(eager, out, cache, jobs=2)
    assert names(first.compiled) == names(first.outcomes) == [s.name for s in PIECES]
    files = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "graphs").iterdir()}
    events = []
    second = compile_(eager, out, cache, jobs=2, on_event=lambda e, o: events.append((e, o.cached)))
    assert second.compiled == [] and second.failed == []
    assert events == [("done", True)] * 8  # no worker was started
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "graphs").iterdir()} == files
    assert {name: key for name, (key, _) in pieces(out).items()} == {o.name: o.key for o in first.outcomes}
    assert len(files) == 8


def test_each_graph_is_hashed_once_per_run(eager, tmp_path, monkeypatch):
    """The manifest is rewritten after every piece; re-hashing every graph each time is quadratic."""
    hashed = []
    real = files.sha256_file  # every check of the artifact's graphs, and the cache's when they are used
    monkeypatch.setattr(files, "sha256_file", lambda path: hashed.append(path) or real(path))
    for _ in range(2):  # a cold run, then a warm one that checks the graphs it reuses
        hashed.clear()
        compile_(eager, tmp_path / "out", tmp_path / "cache")
        keys = [Path(p).name.split(".")[0] for p in hashed if Path(p).suffix == ".json"]  # eager graphs
        keys = [k for k in keys if len(k) == 64]  # not the tokenizer's files
        assert len(keys) == len(set(keys)) == 8


def test_another_artifact_directory_reuses_the_shared_cache(eager, tmp_path):
    cache = tmp_path / "cache"
    compile_(eager, tmp_path / "a", cache)
    # the cost measured when a graph was compiled travels with it (nb plan fits on it): pretend
    # that one took 42 s, as a real graph would, and expect the second directory to record it
    record = cache / StoreEntry.record_name(pieces(tmp_path / "a")[LAYER_32.name][0], "json")
    record.write_text(json.dumps({**json.loads(record.read_text()), "compile_seconds": 42.0}))
    report = compile_(eager, tmp_path / "b", cache)
    assert report.compiled == [] and len(report.outcomes) == 8
    first, second = pieces(tmp_path / "a"), pieces(tmp_path / "b")
    assert first.keys() == second.keys()
    for name, (key, rec) in second.items():
        assert rec.cached and (key, rec.sha256) == (first[name][0], first[name][1].sha256)
    assert second[LAYER_32.name][1].compile_seconds == 42.0


def test_one_new_bucket_list_entry_compiles_only_its_layer_pieces(eager, hf_model_dir, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    compile_(eager, out, cache)
    before = pieces(out)
    grown = EAGER.replace("tokens_buckets = [16, 32]", "tokens_buckets = [16, 24, 32]")
    (tmp_path / "grown").mkdir()
    report = compile_(load_config(write_config(tmp_path / "grown", hf_model_dir, grown)), out, cache)
    # its layer and fresh layer; embed and head are shared, reused
    assert names(report.compiled) == ["layer_t24_b2_c0_packed", "layer_t24_b2_c128_packed"]
    assert len(report.outcomes) == 10 and report.failed == []
    assert len(records(out)) == 5
    new = records(out)[Bucket("prefill", 2, 24, 128).name]
    after = pieces(out)
    assert new["pieces"] == {
        "embed": before["embed"][0], "layer": after["layer_t24_b2_c128_packed"][0], "head": before["head"][0],
        "fresh_layer": after["layer_t24_b2_c0_packed"][0],
    }
    assert new["status"] == "ok"


def test_unchanged_weights_are_not_rewritten_and_changed_ones_are(eager, hf_model_dir, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    compile_(eager, out, cache)
    weights = out / "weights.safetensors"
    before = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    old_sha = sha256_file(weights)
    compile_(eager, out, cache)
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == before

    model_dir = tmp_path / "retrained"
    shutil.copytree(hf_model_dir, model_dir)
    save_tiny_llama(model_dir, seed=1)  # same config, new weights: graphs reused, file rewritten
    retrained = load_config(write_config(tmp_path, model_dir, EAGER))
    report = compile_(retrained, out, cache)
    assert report.compiled == [] and report.failed == []
    assert read_manifest(out).weights.sha256 == sha256_file(weights) != old_sha
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) != before


def test_a_damaged_weights_file_of_the_same_size_is_rewritten(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    compile_(eager, out, cache)
    weights = out / "weights.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    compile_(eager, out, cache)
    assert weights.read_bytes() == good
    assert BucketRuntime.open(out).run_plan(prefill_plan([([1, 2, 3], 0, [1])])).shape == (1, 256)


def test_graphs_of_pieces_dropped_from_the_grid_leave_the_directory(eager, hf_model_dir, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    compile_(eager, out, cache)
    dropped = pieces(out)[LAYER_16.name][0]
    shrunk = EAGER.replace("tokens_buckets = [16, 32]", "tokens_buckets = [32]")
    (tmp_path / "shrunk").mkdir()
    report = compile_(load_config(write_config(tmp_path / "shrunk", hf_model_dir, shrunk)), out, cache)
    assert report.compiled == [] and len(report.outcomes) == 6  # prefill 16's two layer pieces are gone
    assert LAYER_16.name not in names(report.outcomes) and "embed" in names(report.outcomes)
    assert sorted(p.name for p in (out / "graphs").iterdir()) == sorted(
        Path(r.file).name for r in read_manifest(out).pieces.values()
    )
    assert not (out / "graphs" / f"{dropped}.json").exists()
    store = GraphStore(cache)
    assert store.verified(store.read_record(dropped, "json"))  # the cache keeps the dropped piece's graph
    assert len(store.entries()) == 8


def test_a_failing_piece_is_recorded_and_the_others_finish(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    blocked = block_cache_entry(eager, cache, LAYER_32)
    report = compile_(eager, out, cache, jobs=2)
    assert names(report.failed) == [LAYER_32.name]
    assert sorted(names(report.compiled)) == sorted(s.name for s in PIECES if s != LAYER_32)

    key, rec = pieces(out)[LAYER_32.name]
    assert (rec.status, rec.sha256, rec.bytes) == ("failed", None, 0)
    assert rec.error.startswith("neuron_buckets.compile.store.StoreError")
    assert rec.error.endswith(f"{blocked} exists and is not a record")
    assert rec.log == f"logs/{LAYER_32.name}.log"
    log = (out / rec.log).read_text()
    assert "Traceback" in log and "publish" in log and rec.error in log
    assert not (out / rec.file).exists()
    buckets = records(out)  # only the bucket that runs the failed piece fails, naming it
    assert buckets[PREFILL_32.name]["status"] == "failed"
    assert buckets[PREFILL_32.name]["error"] == f"{LAYER_32.name}: {rec.error}"
    assert [n for n, r in buckets.items() if r["status"] == "ok"] == [
        b.name for b in (PREFILL_16, DECODE_1, DECODE_2)
    ]
    runtime = BucketRuntime.open(out)
    assert PREFILL_32 not in runtime.records
    assert runtime.run_plan(prefill_plan([([1, 2, 3], 0, [1])])).shape == (1, 256)

    blocked.rmdir()
    again = compile_(eager, out, cache)
    assert names(again.compiled) == [LAYER_32.name] and again.failed == []
    assert records(out)[PREFILL_32.name]["status"] == "ok"


def test_a_failing_shared_piece_fails_every_bucket_that_runs_it(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    block_cache_entry(eager, cache, HEAD)
    report = compile_(eager, out, cache, jobs=2)
    assert names(report.failed) == ["head"]
    buckets = records(out)
    assert list(buckets) == [b.name for b in BUCKETS]
    for r in buckets.values():
        assert r["status"] == "failed"
        assert r["error"].startswith("head: neuron_buckets.compile.store.StoreError")
    with pytest.raises(ArtifactError, match="needs at least one working prefill and one decode bucket"):
        BucketRuntime.open(out)


def test_fail_fast_starts_nothing_after_the_first_failure(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    block_cache_entry(eager, cache, LAYER_D1)  # the first layer piece, after embed and head
    report = compile_(eager, out, cache, jobs=1, fail_fast=True)
    assert names(report.outcomes) == ["embed", "head", LAYER_D1.name]
    assert names(report.failed) == [LAYER_D1.name]
    assert list(records(out)) == [DECODE_1.name]  # the one bucket whose pieces all finished
    assert records(out)[DECODE_1.name]["status"] == "failed"
    assert pieces(out)[LAYER_D1.name][1].status == "failed"
    compiled = sorted(e.piece for e in GraphStore(cache).entries())
    assert compiled == ["embed", "head"]  # nothing after the failure


def test_fail_fast_on_a_shared_piece_still_records_every_bucket_it_fails(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    block_cache_entry(eager, cache, EMBED)  # the first piece, shared by every bucket
    report = compile_(eager, out, cache, jobs=1, fail_fast=True)
    assert names(report.outcomes) == ["embed"]
    assert {name: r["status"] for name, r in records(out).items()} == dict.fromkeys(
        (b.name for b in Compiler(eager, out, cache).plan.buckets), "failed"
    )


def test_a_worker_that_dies_fails_only_its_piece(eager, tmp_path, monkeypatch):
    """An OOM kill or segfault breaks the worker pool; the pieces after it still compile. The
    worker dies inside its compile (a kill sent when the piece was queued raced a fast compile)."""
    monkeypatch.setattr(LocalExecutor, "run", staticmethod(partial(dies_on, LAYER_16.name)))
    out = tmp_path / "out"
    report = compile_(eager, out, tmp_path / "cache", jobs=1)
    assert names(report.failed) == [LAYER_16.name]
    assert "BrokenProcessPool" in pieces(out)[LAYER_16.name][1].error
    assert "BrokenProcessPool" in records(out)[PREFILL_16.name]["error"]
    assert sorted(names(report.compiled)) == sorted(s.name for s in PIECES if s != LAYER_16)
    assert LAYER_32.name in names(report.compiled)  # queued after the dead worker, on a fresh pool


HOLD_SCRIPT = (
    "import multiprocessing, sys, time; from pathlib import Path\n"
    "from neuron_buckets.compile.compiler import Compiler\n"
    "from neuron_buckets.config import load_config\n"
    "def hold(event, outcome):  # a worker is started: name it, then stay in the run until killed\n"
    "    print(*[p.pid for p in multiprocessing.active_children()], flush=True)\n"
    "    time.sleep(600)\n"
    "Compiler(load_config(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])).run(1, hold)\n"
)


def running(pid: int) -> bool:
    """Alive and not a zombie (a dead orphan may wait a moment to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_workers_do_not_outlive_a_killed_compile(tmp_path, hf_model_dir):
    """``kill -9`` of nb compile alone (not its process group) must not leave workers behind."""
    config = write_config(tmp_path, hf_model_dir, EAGER)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_SCRIPT, str(config), str(tmp_path / "out"), str(tmp_path / "cache")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        (worker,) = map(int, proc.stdout.readline().split())
        assert running(worker)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while running(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(worker), f"worker {worker} outlived the killed compile"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_second_compile_of_the_same_directory_is_refused(eager, tmp_path):
    out = tmp_path / "out"
    with directory_lock(out), pytest.raises(DirectoryLocked) as refused:
        compile_(eager, out, tmp_path / "cache")
    message = str(refused.value)
    assert str(out) in message and f"pid {os.getpid()}" in message and "another --out" in message
    assert not (out / "manifest.json").exists()
    assert compile_(eager, out, tmp_path / "cache").failed == []  # the lock went with its holder


def test_unknown_inductor_flag_is_refused_before_compiling(hf_model_dir, tmp_path):
    text = TINY_CONFIG + "\n[compile.flags]\nno_such_option = 1\n"
    config = load_config(write_config(tmp_path, hf_model_dir, text))
    with pytest.raises(ValueError, match="no_such_option"):
        Compiler(config, tmp_path / "out", tmp_path / "cache")


def test_a_graph_edited_in_place_is_caught_and_rebuilt_by_the_next_compile(eager, tmp_path):
    """Artifact graphs are hard links into the cache: the edit reaches the cache entry too."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    compile_(eager, out, cache)
    _, rec = pieces(out)[FRESH_16.name]  # the layer a fresh prompt runs
    good = (out / rec.file).read_bytes()
    with open(out / rec.file, "r+b") as f:  # in place, as an editor or bit rot would
        f.write(b"[]" + b" " * (len(good) - 2))

    with pytest.raises(ArtifactError, match=f"of piece {FRESH_16.name} does not match its sha256"):
        BucketRuntime.open(out).run_plan(prefill_plan([([1, 2, 3], 0, [1])]))
    report = compile_(eager, out, cache)
    assert names(report.compiled) == [FRESH_16.name]
    assert (out / rec.file).read_bytes() == good
    assert pieces(out)[FRESH_16.name][1].sha256 == rec.sha256
    BucketRuntime.open(out).run_plan(prefill_plan([([1, 2, 3], 0, [1])]))


@pytest.mark.parametrize(
    "damage",
    [lambda data: data[:200], lambda data: data[:10] + b"\xff" + data[11:]],
    ids=["truncated", "not-utf8"],
)
def test_a_damaged_manifest_is_refused_on_load_and_rebuilt_from_the_cache(eager, tmp_path, damage):
    """Not recognisably ours, so compile refuses to overwrite it; once the user removes it, the
    directory (still holding nb's lock file) is rebuilt from the cache."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    compile_(eager, out, cache)
    manifest = out / "manifest.json"
    manifest.write_bytes(damaged := damage(manifest.read_bytes()))
    with pytest.raises(ManifestError, match="not valid JSON"):
        BucketRuntime.open(out)
    with pytest.raises(OutputDirError, match="not valid JSON.*choose another --out"):
        compile_(eager, out, cache)
    assert manifest.read_bytes() == damaged
    manifest.unlink()
    report = compile_(eager, out, cache)
    assert report.compiled == [] and len(report.outcomes) == 8
    assert len(BucketRuntime.open(out).records) == 4


def first_piece(m: dict) -> dict:
    return m["pieces"][m["buckets"][0]["pieces"]["layer"]]


def first_key(m: dict) -> str:
    return m["buckets"][0]["pieces"]["layer"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda m: first_piece(m).update(sha256="0" * 64), ArtifactError,
         r"of piece layer_t16_b2_c128_packed does not match its sha256"),
        (lambda m: first_piece(m).update(file="../graphs/x.pt2"), ManifestError,
         lambda m: f"pieces/{first_key(m)}/file"),
        (lambda m: first_piece(m).update(status="done"), ManifestError,
         lambda m: f"pieces/{first_key(m)}/status"),
        (lambda m: m["buckets"][0].update(status="done"), ManifestError, "buckets/0/status"),
        (lambda m: m["buckets"][0]["pieces"].pop("head"), ManifestError,
             "buckets/0/pieces: .* is not valid under any of the given schemas"),
        (lambda m: m["cache"].pop("num_blocks"), ManifestError, "'num_blocks' is a required property"),
        (lambda m: m["buckets"][0]["pieces"].update(layer="f" * 64), ManifestError,
         "buckets/0/pieces: no piece f{64}"),
    ],
    ids=["piece-sha256", "path-outside", "bad-piece-status", "bad-bucket-status", "bucket-without-head",
         "missing-geometry", "bucket-names-a-missing-piece"],
)
def test_an_edited_manifest_is_caught_when_loading(compiled_dir, tmp_path, edit, error, message):
    artifact = Path(shutil.copytree(compiled_dir, tmp_path / "artifact"))
    path = artifact / "manifest.json"
    manifest = json.loads(path.read_text())
    message = message(manifest) if callable(message) else message
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(error, match=message):
        BucketRuntime.open(artifact, preload=True)


@pytest.mark.slow
def test_the_manifest_follows_the_schema_and_the_directory_can_move(compiled_dir, tmp_path):
    text = (compiled_dir / "manifest.json").read_text()
    schema = json.loads(read_package_data("manifest.schema.json"))
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(json.loads(text))
    assert str(compiled_dir) not in text  # every path inside is relative

    moved = Path(shutil.move(shutil.copytree(compiled_dir, tmp_path / "a"), tmp_path / "b"))
    assert not (tmp_path / "a").exists()
    prompt = prefill_plan([(list(range(3, 23)), 0, [1, 2, 3])])
    there = BucketRuntime.open(moved, preload=True).run_plan(prompt)
    torch.testing.assert_close(there, BucketRuntime.open(compiled_dir).run_plan(prompt), rtol=0, atol=0)


KILL_CONFIG = TINY_CONFIG.replace("max_num_seqs = 2", "max_num_seqs = 1").replace(
    "num_seqs_buckets = [1, 2]", "num_seqs_buckets = [1]"
).replace("fresh_layers = true", "fresh_layers = false")  # the two prefill layers are compile time enough
KILL_16, KILL_32 = (PieceShape("layer", n, rows=1, ctx=128, packed=True) for n in (16, 32))  # one row each
HANG_SCRIPT = (  # a compile whose worker stays where its graph is built, not yet published
    "import sys; from pathlib import Path\n"
    "from neuron_buckets.compile.compiler import Compiler\n"
    "from neuron_buckets.compile.local_executor import LocalExecutor\n"
    "from neuron_buckets.config import load_config\n"
    "from tests.worker_stops import hangs\n"
    "LocalExecutor.run = staticmethod(hangs)\n"
    "Compiler(load_config(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])).run(jobs=1)\n"
)


def wait_for(condition, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
def test_kill_during_a_compile_then_resume_compiles_only_the_missing_graph(
    compiled_dir, graph_cache_dir, hf_model_dir, tmp_path
):
    """SIGKILL the whole ``nb compile`` (workers too) mid-compile of prefill 16's layer; rerun."""
    config_file = write_config(tmp_path, hf_model_dir, KILL_CONFIG)
    config, out, cache = load_config(config_file), tmp_path / "out", tmp_path / "cache"
    compiler = Compiler(config, out, cache)
    keys = compiler.plan.keys
    assert compiler.plan.shapes == [EMBED, HEAD, LAYER_D1, KILL_16, KILL_32]
    shared, store = GraphStore(graph_cache_dir), GraphStore(cache)
    reused = (EMBED, HEAD, LAYER_D1)  # the session's pieces: only the one-row prefill layers compile
    for shape in reused:
        entry = shared.read_record(keys[shape], "pt2")
        assert entry and shared.verified(entry), f"{shape.name} is not in the session cache"
        store.publish(shared.graph_file(entry), entry)

    log = tmp_path / "compile.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", HANG_SCRIPT, str(config_file), str(out), str(cache)],
            stdout=stderr,
            stderr=stderr,
            start_new_session=True,  # its own group: workers die too
        )
    try:
        wait_for(stopped(cache).exists, 600, proc, log)  # prefill 16's layer is built, unpublished
        assert proc.poll() is None and store.read_record(keys[KILL_16], "pt2") is None
        with pytest.raises(DirectoryLocked, match=f"pid {proc.pid}"):
            Compiler(config, out, cache).run(jobs=1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    recs = records(out)  # valid JSON and schema: manifest writes are atomic
    assert set(recs) == {DECODE_1.name}
    done = pieces(out)
    assert set(done) == {s.name for s in reused}
    listed = {rec.file for _, rec in done.values()}
    for graph in (out / "graphs").iterdir():
        rel = graph.relative_to(out).as_posix()
        assert graph.name.startswith(".") or rel in listed, f"{rel} looks valid but is not in the manifest"
    for _, rec in done.values():
        assert sha256_file(out / rec.file) == rec.sha256
    assert store.read_record(keys[KILL_16], "pt2") is None
    for entry in store.entries():  # every entry is a complete, checked one
        assert store.verified(entry)

    report = Compiler(config, out, cache).run(jobs=1)
    assert names(report.compiled) == [KILL_16.name, KILL_32.name] and report.failed == []
    assert {o.shape for o in report.outcomes if o.cached} == set(reused)
    prompt = prefill_plan([(list(range(3, 23)), 0, [1, 2, 3])])  # 20 tokens: the new prefill 32 layer
    resumed = BucketRuntime.open(out).run_plan(prompt)
    torch.testing.assert_close(resumed, BucketRuntime.open(compiled_dir).run_plan(prompt))


@pytest.mark.parametrize(
    ("dtype", "setting", "fresh"),
    [
        ("float32", "", False),  # the C++ attention reads each context alone: nothing to gain
        ("bfloat16", "", False),  # and reads half precision alike
        ("bfloat16", 'device = "cuda"', True),  # flex reads the whole table: the fresh layer pays
        ("float32", "fresh_layers = true", True),
        ("bfloat16", "fresh_layers = false", False),
    ],
)
def test_unset_fresh_layers_are_compiled_only_where_attention_reads_the_whole_table(
    hf_model_dir, tmp_path, dtype, setting, fresh
):
    text = TINY_CONFIG.replace("fresh_layers = true", setting).replace(
        "max_model_len = 128", f'max_model_len = 128\ndtype = "{dtype}"'
    )
    config = load_config(write_config(tmp_path, hf_model_dir, text))
    compiler = Compiler(config, tmp_path / "out", tmp_path / "cache")
    roles = {role for pieces in compiler.plan.bucket_pieces.values() for role in pieces}
    assert ("fresh_layer" in roles) == fresh


@pytest.mark.parametrize(
    "flag, value",
    [
        ("cpp.cxx", "/tmp/evil"),
        ("cuda.cuda_cxx", "/tmp/evil"),
        ("aot_inductor.custom_op_libs", ["/tmp/evil.so"]),
        ("aot_inductor.aoti_shim_library_path", "/tmp"),
        ("cutlass.compile_opt_level", "-fplugin=/tmp/evil.so"),
        ("cuda.cutlass_dir", "/tmp"),
        ("fx_graph_remote_cache", True),
        ("trace.debug_dir", "/tmp"),
        ("post_grad_custom_post_pass", "os.system"),
    ],
)
def test_inductor_flags_naming_programs_paths_or_code_are_refused(hf_model_dir, tmp_path, flag, value):
    from neuron_buckets.backends.inductor import InductorBackend

    refused = rf"^compile.flags \['{re.escape(flag)}'\] name a program, path, library or code to load"
    with pytest.raises(ValueError, match=refused):
        InductorBackend().resolved_flags({flag: value, "max_autotune": False})
    text = TINY_CONFIG + f"\n[compile.flags]\n\"{flag}\" = {json.dumps(value)}\n"
    config = load_config(write_config(tmp_path, hf_model_dir, text))
    with pytest.raises(ValueError, match=re.escape(flag)):
        Compiler(config, tmp_path / "out", tmp_path / "cache")


def test_harmless_inductor_flags_are_still_taken():
    from neuron_buckets.backends.inductor import FIXED_CONFIGS, InductorBackend

    flags = {"max_autotune": False, "cpp.simdlen": None, "freezing": False}
    assert InductorBackend().resolved_flags(flags) == {**flags, **FIXED_CONFIGS}

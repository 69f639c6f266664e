"""``Compiler``: reuse, incremental builds, failures, fail-fast, kill and resume, the lock, the manifest.

Most tests use the eager backend, whose "compile" takes milliseconds, so they exercise the real
worker processes, store and manifest without compile time. Failures are injected where a real
compile can fail: a cache entry that cannot be written, a worker process that dies. The slow tests
use inductor and reuse the session's compiled graphs, so together they compile one graph.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch

from neuron_buckets.artifact.manifest import ManifestError, read_manifest, sha256_file
from neuron_buckets.compile import compiler
from neuron_buckets.compile.compiler import Compiler, CompileReport, Outcome
from neuron_buckets.compile.directory_lock import DirectoryLocked, directory_lock
from neuron_buckets.compile.output_dir import OutputDirError
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.config import Config, load_config
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.core.padding import PrefillChunk
from neuron_buckets.serve.runtime import ArtifactError, BucketRuntime
from tests.conftest import TINY_CONFIG, save_tiny_llama, write_config

EAGER = TINY_CONFIG.replace('backend = "inductor"', 'backend = "eager"')
PREFILL_16, PREFILL_32 = Bucket("prefill", 1, 16, 128), Bucket("prefill", 1, 32, 128)
DECODE_1, DECODE_2 = Bucket("decode", 1, 1, 128), Bucket("decode", 2, 1, 128)


@pytest.fixture
def eager(hf_model_dir: Path, tmp_path: Path) -> Config:
    return load_config(write_config(tmp_path, hf_model_dir, EAGER))


def compile_(config: Config, out: Path, cache: Path, jobs: int = 1, **kw) -> CompileReport:
    fail_fast = kw.pop("fail_fast", False)
    return Compiler(config, out, cache, fail_fast=fail_fast).run(jobs, **kw)


def names(outcomes: list[Outcome]) -> list[str]:
    return [o.bucket.name for o in outcomes]


def records(out: Path) -> dict[str, dict]:
    return {f"{r['kind']}_b{r['batch']}_s{r['seq']}_c{r['ctx']}": r for r in read_manifest(out)["buckets"]}


def block_cache_entry(config: Config, cache: Path, bucket: Bucket) -> None:
    """A directory where the bucket's cache entry must go: its compile fails at commit, alone."""
    compiler = Compiler(config, cache.parent / "out", cache)  # computes keys, writes nothing
    compiler.store.path(compiler.keys[bucket], compiler.backend.graph_ext).mkdir(parents=True)


def test_second_run_compiles_nothing_and_touches_no_graph(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    first = compile_(eager, out, cache, jobs=2)
    assert names(first.compiled) == names(first.outcomes) and len(first.outcomes) == 4
    files = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "graphs").iterdir()}
    events = []
    second = compile_(eager, out, cache, jobs=2, on_event=lambda e, o: events.append((e, o.cached)))
    assert second.compiled == [] and second.failed == []
    assert events == [("done", True)] * 4  # no worker was started
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "graphs").iterdir()} == files
    assert {k: r["key"] for k, r in records(out).items()} == {o.bucket.name: o.key for o in first.outcomes}


def test_each_graph_is_hashed_once_per_run(eager, tmp_path, monkeypatch):
    """The manifest is rewritten after every bucket; re-hashing every graph each time is quadratic."""
    hashed, real = [], compiler.sha256_file
    monkeypatch.setattr(compiler, "sha256_file", lambda path: hashed.append(path) or real(path))
    for _ in range(2):  # a cold run, then a warm one that checks the graphs it reuses
        hashed.clear()
        compile_(eager, tmp_path / "out", tmp_path / "cache")
        graphs = [p.name for p in hashed if p.parent.name == "graphs"]
        assert len(graphs) == len(set(graphs)) == 4


def test_another_artifact_directory_reuses_the_shared_cache(eager, tmp_path):
    cache = tmp_path / "cache"
    compile_(eager, tmp_path / "a", cache)
    # the cost measured when a graph was compiled travels with it (nb plan fits on it): pretend
    # that one took 42 s, as a real graph would, and expect the second directory to record it
    digest = GraphStore.digest_path(cache / Path(records(tmp_path / "a")[PREFILL_32.name]["file"]).name)
    digest.write_text(digest.read_text().split()[0] + " 42.000")
    report = compile_(eager, tmp_path / "b", cache)
    assert report.compiled == [] and len(report.outcomes) == 4
    for name, rec in records(tmp_path / "b").items():
        assert rec["cached"] and rec["sha256"] == records(tmp_path / "a")[name]["sha256"]
    assert records(tmp_path / "b")[PREFILL_32.name]["compile_seconds"] == 42.0


def test_one_new_bucket_list_entry_compiles_only_that_bucket(eager, hf_model_dir, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    compile_(eager, out, cache)
    grown = EAGER.replace("tokens_buckets = [16, 32]", "tokens_buckets = [16, 24, 32]")
    (tmp_path / "grown").mkdir()
    report = compile_(load_config(write_config(tmp_path / "grown", hf_model_dir, grown)), out, cache)
    assert names(report.compiled) == ["prefill_b1_s24_c128"]
    assert len(report.outcomes) == 5 and report.failed == []
    assert len(records(out)) == 5


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
    assert read_manifest(out)["weights"]["sha256"] == sha256_file(weights) != old_sha
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) != before


def test_a_damaged_weights_file_of_the_same_size_is_rewritten(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    compile_(eager, out, cache)
    weights = out / "weights.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    compile_(eager, out, cache)
    assert weights.read_bytes() == good
    assert BucketRuntime.open(out).prefill([PrefillChunk([1, 2, 3], 0, [1])]).shape == (1, 256)


def test_graphs_of_buckets_dropped_from_the_grid_leave_the_directory(eager, hf_model_dir, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    compile_(eager, out, cache)
    shrunk = EAGER.replace("tokens_buckets = [16, 32]", "tokens_buckets = [32]")
    (tmp_path / "shrunk").mkdir()
    report = compile_(load_config(write_config(tmp_path / "shrunk", hf_model_dir, shrunk)), out, cache)
    assert report.compiled == [] and len(report.outcomes) == 3
    assert sorted(p.name for p in (out / "graphs").iterdir()) == sorted(
        Path(r["file"]).name for r in read_manifest(out)["buckets"]
    )
    assert len(list(cache.glob("*.json"))) >= 4  # the cache keeps the dropped bucket's graph


def test_a_failing_bucket_is_recorded_and_the_others_finish(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    block_cache_entry(eager, cache, PREFILL_32)
    report = compile_(eager, out, cache, jobs=2)
    assert names(report.failed) == [PREFILL_32.name]
    assert sorted(names(report.compiled)) == sorted(b.name for b in (PREFILL_16, DECODE_1, DECODE_2))

    rec = records(out)[PREFILL_32.name]
    assert (rec["status"], rec["sha256"], rec["bytes"]) == ("failed", None, 0)
    assert rec["error"].startswith("IsADirectoryError")
    log = (out / rec["log"]).read_text()
    assert "Traceback" in log and "commit" in log and rec["error"] in log
    assert not (out / rec["file"]).exists()
    assert BucketRuntime.open(out).prefill([PrefillChunk([1, 2, 3], 0, [1])]).shape == (1, 256)

    Compiler(eager, out, cache).store.path(rec["key"], "json").rmdir()
    again = compile_(eager, out, cache)
    assert names(again.compiled) == [PREFILL_32.name] and again.failed == []


def test_fail_fast_starts_nothing_after_the_first_failure(eager, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    block_cache_entry(eager, cache, PREFILL_16)  # the first bucket of the grid
    report = compile_(eager, out, cache, jobs=1, fail_fast=True)
    assert names(report.outcomes) == names(report.failed) == [PREFILL_16.name]
    assert list(records(out)) == [PREFILL_16.name]
    assert [p.name for p in cache.iterdir() if p.suffix == ".json" and p.is_file()] == []


def test_a_worker_that_dies_fails_only_its_bucket(eager, tmp_path):
    """An OOM kill or segfault breaks the worker pool; the buckets after it still compile."""

    def kill_the_worker(event: str, outcome: Outcome) -> None:
        if event == "queued" and outcome.bucket == PREFILL_32:
            for worker in multiprocessing.active_children():
                os.kill(worker.pid, signal.SIGKILL)

    out = tmp_path / "out"
    report = compile_(eager, out, tmp_path / "cache", jobs=1, on_event=kill_the_worker)
    assert names(report.failed) == [PREFILL_32.name]
    assert "BrokenProcessPool" in records(out)[PREFILL_32.name]["error"]
    assert sorted(names(report.compiled)) == sorted(b.name for b in (PREFILL_16, DECODE_1, DECODE_2))


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
    rec = records(out)[PREFILL_16.name]
    good = (out / rec["file"]).read_bytes()
    with open(out / rec["file"], "r+b") as f:  # in place, as an editor or bit rot would
        f.write(b"[]" + b" " * (len(good) - 2))

    with pytest.raises(ArtifactError, match="does not match its sha256"):
        BucketRuntime.open(out).prefill([PrefillChunk([1, 2, 3], 0, [1])])
    report = compile_(eager, out, cache)
    assert names(report.compiled) == [PREFILL_16.name]
    assert (out / rec["file"]).read_bytes() == good
    assert records(out)[PREFILL_16.name]["sha256"] == rec["sha256"]
    BucketRuntime.open(out).prefill([PrefillChunk([1, 2, 3], 0, [1])])


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
    assert report.compiled == [] and len(report.outcomes) == 4
    assert len(BucketRuntime.open(out).records) == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda m: m["buckets"][0].update(sha256="0" * 64), ArtifactError, "does not match its sha256"),
        (lambda m: m["buckets"][0].update(file="../graphs/x.pt2"), ManifestError, "buckets/0/file"),
        (lambda m: m["buckets"][0].update(status="done"), ManifestError, "buckets/0/status"),
        (lambda m: m["cache"].pop("num_blocks"), ManifestError, "'num_blocks' is a required property"),
    ],
    ids=["bucket-sha256", "path-outside", "bad-status", "missing-geometry"],
)
def test_an_edited_manifest_is_caught_when_loading(compiled_dir, tmp_path, edit, error, message):
    artifact = Path(shutil.copytree(compiled_dir, tmp_path / "artifact"))
    path = artifact / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(error, match=message):
        BucketRuntime.open(artifact, preload=True)


@pytest.mark.slow
def test_the_manifest_follows_the_schema_and_the_directory_can_move(compiled_dir, tmp_path):
    text = (compiled_dir / "manifest.json").read_text()
    schema_file = resources.files("neuron_buckets.manifests").joinpath("manifest.schema.json")
    schema = json.loads(schema_file.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(json.loads(text))
    assert str(compiled_dir) not in text  # every path inside is relative

    moved = Path(shutil.move(shutil.copytree(compiled_dir, tmp_path / "a"), tmp_path / "b"))
    assert not (tmp_path / "a").exists()
    prompt = [PrefillChunk(list(range(3, 23)), 0, [1, 2, 3])]
    there = BucketRuntime.open(moved, preload=True).prefill(prompt)
    torch.testing.assert_close(there, BucketRuntime.open(compiled_dir).prefill(prompt), rtol=0, atol=0)


KILL_CONFIG = TINY_CONFIG.replace("max_num_seqs = 2", "max_num_seqs = 1").replace(
    "num_seqs_buckets = [1, 2]", "num_seqs_buckets = [1]"
)
COMPILE_SCRIPT = (
    "import sys; from pathlib import Path\n"
    "from neuron_buckets.compile.compiler import Compiler\n"
    "from neuron_buckets.config import load_config\n"
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
    """SIGKILL the whole ``nb compile`` (workers too) while it compiles prefill 32; rerun."""
    config_file = write_config(tmp_path, hf_model_dir, KILL_CONFIG)
    config, out, cache = load_config(config_file), tmp_path / "out", tmp_path / "cache"
    keys = Compiler(config, out, cache).keys
    shared = GraphStore(graph_cache_dir)
    for bucket in (PREFILL_16, DECODE_1):  # the session's graphs: only prefill 32 must compile
        graph = shared.get(keys[bucket], "pt2")
        assert graph, f"{bucket.name} is not in the session cache"
        for src in (graph, GraphStore.digest_path(graph)):
            shutil.copy(src, cache / src.name)

    log = tmp_path / "compile.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", COMPILE_SCRIPT, str(config_file), str(out), str(cache)],
            stdout=stderr,
            stderr=stderr,
            start_new_session=True,  # its own group: workers die too
        )
    try:
        wait_for(lambda: (out / "manifest.json").exists(), 60, proc, log)
        time.sleep(5)  # the worker is now exporting or compiling prefill 32 (about 20 s in all)
        assert proc.poll() is None and GraphStore(cache).get(keys[PREFILL_32], "pt2") is None
        with pytest.raises(DirectoryLocked, match=f"pid {proc.pid}"):
            Compiler(config, out, cache).run(jobs=1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    recs = records(out)  # valid JSON and schema: manifest writes are atomic
    assert set(recs) == {PREFILL_16.name, DECODE_1.name}
    listed = {r["file"] for r in recs.values()}
    for graph in (out / "graphs").iterdir():
        rel = graph.relative_to(out).as_posix()
        assert graph.name.startswith(".") or rel in listed, f"{rel} looks valid but is not in the manifest"
    for rec in recs.values():
        assert sha256_file(out / rec["file"]) == rec["sha256"]
    store = GraphStore(cache)
    assert store.get(keys[PREFILL_32], "pt2") is None
    for graph in cache.glob("*.pt2"):  # anything named like an entry is a complete, checked one
        assert graph.name.startswith(".") or store.get(graph.stem, "pt2") == graph

    report = Compiler(config, out, cache).run(jobs=1)
    assert names(report.compiled) == [PREFILL_32.name] and report.failed == []
    assert {o.bucket for o in report.outcomes if o.cached} == {PREFILL_16, DECODE_1}
    prompt = [PrefillChunk(list(range(3, 23)), 0, [1, 2, 3])]  # 20 tokens: the new prefill 32 graph
    resumed = BucketRuntime.open(out).prefill(prompt)
    torch.testing.assert_close(resumed, BucketRuntime.open(compiled_dir).prefill(prompt))

"""What ``nb compile`` may touch: only directories and files it wrote, never through a symlink.

Refusals happen before anything is written (not even the lock file), so each repro compares the
whole tree, links included, before and after. The compiles use the eager backend and one graph
cache per module, so only the first of them starts worker processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest import LibraryInfo, PieceRecord, read_manifest
from neuron_buckets.cli import app
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.compile.output_dir import OutputDirError, prune
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.store_sweep import STALE_AFTER_S, remove_stale_temps
from neuron_buckets.config import load_config
from tests.conftest import TINY_CONFIG, error_line, write_config

EAGER = TINY_CONFIG.replace('backend = "inductor"', 'backend = "eager"')
runner = CliRunner()


def nb_compile(out: Path, cache: Path):
    return runner.invoke(app, ["compile", "--backend", "eager", "--out", str(out), "--cache-dir", str(cache)])


def tree(root: Path) -> dict[str, object]:
    """Every entry under ``root`` without following links: file bytes, link targets, dirs."""
    found: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = path.read_bytes()
    return found


def foreign_manifest(tmp: Path) -> Path:
    (tmp / "p" / "graphs").mkdir(parents=True)
    (tmp / "p" / "graphs" / "notes.txt").write_text("x\n")
    (tmp / "p" / "manifest.json").write_text('{"name":"app"}\n')
    return tmp / "p"


def graphs_link(tmp: Path) -> Path:
    (tmp / "d").mkdir()
    (tmp / "d" / "train.bin").write_text("data\n")
    (tmp / "p2").mkdir()
    (tmp / "p2" / "graphs").symlink_to(tmp / "d")
    return tmp / "p2"


def user_files(tmp: Path) -> Path:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "thesis.tex").write_text("chapter 1\n")
    return tmp / "mine"


def manifest_directory(tmp: Path) -> Path:
    (tmp / "art" / "manifest.json").mkdir(parents=True)
    return tmp / "art"


def weights_link(tmp: Path) -> Path:
    (tmp / "w").mkdir()
    (tmp / "w" / "weights.safetensors").symlink_to(tmp / "elsewhere.bin")
    (tmp / "elsewhere.bin").write_bytes(b"\x00" * 64)
    return tmp / "w"


def tokenizer_link(tmp: Path) -> Path:
    (tmp / "t").mkdir()
    (tmp / "t" / "tokenizer").symlink_to(graphs_link(tmp) / "graphs")  # the user's folder, via a link
    return tmp / "t"


def a_file(tmp: Path) -> Path:
    (tmp / "out").write_text("not a directory\n")
    return tmp / "out"


@pytest.mark.parametrize(
    ("setup", "named"),
    [
        (foreign_manifest, "manifest.json: no integer schema_version"),
        (graphs_link, "graphs is a symbolic link"),
        (user_files, "holds thesis.tex and no nb manifest"),
        (manifest_directory, "manifest.json"),
        (weights_link, "weights.safetensors is a symbolic link"),
        (tokenizer_link, "tokenizer is a symbolic link"),
        (a_file, "is not a directory"),
    ],
    ids=[
        "foreign-manifest", "graphs-symlink", "user-files", "manifest-dir", "weights-symlink",
        "tokenizer-symlink", "a-file",
    ],
)
def test_compile_refuses_what_it_did_not_write_and_touches_nothing(tmp_path, setup, named):
    out = setup(tmp_path)
    before = tree(tmp_path)
    line = error_line(nb_compile(out, tmp_path / "cache"))
    assert named in line and "choose another --out" in line
    assert tree(tmp_path) == before  # not even a lock file or the cache directory


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("eager-cache")


def eager(tmp: Path, model: Path, text: str = EAGER):
    tmp.mkdir(exist_ok=True)
    return load_config(write_config(tmp, model, text))


def test_pruning_removes_only_graphs_its_previous_manifest_listed(hf_model_dir, cache, tmp_path):
    out = tmp_path / "out"
    Compiler(eager(tmp_path, hf_model_dir), out, cache).run(jobs=2)
    listed = {r.file for r in read_manifest(out).pieces.values()}
    stray = out / "graphs" / f"{'0' * 64}.json"  # named like a graph, but no manifest listed it
    for path in (stray, out / "graphs" / "notes.txt", out / "logs" / "mine.log"):
        path.parent.mkdir(exist_ok=True)
        path.write_text("the user's\n")

    shrunk = EAGER.replace("tokens_buckets = [16, 32]", "tokens_buckets = [32]")
    report = Compiler(eager(tmp_path / "shrunk", hf_model_dir, shrunk), out, cache).run(jobs=2)
    assert report.compiled == [] and len(report.outcomes) == 6  # embed, head, 3 layers, 1 fresh layer
    kept = {r.file for r in read_manifest(out).pieces.values()}
    dropped = listed - kept  # prefill 16's layer and fresh layer
    assert len(dropped) == 2 and not any((out / f).exists() for f in dropped)
    assert all((out / f).is_file() for f in kept)
    assert stray.read_text() == (out / "graphs" / "notes.txt").read_text() == "the user's\n"
    assert (out / "logs" / "mine.log").is_file()


def test_an_edited_manifest_cannot_point_pruning_at_other_files(tmp_path):
    kept = ("weights.safetensors", "graphs/failed.json", "graphs/sub/x.json", "tokenizer/sub/y.json",
            "kernels/sub/z.so")
    for name in kept:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("keep\n")
    claims = SimpleNamespace(pieces={
        str(i): PieceRecord("layer", f"p{i}", file, None, status=status)
        for i, (file, status) in enumerate([
            ("weights.safetensors", "ok"),
            ("graphs/failed.json", "failed"),  # never written by a run
            ("graphs/sub/x.json", "ok"),
        ])
    }, text=SimpleNamespace(files={"weights.safetensors": "0" * 64, "tokenizer/sub/y.json": "0" * 64}),
       libraries={name: LibraryInfo(file, "0" * 64)
                  for name, file in [("a", "weights.safetensors"), ("b", "kernels/sub/z.so")]})
    prune(tmp_path, claims, keep=set())
    assert all((tmp_path / n).read_text() == "keep\n" for n in kept)


def test_a_kernel_library_this_run_no_longer_builds_is_pruned(tmp_path):
    """An artifact recompiled where its graphs call no C++ kernel (another backend): its old
    library goes."""
    library = tmp_path / "kernels" / "block_kv_cpu.so"
    library.parent.mkdir()
    library.write_bytes(b"old build")
    claims = SimpleNamespace(pieces={}, text=None,
                             libraries={"block_kv_cpu": LibraryInfo("kernels/block_kv_cpu.so", "0" * 64)})
    prune(tmp_path, claims, keep=set())
    assert not library.exists()


KILLED_WHILE_WRITING_WEIGHTS = """
import os, signal, sys
from pathlib import Path
from neuron_buckets.utils.files import atomic_write
from neuron_buckets.compile.output_dir import owned_directory

def write_then_die(tmp: Path) -> None:
    tmp.write_bytes(bytes(1 << 20))
    os.kill(os.getpid(), signal.SIGKILL)

with owned_directory(Path(sys.argv[1])):
    atomic_write(Path(sys.argv[1]) / "weights.safetensors", write_then_die)
"""


def test_temp_files_of_a_killed_run_are_removed_by_the_next_run(hf_model_dir, cache, tmp_path):
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING_WEIGHTS, str(out)], check=False)
    assert killed.returncode == -signal.SIGKILL
    (leak,) = out.glob(".weights.safetensors.*.tmp")
    assert leak.stat().st_size == 1 << 20
    (out / "graphs").mkdir()
    placing = out / "graphs" / f".{'a' * 64}.json.4242.tmp"  # placing a graph, killed
    placing.write_text("{}")
    users = out / "graphs" / ".draft.tmp"  # a dot file of the user's: not our pattern
    users.write_text("draft\n")

    report = Compiler(eager(tmp_path, hf_model_dir), out, cache).run(jobs=2)
    assert not report.failed and len(report.buckets) == 4 and len(report.outcomes) == 8
    assert not leak.exists() and not placing.exists()
    assert users.read_text() == "draft\n"


def test_stale_temp_files_in_the_shared_cache_are_removed_by_name_and_age(tmp_path):
    store = GraphStore(tmp_path)
    key = "f" * 64
    scratch = tmp_path / ".scratch-k2j4_x1q.tmp"  # a killed worker's compile directory
    scratch.mkdir()
    (scratch / f"{key}.pt2").write_bytes(b"x" * 100)
    graph, record = f".{key}.{'0' * 16}.pt2.ab_12cd3.tmp", f".{key}.pt2.json.abcd_123.tmp"
    old = [tmp_path / graph, tmp_path / record, scratch]
    fresh = tmp_path / f".{key}.pt2.json.efgh_456.tmp"  # another compile may be writing it right now
    other = tmp_path / "notes.tmp"
    for path in (*old[:2], fresh, other):
        path.write_bytes(b"x")
    long_ago = time.time() - STALE_AFTER_S - 60
    for path in (*old, other):
        os.utime(path, (long_ago, long_ago))
    assert sorted(remove_stale_temps(store)) == sorted(p.name for p in old)
    assert fresh.exists() and other.exists() and not scratch.exists()


def test_the_library_refuses_a_foreign_directory_too(hf_model_dir, tmp_path):
    out = user_files(tmp_path)
    with pytest.raises(OutputDirError, match="holds thesis.tex"):
        Compiler(eager(tmp_path, hf_model_dir), out, tmp_path / "cache")

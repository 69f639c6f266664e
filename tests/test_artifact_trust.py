"""What an artifact directory must be before nb runs anything from it: pieces compiled for the
manifest as it stands (a hand-edited geometry is refused, in one line, before any write), files
that only their owner can change, and graphs loaded from the bytes that were hashed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest import ManifestError
from neuron_buckets.cli import app
from neuron_buckets.runtime.bucket_runtime import ArtifactError, BucketRuntime
from neuron_buckets.utils.owner_only import LoosePermissions
from tests.conftest import error_line


def bucket_index(m: dict, kind: str, batch: int | None = None) -> int:
    return next(i for i, b in enumerate(m["buckets"]) if b["kind"] == kind and batch in (None, b["batch"]))


def scale(section: str, field: str, factor: float):
    def edit(m: dict) -> None:
        m[section][field] = int(m[section][field] * factor)
    return edit


def model_config(field: str, value):
    def edit(m: dict) -> None:
        m["model"]["config"][field] = value(m["model"]["config"][field])
    return edit


def bucket(kind: str, batch: int, field: str, value: int):
    def edit(m: dict) -> None:
        m["buckets"][bucket_index(m, kind, batch)][field] = value
    return edit


# (the edit, the field the refusal must name): the reported reproductions and their siblings
EDITS = {
    "num_blocks x4": (scale("cache", "num_blocks", 4), "cache.num_blocks"),
    "num_blocks x2": (scale("cache", "num_blocks", 2), "cache.num_blocks"),
    "block_size x2": (scale("cache", "block_size", 2), "cache.block_size"),
    "block_size /2": (scale("cache", "block_size", 0.5), "cache.block_size"),
    "num_layers": (lambda m: m["cache"].update(num_layers=3), "cache.num_layers"),
    "num_kv_heads": (lambda m: m["cache"].update(num_kv_heads=4), "cache.num_kv_heads"),
    "head_dim": (lambda m: m["cache"].update(head_dim=32), "cache.head_dim"),
    "cache dtype": (lambda m: m["cache"].update(dtype="bfloat16"), "cache.dtype"),
    "model dtype": (lambda m: m["model"].update(dtype="bfloat16"), "model.dtype"),
    "vocab_size": (model_config("vocab_size", lambda v: v * 2), "model.config.vocab_size"),
    "num_hidden_layers": (model_config("num_hidden_layers", lambda v: v + 1), "config.num_hidden_layers"),
    "intermediate_size": (model_config("intermediate_size", lambda v: v * 2), "config.intermediate_size"),
    "decode batch": (bucket("decode", 1, "batch", 4), "decode batch 4"),
    "decode seq": (bucket("decode", 1, "seq", 2), "decode batch 1 seq 2"),
    "prefill seq": (bucket("prefill", 2, "seq", 64), "seq 64"),
    "recorded facts removed": (
        lambda m: [p.pop("compiled_for") for p in m["pieces"].values()],
        "does not record what it was compiled for",
    ),
}


def copy_artifact(compiled_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "art"
    shutil.copytree(compiled_dir, out, ignore=shutil.ignore_patterns(".nb-lock*"))
    return out


def edit_manifest(directory: Path, edit) -> None:
    path = directory / "manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("name", EDITS)
def test_a_manifest_edited_away_from_its_pieces_is_refused_naming_the_field_before_any_write(
    compiled_dir: Path, tmp_path: Path, name: str
) -> None:
    edit, field = EDITS[name]
    directory = copy_artifact(compiled_dir, tmp_path)
    edit_manifest(directory, edit)
    before = snapshot(directory)
    with pytest.raises(ManifestError, match="manifest.json: ") as e:
        BucketRuntime.open(directory)
    assert field in str(e.value) and "\n" not in str(e.value)
    assert snapshot(directory) == before


def test_nb_generate_on_a_manifest_with_4x_num_blocks_is_one_error_line(compiled_dir: Path, tmp_path: Path):
    directory = copy_artifact(compiled_dir, tmp_path)
    edit_manifest(directory, scale("cache", "num_blocks", 4))
    line = error_line(CliRunner().invoke(app, ["generate", str(directory), "--prompt-ids", "1,2,3"]))
    assert "cache.num_blocks is 256, but piece" in line and "compiled for 64" in line


def test_the_untouched_artifact_still_opens(compiled_dir: Path, tmp_path: Path) -> None:
    runtime = BucketRuntime.open(copy_artifact(compiled_dir, tmp_path))
    assert runtime.num_blocks == 64


@pytest.mark.parametrize("where", [".", "manifest.json", "graphs", "kernels", "tokenizer"])
@pytest.mark.parametrize("bits", [0o020, 0o002])
def test_an_artifact_others_can_write_is_refused_with_the_chmod_that_fixes_it(
    compiled_dir: Path, tmp_path: Path, where: str, bits: int
) -> None:
    directory = copy_artifact(compiled_dir, tmp_path)
    path = directory / where
    path.chmod(path.stat().st_mode | bits)
    with pytest.raises(LoosePermissions, match=r"chmod go-w ") as e:
        BucketRuntime.open(directory)
    assert str(path) in str(e.value)
    line = error_line(CliRunner().invoke(app, ["generate", str(directory), "--prompt-ids", "1,2,3"]))
    assert f"chmod go-w {path}" in line


@pytest.mark.parametrize("damage", ["changed", "missing"])
def test_a_kernel_library_not_as_its_manifest_says_is_refused_at_open(
    compiled_dir: Path, tmp_path: Path, damage: str
) -> None:
    """The C++ decode kernel is code the runtime loads into the process, checked as a graph is,
    and before any graph."""
    directory = copy_artifact(compiled_dir, tmp_path)
    library = directory / "kernels" / "block_kv_cpu.so"
    if damage == "changed":
        library.write_bytes(library.read_bytes() + b"\0")
    else:
        library.unlink()
    message = "does not match its sha256" if damage == "changed" else "kernel library block_kv_cpu is missing"
    with pytest.raises(ArtifactError, match=message):
        BucketRuntime.open(directory)


def test_a_graph_others_can_write_is_refused_when_it_is_loaded(compiled_dir: Path, tmp_path: Path) -> None:
    directory = copy_artifact(compiled_dir, tmp_path)
    runtime = BucketRuntime.open(directory)
    key = next(iter(runtime.manifest.pieces))
    graph = directory / runtime.manifest.pieces[key].file
    graph.chmod(0o666)
    with pytest.raises(LoosePermissions, match=f"chmod go-w {graph}"):
        runtime.graph(key)


def test_a_graph_is_loaded_from_the_bytes_that_were_hashed(
    compiled_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapping the file after the check cannot change what is loaded: the backend gets a private
    copy, written from the bytes the hash saw, never the artifact's path."""
    directory = copy_artifact(compiled_dir, tmp_path)
    runtime = BucketRuntime.open(directory)
    key = next(iter(runtime.manifest.pieces))
    graph = directory / runtime.manifest.pieces[key].file
    loaded: list[tuple[Path, bytes]] = []
    real_load = runtime.backend.load

    def load(path: Path, *args):
        graph.write_bytes(b"swapped after the hash")  # what an attacker would do in the gap
        loaded.append((path, path.read_bytes()))
        return real_load(path, *args)

    monkeypatch.setattr(runtime.backend, "load", load)
    original = (compiled_dir / runtime.manifest.pieces[key].file).read_bytes()
    runtime.graph(key)
    (path, data), = loaded
    assert path != graph and data == original
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        BucketRuntime.open(directory).graph(key)

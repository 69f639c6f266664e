"""The command line at 80 columns: every --help keeps its option names whole and its text plain,
`nb cache ls` gives an entry at most two lines, and a reader that leaves (`| head`) ends nb
without a word."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
import typer.main
from typer.testing import CliRunner

from neuron_buckets.cli import app
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.store_entry import StoreEntry

ROOT = Path(__file__).parents[1]


def nb_at_80(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "neuron_buckets.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    found = [(path, group)]
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            found += commands(cmd, (*path, name))
        else:
            found.append(((*path, name), cmd))
    return found


ALL = commands(typer.main.get_command(app))


@pytest.mark.parametrize(("path", "command"), ALL, ids=[" ".join(p) or "nb" for p, _ in ALL])
def test_help_fits_80_columns_with_whole_option_names_and_plain_text(path, command) -> None:
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, [*path, "--help"], prog_name="nb")
    assert result.exit_code == 0 and result.stderr == "", result.output
    text = result.stdout
    assert max(len(line) for line in text.splitlines()) <= 80
    body = "\n".join(line for line in text.splitlines() if not line.startswith("Usage:"))
    for cut in ("…", "...", "<bool>", "``", "[bold", "╭"):  # "...": a summary cut short
        assert cut not in body, f"{cut!r} in nb {' '.join(path)} --help"
    words = set(text.replace(",", " ").replace("/", " ").split())
    for param in command.params:
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("-"):
                assert name in words, f"{name} cut in nb {' '.join(path)} --help"


def test_inspect_and_plan_tables_never_cut_a_figure(tmp_path: Path) -> None:
    from test_cli_traffic import write_manifest
    from test_traces import CODE

    manifest = write_manifest(tmp_path)
    for args in (
        ["inspect", "--trace", CODE, "--manifest", manifest, "--prefill-buckets", "512,2048"],
        ["plan", "--trace", CODE, "--graphs", 8],
    ):
        result = nb_at_80(*args)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert max(len(line) for line in lines) <= 80 and "…" not in result.stdout
        borders = [line for line in lines if line.startswith(("┏", "└"))]
        assert borders and all(line.endswith(("┓", "┘")) for line in borders)  # no table cropped


def _store_with(tmp_path: Path, count: int) -> Path:
    """A store of ``count`` entries whose toolchain strings are as long as real ones."""
    location = tmp_path / "store"
    store = GraphStore(location)
    versions = {
        "torch": "2.9.0+cpu", "compiler": "torch._inductor 2.9.0 gcc 13.2.0 (Ubuntu 13.2.0-23ubuntu4)",
        "python": "3.12.3", "flags": "max_autotune=False, freezing=True, cpp_wrapper=False",
    }  # fmt: skip
    for i in range(count):
        graph = tmp_path / f"g{i}.pt2"
        graph.write_bytes(bytes([i]) * (1000 + i))
        data = graph.read_bytes()
        store.publish(graph, StoreEntry(
            key=f"{i:x}" * 64, ext="pt2", sha256=hashlib.sha256(data).hexdigest(), bytes=len(data),
            compile_seconds=1.0, piece=f"layer_t{16 << i}_b2_c128_packed", backend="inductor",
            versions=versions, toolchain="0.9.0", created=time.time() - 3600 * i,
        ))  # fmt: skip
    return location


def test_cache_ls_gives_an_entry_at_most_two_lines_and_the_whole_toolchain_on_request(tmp_path) -> None:
    location = _store_with(tmp_path, 5)
    listing = nb_at_80("cache", "ls", "--cache-dir", location)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    rows = [n for n, line in enumerate(lines) if any(f"{i:x}" * 10 in line for i in range(5))]
    assert len(rows) == 5
    body_end = next(n for n, line in enumerate(lines) if line.startswith("5 entries"))
    spans = [b - a for a, b in zip(rows, [*rows[1:], body_end - 1], strict=True)]
    assert max(spans) <= 2, listing.stdout
    (toolchain,) = [line for line in lines if line.startswith("toolchain ")]  # one toolchain, once
    tid = toolchain.split(":")[0].split()[1]
    assert all(lines[n].rstrip().endswith(tid) for n in rows)
    verbose = nb_at_80("cache", "ls", "--cache-dir", location, "--verbose").stdout
    assert "neuron-buckets" in verbose and "toolchain " not in verbose.splitlines()[-1]
    doc = json.loads(nb_at_80("cache", "ls", "--cache-dir", location, "--json").stdout)
    assert len(doc["entries"]) == 5 and all(e["present"] for e in doc["entries"])
    full = doc["entries"][0]["made_by"]
    assert full.startswith("inductor with neuron-buckets 0.9.0") and doc["entries"][0]["toolchain_id"] == tid
    assert f"toolchain {tid}: {full}" in " ".join(listing.stdout.split())


def test_cache_prune_dry_run_lists_and_keeps(tmp_path: Path) -> None:
    location = _store_with(tmp_path, 3)
    before = sorted(p.name for p in location.iterdir())
    dry = nb_at_80("cache", "prune", "--cache-dir", location, "--older-than-days", "0.03", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would remove 2 entries" in dry.stdout and "layer_t32_b2_c128_packed" in dry.stdout
    assert sorted(p.name for p in location.iterdir()) == before
    real = nb_at_80("cache", "prune", "--cache-dir", location, "--older-than-days", "0.03")
    assert "removed 2 entries" in real.stdout and len(GraphStore(location).entries()) == 1


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"], ["cache", "ls", "--help"]])
def test_a_reader_that_leaves_ends_nb_quietly(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "neuron_buckets.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)  # fmt: skip
    proc.stdout.close()  # as `| head` does once it has its lines
    assert proc.stderr.read() == b"" and proc.wait(timeout=60) in (0, 1)

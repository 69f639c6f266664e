"""``nb compile`` and ``nb cache`` over a remote graph store: moto's S3 server on 127.0.0.1, reached
through s3fs with the standard AWS variables, and machines played by separate local caches.

Most compiles use the eager backend (real worker processes and stores, no compile time); the
verify test moves the session's inductor graphs through S3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest import read_manifest
from neuron_buckets.cli import app, console
from neuron_buckets.compile.store import GraphStore
from neuron_buckets.compile.store_entry import StoreEntry
from tests.conftest import TINY_CONFIG, aws_env, error_line, free_port, write_config

EAGER = TINY_CONFIG.replace('backend = "inductor"', 'backend = "eager"')
runner = CliRunner()


def nb(*args: object, cache: Path | None = None):
    """``nb`` in this process, on the machine whose local cache is ``cache``."""
    env = {"NB_CACHE_DIR": str(cache)} if cache else {}
    return runner.invoke(app, [str(a) for a in args], env=env)


def said(result) -> str:
    return " ".join(result.output.split())


def shas(out: Path) -> dict[str, str]:
    return {key: rec.sha256 for key, rec in read_manifest(out).pieces.items()}


@pytest.fixture
def eager_config(hf_model_dir: Path, tmp_path: Path) -> Path:
    return write_config(tmp_path, hf_model_dir, EAGER)


@pytest.fixture
def remote(s3_bucket: str) -> str:
    return f"s3://{s3_bucket}/graphs"


def test_a_second_machine_with_an_empty_cache_compiles_nothing_and_verifies_clean(
    compiled_dir, graph_cache_dir, tiny_config_file, remote, tmp_path
):
    """Machine A has the session's inductor graphs in its local cache: its compile fills the
    remote store. Machine B, with an empty local cache and a new output directory, pulls them."""
    a = nb("compile", tiny_config_file, "--out", tmp_path / "a", "--cache-dir", remote, cache=graph_cache_dir)
    assert a.exit_code == 0, a.output
    assert f"sharing {remote}" in said(a) and "compiled 0, reused 8, failed 0" in said(a)
    store = GraphStore(remote)
    assert {e.key for e in store.entries()} == set(shas(tmp_path / "a"))

    machine_b = tmp_path / "machine-b-cache"
    b = nb("compile", tiny_config_file, "--out", tmp_path / "b", "--cache-dir", remote, cache=machine_b)
    assert b.exit_code == 0, b.output
    assert "compiled 0, reused 8, failed 0" in said(b)
    assert shas(tmp_path / "b") == shas(tmp_path / "a") == {e.key: e.sha256 for e in store.entries()}
    assert len(GraphStore(machine_b).entries()) == 8  # pulled into B's local cache, then linked
    verify = nb("verify", tmp_path / "b")
    assert verify.exit_code == 0, verify.output
    assert "FAIL" not in verify.output


def compile_process(
    config: Path, out: Path, cache: Path, remote: str, env: dict[str, str]
) -> subprocess.Popen:
    """``nb compile`` as its own process, as on another machine."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from neuron_buckets.cli import app; app()",
            "compile",
            str(config),
            "--out",
            str(out),
            "--cache-dir",
            remote,
        ],
        env={**os.environ, **env, "NB_CACHE_DIR": str(cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_concurrent_compiles_of_one_grid_produce_each_graph_once(
    eager_config, remote, s3_endpoint, tmp_path
):
    env = aws_env(s3_endpoint, tmp_path)
    procs = [
        compile_process(eager_config, tmp_path / f"out{i}", tmp_path / f"cache{i}", remote, env)
        for i in (0, 1)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    store = GraphStore(remote)
    entries = {e.key: e for e in store.entries()}
    assert len(entries) == 8
    names = store.names()
    assert len(names) == 16  # one record and one graph per piece: nothing twice, nothing half
    for entry in entries.values():
        assert store.fetch(entry, tmp_path / "check")
    assert shas(tmp_path / "out0") == shas(tmp_path / "out1") == {k: e.sha256 for k, e in entries.items()}


def test_a_truncated_or_tampered_remote_entry_is_detected_and_compiled_again(eager_config, remote, tmp_path):
    first = nb("compile", eager_config, "--out", tmp_path / "a", "--cache-dir", remote, cache=tmp_path / "ca")
    assert first.exit_code == 0, first.output
    store = GraphStore(remote)
    by_piece = {e.piece: e for e in store.entries()}
    bucket, prefix = remote.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3")
    truncated, tampered = by_piece["layer_t16_b2_c128_packed"], by_piece["head"]
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{truncated.graph_name}")["Body"].read()
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{truncated.graph_name}", Body=body[: len(body) // 2])
    record_key = f"{prefix}/{StoreEntry.record_name(tampered.key, tampered.ext)}"
    s3.put_object(Bucket=bucket, Key=record_key, Body=json.dumps({"sha256": "0" * 64}).encode())

    again = nb("compile", eager_config, "--out", tmp_path / "c", "--cache-dir", remote, cache=tmp_path / "cc")
    assert again.exit_code == 0, again.output
    assert said(again).count("discarded") == 2 and "compiled 2, reused 6, failed 0" in said(again)
    entries = {e.piece: e for e in store.entries()}
    assert len(entries) == 8
    for entry in entries.values():  # republished whole
        assert store.fetch(entry, tmp_path / "check")
    assert shas(tmp_path / "c") == shas(tmp_path / "a")  # eager graphs are deterministic

    fresh = nb("compile", eager_config, "--out", tmp_path / "d", "--cache-dir", remote, cache=tmp_path / "cd")
    assert "compiled 0, reused 8" in said(fresh) and "damaged" not in said(fresh)


def test_a_failed_compile_is_never_cached(eager_config, remote, tmp_path):
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    local = tmp_path / "local"
    compiler = Compiler(load_config(eager_config), tmp_path / "out", remote, local_cache=local)
    head = compiler.plan.keys[compiler.plan.bucket_pieces[compiler.plan.buckets[0]]["head"]]
    blocked = GraphStore(remote).path(StoreEntry.record_name(head, "json"))
    GraphStore(remote).fs.pipe_file(blocked, b"not a record")  # the remote refuses head's publish
    report = compiler.run(jobs=2)
    assert [o.name for o in report.failed] == ["head"]
    assert {e.piece for e in GraphStore(remote).entries()} == {o.name for o in report.compiled}
    assert "head" not in {e.piece for e in GraphStore(local).entries()}  # nor cached locally


def test_dry_run_says_where_each_bucket_comes_from_and_writes_nothing(
    eager_config, hf_model_dir, remote, tmp_path
):
    fresh = nb(
        "compile",
        eager_config,
        "--dry-run",
        "--out",
        tmp_path / "o",
        "--cache-dir",
        remote,
        cache=tmp_path / "c1",
    )
    assert fresh.exit_code == 0, fresh.output
    assert said(fresh).count(
        " to compile "
    ) == 4 and "8 of 8 pieces to compile, time unknown (no history)" in said(fresh)
    assert not (tmp_path / "o").exists() and not (tmp_path / "c1").exists()

    assert (
        nb(
            "compile", eager_config, "--out", tmp_path / "o", "--cache-dir", remote, cache=tmp_path / "c1"
        ).exit_code
        == 0
    )
    grown = EAGER.replace("tokens_buckets = [16, 32]", "tokens_buckets = [16, 24, 32]")
    (tmp_path / "grown").mkdir()
    config = write_config(tmp_path / "grown", hf_model_dir, grown)
    rows = {}
    for out, cache in (
        (tmp_path / "o", tmp_path / "c1"),
        (tmp_path / "new", tmp_path / "c1"),
        (tmp_path / "new", tmp_path / "c2"),
    ):
        result = nb("compile", config, "--dry-run", "--out", out, "--cache-dir", remote, cache=cache)
        assert result.exit_code == 0, result.output
        rows[(out.name, cache.name)] = {
            cells[0]: cells[1:]
            for line in result.output.splitlines()
            if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 3
        }
    assert rows[("o", "c1")]["prefill_s16"] == ["output dir", "-"]
    place, estimate = rows[("o", "c1")]["prefill_s24"]
    assert place == "to compile" and estimate != "?"  # from the layers' recorded compile times
    assert rows[("new", "c1")]["decode_b1_c128"] == ["local cache", "-"]
    assert rows[("new", "c2")]["decode_b1_c128"] == ["remote cache", "-"]
    assert not (tmp_path / "new").exists() and not (tmp_path / "c2").exists()


def test_cache_push_pull_ls_and_prune(eager_config, remote, tmp_path, monkeypatch):
    monkeypatch.setattr(console.out, "width", 240)  # the listing's cells unwrapped and untruncated
    local = tmp_path / "local"
    assert nb("compile", eager_config, "--out", tmp_path / "o", "--cache-dir", local).exit_code == 0
    push = nb("cache", "push", remote, "--cache-dir", local)
    assert push.exit_code == 0, push.output
    assert "copied 8 entries" in said(push)
    assert "copied 0 entries" in said(nb("cache", "push", remote, "--cache-dir", local))

    pull = nb("cache", "pull", remote, "--cache-dir", tmp_path / "other")
    assert "copied 8 entries" in said(pull) and "0 damaged" in said(pull)
    assert {e.sha256 for e in GraphStore(tmp_path / "other").entries()} == {
        e.sha256 for e in GraphStore(local).entries()
    }

    listing = nb("cache", "ls", "--cache-dir", remote)
    assert listing.exit_code == 0, listing.output
    text = said(listing)
    assert "8 entries" in text and all(e.key[:10] in text for e in GraphStore(remote).entries())
    assert "neuron-buckets" in text and "ok" in text and "missing" not in text

    prune = nb("cache", "prune", "--cache-dir", remote, "--max-size", "0B")
    assert prune.exit_code == 0 and "removed 8 entries" in said(prune)
    assert GraphStore(remote).names() == {}
    assert "give --older-than-days, --max-size or both" in error_line(
        nb("cache", "prune", "--cache-dir", remote)
    )


@pytest.mark.parametrize(
    ("env", "location", "message"),
    [
        ({}, "foo://bucket/graphs", "graph store foo://bucket/graphs: Protocol not known: foo"),
        ({}, "s3://no-such-bucket-here/graphs", "'no-such-bucket-here' does not exist"),
        ({"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}, None, "Unable to locate credentials"),
        ({"AWS_ENDPOINT_URL": "closed"}, None, "Could not connect to the endpoint URL"),
    ],
    ids=["bad-url", "no-bucket", "no-credentials", "unreachable"],
)
def test_a_store_that_cannot_be_used_is_one_error_line_naming_it(
    eager_config, remote, monkeypatch, tmp_path, env, location, message
):
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    location = location or remote
    for command in (("compile", eager_config, "--out", tmp_path / "out"), ("cache", "ls")):
        line = error_line(nb(*command, "--cache-dir", location, cache=tmp_path / "local"))
        assert line.startswith(f"error: graph store {location}: ") and message in line
    assert not (tmp_path / "out").exists()

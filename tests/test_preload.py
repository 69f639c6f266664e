"""`nb serve --preload`: every graph is loaded before the first request, not by it."""

from __future__ import annotations

import inspect

import pytest
from typer.testing import CliRunner

from neuron_buckets.cli import app
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.server.api_server import run_server

pytestmark = pytest.mark.slow


def test_preload_loads_every_piece_before_any_step(compiled_dir):
    lazy = LLMEngine.open(compiled_dir)
    assert lazy.runtime.loaded == []
    eager = LLMEngine.open(compiled_dir, preload=True)
    pieces = {k for r in eager.runtime.records.values() for k in r.pieces.values()}
    assert set(eager.runtime.loaded) == pieces and pieces


def test_serve_passes_preload_to_the_server(monkeypatch, tmp_path):
    seen = {}

    def fake_run_server(*args, **kwargs) -> None:
        seen["args"] = inspect.signature(run_server).bind(*args, **kwargs).arguments

    monkeypatch.setattr("neuron_buckets.server.api_server.run_server", fake_run_server)
    for flags, expected in (([], False), (["--preload"], True)):
        result = CliRunner().invoke(app, ["serve", str(tmp_path), *flags])
        assert result.exit_code == 0, result.output
        assert seen.pop("args").get("preload", False) is expected

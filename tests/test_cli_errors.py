"""The CLI's one error path: every expected failure is one plain ``error:`` line and exit status 2;
anything else keeps its traceback and asks for a bug report."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from neuron_buckets.cli import app
from tests.conftest import error_line

runner = CliRunner()


def nb(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def test_brackets_in_a_message_are_printed_as_is_not_parsed_as_markup(tmp_path: Path):
    line = error_line(nb("generate", tmp_path, "--prompt", "[/a]"))
    assert "'[/a]'" in line


def test_a_config_error_keeps_the_section_name_in_brackets(tmp_path: Path):
    config = tmp_path / "x.toml"
    config.write_text("[cache]\nblock_sise = 16\n")
    line = error_line(nb("grid", config))
    assert f"{config}: [cache] unknown key(s) ['block_sise']" in line


def test_a_long_message_stays_on_one_line(tmp_path: Path):
    config = tmp_path / ("deep-" * 30) / "x.toml"
    assert str(config) in error_line(nb("grid", config))


def test_an_unexpected_exception_keeps_its_traceback_and_asks_for_a_bug_report(monkeypatch):
    def broken(config):
        raise KeyError("vocab")

    monkeypatch.setattr("neuron_buckets.cli.main.enumerate_grid", broken)
    result = nb("grid")
    assert result.exit_code == 1
    assert "Traceback" in result.output and "KeyError: 'vocab'" in result.output
    assert result.output.splitlines()[-1].startswith("error: unexpected KeyError: this is a bug in nb")

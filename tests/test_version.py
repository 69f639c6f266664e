"""One version number: the package's. The build, ``nb --version`` and every manifest read it."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration
from typer.testing import CliRunner

from neuron_buckets._version import __version__
from neuron_buckets.cli import app
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.config import load_config
from tests.conftest import write_config

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def test_the_build_reads_the_package_version():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert read_configuration(PYPROJECT)["project"]["version"] == __version__


def test_nb_and_the_manifest_name_the_package_version(hf_model_dir, tmp_path):
    assert CliRunner().invoke(app, ["--version"]).stdout.split() == ["neuron-buckets", __version__]
    compiler = Compiler(load_config(write_config(tmp_path, hf_model_dir)), tmp_path / "out", tmp_path / "c")
    assert compiler.plan.header.toolchain == {"name": "neuron-buckets", "version": __version__}

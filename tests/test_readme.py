"""The README as a user follows it: its "your own model" config compiles as written, its Runtime
snippet runs on an artifact without a tokenizer, every speed it and docs/ quote stands in
bench/RESULTS.md, and its text stays readable (no line past 300 characters); no text of the
repository names an issue. The README stays a product page and the changelog a short history
(sizes pinned, one Unreleased heading), the reference living in docs/, every relative link of which
leads to a file and heading that exist."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock
from typer.testing import CliRunner

from neuron_buckets.cli import app
from tests.conftest import save_tiny_llama

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "bench" / "RESULTS.md").read_text()
SPEED = re.compile(r"\b(\d+(?:\.\d+)?) ?(tok/s|ms|GB/s|GFLOP/s|x)\b")  # a speed, or a ratio ("1.37x")


def result_figures() -> set[tuple[str, str]]:
    """Each (number, unit) bench/RESULTS.md holds: a ratio as written ("1.37x"), another number in a
    column whose title names its unit."""
    found, columns = set(), []
    for line in RESULTS.splitlines():
        if line.startswith("## "):
            columns = []
        elif line.startswith("|") and not columns:
            columns = [c.strip() for c in line.strip("|").split("|")]
        elif line.startswith("| "):
            for title, cell in zip(columns, line.strip("|").split("|"), strict=True):
                found |= {(m[1], "x") for m in re.finditer(r"(\d+\.\d+)x\b", cell)}
                found |= {(n, unit) for n in re.findall(r"\d+(?:\.\d+)?", cell)
                          for unit in ("tok/s", "ms", "GB/s", "GFLOP/s") if unit in title}
    return found


def unbacked(text: str) -> list[str]:
    """The speed figures of ``text`` that no cell of bench/RESULTS.md holds: figures no bench wrote."""
    held = result_figures()
    return [m[0] for m in SPEED.finditer(text) if (m[1], m[2]) not in held]


DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_BYTES = 30_000
CHANGELOG_MAX_BYTES = 25_000


def block(section: str, lang: str) -> str:
    """The first ``lang`` code block under the README heading ``section``."""
    body = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"```{lang}\n(.*?)```", body, re.S)
    assert match, f"no {lang} block under {section}"
    return match[1]


def test_the_own_model_config_compiles_as_written(tmp_path: Path) -> None:
    config = block("Your own model", "toml")
    assert len(config.strip().splitlines()) <= 3
    name = re.search(r'path = "([^"]+)"', config)[1]
    save_tiny_llama(tmp_path / name)  # the directory the config names, beside it
    (tmp_path / "my-model.toml").write_text(config)
    result = CliRunner().invoke(
        app, ["compile", str(tmp_path / "my-model.toml"), "--dry-run", "--out", str(tmp_path / "art"),
              "--cache-dir", str(tmp_path / "cache")],  # fmt: skip
    )
    assert result.exit_code == 0, result.output
    assert "pieces to compile" in result.stdout
    assert "cp manifests/default.toml my-model.toml" in README


def test_quick_start_says_what_it_needs() -> None:
    quick = README.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    assert "python3 -m venv .venv && . .venv/bin/activate" in quick
    assert "7 GB" in quick and "make test" in quick
    assert not re.search(r"\b\d+ pieces\b", README)  # piece counts drift: nb compile --dry-run says


def test_every_speed_figure_the_readme_and_docs_quote_stands_in_results() -> None:
    quoted = {path.name: unbacked(path.read_text()) for path in (ROOT / "README.md", *DOCS)}
    assert quoted == {name: [] for name in quoted}
    told = "TP=2 generated 30.0 tok/s against TP=1's 21.8 (1.38x)"  # figures no bench wrote
    assert unbacked(told) == ["30.0 tok/s", "1.38x"]
    matrix = "| Llama-3.2-1B | bfloat16 | independent |"
    serving = RESULTS.split("\n## Serving: nb against vLLM CPU (bench_matrix.py)\n", 1)[1]
    row = next(line for line in serving.splitlines() if line.startswith(matrix))
    ratios, rates = re.findall(r"\| (\d+\.\d\dx) \|", row), re.findall(r"\| (\d+\.\d) / ", row)
    assert ratios and rates and unbacked(f"nb served {rates[0]} tok/s, {ratios[0]} vLLM's") == []


def _repository_text() -> list[Path]:
    """Every text file of the repository a reader meets: code, kernels, manifests, benches, tests
    (this one aside: it spells the word it looks for), docs and the changelog."""
    tops = ["neuron_buckets", "kernels", "manifests", "bench", "tests", "docs"]
    found = [p for top in tops for p in (ROOT / top).rglob("*")
             if p.suffix in (".py", ".md", ".toml", ".json", ".cpp") and "__pycache__" not in p.parts]
    found += [ROOT / name for name in ("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml")]
    return [p for p in found if p != Path(__file__)]


def test_no_line_is_long_and_no_text_names_an_issue() -> None:
    texts = {p: p.read_text() for p in _repository_text()}
    assert ROOT / "bench" / "RESULTS.md" in texts and ROOT / "neuron_buckets" / "__init__.py" in texts
    for path, text in texts.items():
        if path.name == "README.md":
            long = [n for n, line in enumerate(text.splitlines(), 1) if len(line) > 300]
            assert long == [], f"README lines over 300 characters: {long}"
        assert not re.search(r"\bissues?\b", text, re.I), f"{path} names an issue"
    assert "bench/RESULTS.md" in README


@pytest.mark.slow
def test_the_runtime_snippet_runs_on_an_artifact_without_a_tokenizer(compiled_dir: Path) -> None:
    snippet = block("Runtime", "python").replace('"nb-artifacts"', repr(str(compiled_dir)))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102 - the README's own code
    lines = printed.getvalue().splitlines()
    assert lines[0].endswith("length") and lines[-1].startswith("{")


def test_the_readme_is_a_product_page_and_the_changelog_a_short_history() -> None:
    """The reference moved to docs/ so the README stays readable at a glance; the changelog says what
    changed and why, and links to bench/RESULTS.md for a run's figures instead of repeating them."""
    assert len(README.encode()) <= README_MAX_BYTES
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert len(changelog.encode()) <= CHANGELOG_MAX_BYTES
    headings = re.findall(r"^## (.*)$", changelog, re.M)
    assert len(headings) >= 3 and [h for h in headings if h.startswith("Unreleased")] == ["Unreleased"]
    assert headings[0] == "Unreleased"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_readme_changelog_and_docs_leads_somewhere() -> None:
    assert {"serving.md", "runtime.md", "tensor-parallel.md", "quantization.md", "design.md"} <= {
        p.name for p in DOCS}
    checked = 0
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS]:
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL, not a file of the repository
            name, _, anchor = target.partition("#")
            path = (page.parent / name).resolve() if name else page
            assert path.is_file(), f"{page.name}: {target} names no file"
            if anchor:
                slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
                assert anchor in slugs, f"{page.name}: {target} names no heading of {path.name}"
            checked += 1
    assert checked >= 30  # the README's and the docs' links, not a page the pattern missed


@pytest.mark.slow
@pytest.mark.xdist_group("real-model")
def test_the_real_model_commands_work_as_written(
    real_gguf: Path, graph_cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make real-model``'s recipe, then the two nb commands as the README spells them, in a fresh
    folder (the graph cache is the suite's, so the pieces test_real_model.py built are reused)."""
    lines = block("A real model in three commands", "sh").splitlines()
    commands = [line.split("  #")[0].strip() for line in lines]
    assert len(commands) == 3 and commands[0] == "make real-model"
    recipe = re.search(r"^real-model:\n\t\$\(PY\) (.+)$", (ROOT / "Makefile").read_text(), re.M)[1].split()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NB_CACHE_DIR", str(graph_cache_dir))
    fetched = subprocess.run([sys.executable, str(ROOT / recipe[0]), *recipe[1:]], check=True,
                             capture_output=True, text=True)
    assert fetched.stdout.strip() == str(real_gguf)
    graph_cache_dir.mkdir(parents=True, exist_ok=True)
    for command in commands[1:]:
        args = shlex.split(command)
        assert args[0] == "nb"
        with FileLock(str(graph_cache_dir) + ".lock"):
            result = CliRunner().invoke(app, args[1:])
        assert result.exit_code == 0, result.output
    assert "The capital of France is Paris." in result.stdout

"""The benches' bookkeeping: every bench `make bench` runs writes its own section of RESULTS.md,
rows merged by cell with their provenance; and the serving matrix's equal KV capacity."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from bench import bench_preemption, bench_preemption_serve
from bench.real_models import SHAPES
from bench.results_table import PROVENANCE, ResultsTable
from bench.serve_limits import GIB, ServeLimits

ROOT = Path(__file__).parents[1]
BENCH = ROOT / "bench"

TABLE = ResultsTable("Serving", "What the rows are.", ("shape", "conc", "tok/s", "note"), key=2)
OTHER = ResultsTable("Roofline", "Per shape.", ("shape", "ms"), key=1)


def test_a_run_replaces_its_own_cells_and_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    TABLE.merge(path, [["A", "4", "10.0", "first"], ["B", "4", "20.0", "first"]])
    path.write_text(path.read_text() + "\n" + OTHER.render([["A", "5.0"]]))
    TABLE.merge(path, [["B", "4", "25.0", "second"], ["C", "8", "30.0", "second"]])
    assert TABLE.rows(path) == [["A", "4", "10.0", "first"], ["B", "4", "25.0", "second"],
                                ["C", "8", "30.0", "second"]]
    text = path.read_text()
    assert text.index("## Serving") < text.index("## Roofline")
    assert text.rstrip().endswith("| A | 5.0 |")
    assert "What the rows are." in text


def test_two_tables_share_one_file(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    TABLE.merge(path, [["A", "4", "10.0", ""]])
    OTHER.merge(path, [["A", "5.0"]])
    TABLE.merge(path, [["A", "4", "11.0", ""]])
    assert TABLE.rows(path) == [["A", "4", "11.0", ""]]
    assert OTHER.rows(path) == [["A", "5.0"]]


def test_a_row_of_the_wrong_width_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has 2 cells, not 4"):
        TABLE.merge(tmp_path / "RESULTS.md", [["A", "4"]])
    assert not (tmp_path / "RESULTS.md").exists()


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nb_gets_at_most_the_kv_bytes_vllm_gets_and_less_than_a_block_fewer(shape: str, dtype: str) -> None:
    limits = ServeLimits()
    block = limits.block_size * limits.bytes_per_token(SHAPES[shape], dtype)
    nb_bytes = limits.num_blocks(SHAPES[shape], dtype) * block
    assert limits.kv_cache_gib * GIB - block < nb_bytes <= limits.kv_cache_gib * GIB
    config = limits.nb_config(Path("/m"), SHAPES[shape], dtype)
    assert f"num_blocks = {limits.num_blocks(SHAPES[shape], dtype)}\n" in config
    assert f'dtype = "{dtype}"' in config


def test_llama_1b_bfloat16_bytes_per_token() -> None:
    # 16 layers x 8 kv heads x 64 dims, K and V, 2 bytes: 32 KiB a token, so 1 GiB is 2048 blocks of 16
    assert ServeLimits().bytes_per_token(SHAPES["llama-3.2-1b"], "bfloat16") == 32768
    assert ServeLimits().num_blocks(SHAPES["llama-3.2-1b"], "bfloat16") == 2048


def make_bench() -> list[str]:
    """The scripts the Makefile's ``bench`` target runs (``python -m bench.NAME``), in order."""
    target = (ROOT / "Makefile").read_text().split("\nbench:\n", 1)[1].split("\n\n", 1)[0]
    return list(dict.fromkeys(f"{name}.py" for name in re.findall(r"-m bench\.(\w+)", target)))


def tables(script: str) -> dict[str, ast.Call]:
    """The module-level ``ResultsTable(...)`` assignments of a bench script, by name."""
    tree = ast.parse((BENCH / script).read_text())
    return {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "ResultsTable"
            for t in node.targets}


def test_make_bench_runs_every_bench_the_readme_lists_and_every_bench_there_is() -> None:
    run = make_bench()
    scripts = sorted(p.name for p in BENCH.glob("*.py") if p.name.startswith(("bench_", "profile_")))
    assert sorted(run) == scripts
    section = (ROOT / "README.md").read_text().split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    listed = {name for line in section.splitlines() if line.startswith("| `")
              for name in re.findall(r"`(\w+\.py)`", line.split("|")[1])}
    assert listed == set(run)


@pytest.mark.parametrize("script", make_bench())
def test_every_bench_make_bench_runs_writes_its_own_section(script: str) -> None:
    source = (BENCH / script).read_text()
    found = tables(script)
    assert found, f"{script} defines no ResultsTable"
    written = {node.func.value.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
               and isinstance(node.func, ast.Attribute) and node.func.attr in ("write", "merge")
               and isinstance(node.func.value, ast.Name)}
    assert set(found) <= written, f"{script} never writes {set(found) - written}"
    for call in found.values():
        fields = {k.arg: k.value for k in call.keywords}
        assert ast.literal_eval(fields["heading"]).endswith(f"({script})")
        assert ast.get_source_segment(source, fields["about"]).lstrip('f"\n').startswith(f"`bench/{script}`")
        columns = ast.get_source_segment(source, fields["columns"])
        assert "*PROVENANCE" in columns, f"{script}: rows without their date, CPU and commit"
    assert "add_results_argument(" in source, f"{script} takes no --results"


def test_no_two_benches_write_the_same_section() -> None:
    headings = [ast.literal_eval({k.arg: k.value for k in call.keywords}["heading"])
                for script in make_bench() for call in tables(script).values()]
    assert len(headings) == len(set(headings)) > len(make_bench())


def test_a_bench_run_writes_rows_with_their_provenance(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n" + OTHER.render([["kept", "1.0"]]))
    argv = ["bench_preemption.py", "--num-blocks", "24,40", "--watermarks", "0", "--requests", "8", "--long",
            "--results", str(path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_preemption.main()
    rows = bench_preemption.TABLE.rows(path)
    assert [r[2:4] for r in rows] == [["24", "0.00"], ["40", "0.00"]]
    date, cpu, commit = (rows[0][bench_preemption.TABLE.columns.index(c)] for c in PROVENANCE)
    assert re.fullmatch(r"20\d\d-\d\d-\d\d \d\d:\d\d", date) and "cores" in cpu and commit
    text = path.read_text()
    assert "`bench/bench_preemption.py`: the scheduler alone" in text
    assert text.rstrip().endswith("| kept | 1.0 |")


def test_the_gauges_are_averaged_over_the_clients_run_only() -> None:
    """Samples of the idle server while the client starts (and after it ends) are left out: the run
    is the client's ``duration`` up to the last sample in which the server held a request."""
    sampler = bench_preemption_serve.GaugeSampler(port=0)
    sampler.times = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2]
    sampler.samples = {"running": [0, 1, 0, 4, 6, 2, 0], "waiting": [0, 0, 0, 2, 1, 0, 0],
                       "kv_use": [0, 0.1, 0, 0.5, 0.9, 0.3, 0]}
    means, kept = sampler.means(duration=0.4)  # the run: 0.6 to 1.0; the idle start, test prompt, end out
    assert kept == 3 and means["running"] == 12 / 3 and means["waiting"] == 3 / 3
    assert sampler.means(duration=10.0)[1] == 6  # all up to the last busy sample

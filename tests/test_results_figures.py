"""bench/RESULTS.md as its benches wrote it: every ratio cell is its row's raw cells divided as the
table declares (the declaration the writer computes from), every section is a bench's table, and
the notes written by hand live in dated files under bench/notes/, linked from the file's opening."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from bench.results_table import (
    NOT_RECORDED,
    NOTES,
    PEERS,
    RESULTS,
    Ratio,
    ResultsTable,
    foreign_sections,
    header,
    nb_threads,
    vllm_settings,
)
from tests.test_bench_results import make_bench


def bench_tables() -> list[ResultsTable]:
    """Every table the benches `make bench` runs write, the ones made in a function included."""
    found = []
    for script in make_bench():
        module = importlib.import_module(f"bench.{script.removesuffix('.py')}")
        found += [v for v in vars(module).values() if isinstance(v, ResultsTable)]
        found += [module.served_table()] if hasattr(module, "served_table") else []
    return found


TABLES = bench_tables()
MATRIX = next(t for t in TABLES if t.heading.endswith("(bench_matrix.py)"))


def mismatches(path: Path) -> tuple[list[str], int]:
    """What any bench's table finds wrong in ``path``, and how many ratio cells it checked."""
    found, checked = [], 0
    for table in TABLES:
        wrong, n = table.mismatches(path)
        found, checked = found + wrong, checked + n
    return found, checked


def test_every_committed_ratio_is_what_its_raw_columns_give() -> None:
    found, checked = mismatches(RESULTS)
    assert found == []
    assert checked >= 100, f"only {checked} ratio cells checked"  # 127 when the check was written


def test_a_hand_edited_ratio_or_figure_fails(tmp_path: Path) -> None:
    row = MATRIX.rows(RESULTS)[0]
    line = "| " + " | ".join(row) + " |"
    cells = dict(zip(MATRIX.columns, row, strict=True))
    ratio = float(cells["tok/s nb/vLLM"].removesuffix("x"))
    nb, vllm = cells["out tok/s nb / vLLM"].split(" / ")
    at = {c: MATRIX.columns.index(c) for c in ("tok/s nb/vLLM", "out tok/s nb / vLLM")}
    edits = {"ratio": {**dict(enumerate(row)), at["tok/s nb/vLLM"]: f"{ratio + 0.1:.2f}x"},
             "figure": {**dict(enumerate(row)), at["out tok/s nb / vLLM"]: f"{float(nb) * 1.1:.1f} / {vllm}"}}
    for what, cells_at in edits.items():
        edited = [cells_at[i] for i in range(len(row))]
        copy = tmp_path / f"{what}.md"
        copy.write_text(RESULTS.read_text().replace(line, "| " + " | ".join(edited) + " |", 1))
        found, checked = mismatches(copy)
        assert checked >= 100
        assert len(found) == 1 and "tok/s nb/vLLM" in found[0] and str(row[: MATRIX.key]) in found[0], (
            what, found)


def test_a_ratio_holds_within_its_cells_rounding_and_no_further() -> None:
    ratio = Ratio("tok/s")
    assert ratio.cell({"tok/s": "23.4 / 15.1"}) == "1.55x"
    assert ratio.holds({"tok/s": "23.4 / 15.1"}, "1.55x")
    assert ratio.holds({"tok/s": "23.4 / 15.1"}, "1.56x")  # 23.44 / 15.06, taken before rounding
    assert not ratio.holds({"tok/s": "23.4 / 15.1"}, "1.57x")
    assert not ratio.holds({"tok/s": "23.4 / 15.1"}, "1.5x")
    assert ratio.cell({"tok/s": f"{NOT_RECORDED} / 2.0"}) == NOT_RECORDED
    assert ratio.cell({"tok/s": "3.0 / 0.0"}) == "-"
    assert Ratio("a", "b", digits=3, suffix="").cell({"a": "12.0%", "b": "25.0%"}) == "0.480"


def test_the_writer_computes_the_ratios_and_names_the_peers_settings(tmp_path: Path) -> None:
    table = ResultsTable("Served", "`bench/x.py`: rows.", ("shape", "tok/s nb / vLLM", "tok/s nb/vLLM",
                                                            "date (UTC)", "CPU", "nb commit", *PEERS, "note"),
                         key=1, derived={"tok/s nb/vLLM": Ratio("tok/s nb / vLLM")})
    path = tmp_path / "RESULTS.md"
    with pytest.raises(ValueError, match="servers' environments"):
        table.write(path, [["A", "30.0 / 20.0", ""]])
    envs = {"nb": {"OMP_NUM_THREADS": "1"}, "vLLM": {"VLLM_CPU_KVCACHE_SPACE": "1", "PATH": "/bin"}}
    table.write(path, [["A", "30.0 / 20.0", "quiet"]], envs)
    (row,) = table.rows(path)
    cells = dict(zip(table.columns, row, strict=True))
    assert cells["tok/s nb/vLLM"] == "1.50x" and cells["note"] == "quiet"
    assert cells["nb threads"] == "1"
    assert cells["vLLM CPU settings"] == "VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=unset (auto)"
    assert table.mismatches(path) == ([], 1)


def test_the_peer_benches_name_their_threads_and_vllm_settings() -> None:
    peers = [t for t in TABLES if "vLLM CPU's OpenAI server" in t.about]  # served beside nb serve
    assert len(peers) == 4, [t.heading for t in peers]
    for table in peers:
        assert set(PEERS) <= set(table.columns), table.heading
    assert vllm_settings({"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == "VLLM_CPU_OMP_THREADS_BIND=0-1"
    assert nb_threads({"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}) == "2"


def test_results_holds_only_the_benches_tables_and_links_every_note(tmp_path: Path) -> None:
    assert foreign_sections(RESULTS, TABLES) == []
    text = RESULTS.read_text()
    present = [t for t in TABLES if t.section(RESULTS)]
    assert len(present) >= 6 and text.count("\n## ") == len(present)
    notes = sorted(NOTES.glob("*.md"))
    assert len(notes) >= 20
    for note in notes:
        assert re.fullmatch(r"20\d\d-\d\d-\d\d-[a-z0-9-]+\.md", note.name), note.name
        assert f"](notes/{note.name})" in header() and note.read_text().startswith("# " + note.name[:10])
    copy = tmp_path / "RESULTS.md"
    copy.write_text(text + "\n## Notes (written by hand)\n\na run, told by hand\n")
    assert foreign_sections(copy, TABLES) == ["## Notes (written by hand)"]
    copy.write_text(text.replace("one dated file each", "one file each", 1))
    assert foreign_sections(copy, TABLES) == ["the opening is not header()"]

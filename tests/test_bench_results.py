"""The serving matrix's bookkeeping: rows merged by cell into RESULTS.md, and equal KV capacity."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from real_models import SHAPES  # noqa: E402
from results_table import ResultsTable  # noqa: E402
from serve_limits import GIB, ServeLimits  # noqa: E402

TABLE = ResultsTable("Serving", "What the rows are.", ("shape", "conc", "tok/s", "note"), key=2)


def test_a_run_replaces_its_own_cells_and_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    TABLE.merge(path, [["A", "4", "10.0", "first"], ["B", "4", "20.0", "first"]])
    path.write_text(path.read_text() + "\n## Notes\n\nwritten by hand\n")
    TABLE.merge(path, [["B", "4", "25.0", "second"], ["C", "8", "30.0", "second"]])
    assert TABLE.rows(path) == [["A", "4", "10.0", "first"], ["B", "4", "25.0", "second"],
                                ["C", "8", "30.0", "second"]]
    text = path.read_text()
    assert text.index("## Serving") < text.index("## Notes")
    assert text.rstrip().endswith("written by hand")
    assert "What the rows are." in text


def test_two_tables_share_one_file(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    other = ResultsTable("Roofline", "Per shape.", ("shape", "ms"), key=1)
    TABLE.merge(path, [["A", "4", "10.0", ""]])
    other.merge(path, [["A", "5.0"]])
    TABLE.merge(path, [["A", "4", "11.0", ""]])
    assert TABLE.rows(path) == [["A", "4", "11.0", ""]]
    assert other.rows(path) == [["A", "5.0"]]


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

"""`nb grid`: the bucket table a config compiles, and a clean exit 2 on a bad config."""

from typer.testing import CliRunner

from neuron_buckets.cli import app
from neuron_buckets.config import enumerate_grid, load_config

runner = CliRunner()


def table_rows(output: str) -> list[tuple[str, ...]]:
    """The body rows of the rich table, cell text only."""
    lines = [line for line in output.splitlines() if "│" in line]
    return [tuple(cell.strip() for cell in line.strip("│ ").split("│")) for line in lines]


def expected_rows(config) -> list[tuple[str, ...]]:
    return [(b.kind, str(b.batch), str(b.seq), str(b.ctx), str(b.tokens)) for b in enumerate_grid(config)]


def test_help_lists_grid():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "grid" in result.stdout


def test_grid_prints_the_default_table():
    result = runner.invoke(app, ["grid"])
    assert result.exit_code == 0, result.output
    assert "kind" in result.stdout and "tokens per step" in result.stdout
    rows = table_rows(result.stdout)
    assert rows == expected_rows(load_config())
    # a prefill bucket packs up to max_num_seqs=4 requests into its 32 tokens: 32 per graph, not 4 x 32
    assert rows[0] == ("prefill", "4", "32", "256", "32")
    assert [r[0] for r in rows] == ["prefill"] * 3 + ["decode"] * 3
    assert result.stdout.rstrip().endswith(f"{len(rows)} buckets")


def test_grid_of_a_config_file_with_speculation(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text("[buckets]\nmax_num_seqs = 2\nnum_seqs_buckets = [1, 2]\nspeculation_length = 3\n")
    result = runner.invoke(app, ["grid", str(path)])
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert rows == expected_rows(load_config(path))
    decode = [r for r in rows if r[0] == "decode"]
    assert decode == [("decode", "1", "4", "256", "4"), ("decode", "2", "4", "256", "8")]


def test_bad_config_exits_2_with_a_message(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[cache]\nblock_size = 0\n")
    result = runner.invoke(app, ["grid", str(path)])
    assert result.exit_code == 2
    assert "error:" in result.stderr and "cache.block_size must be positive, got 0" in result.stderr
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_missing_config_exits_2(tmp_path):
    result = runner.invoke(app, ["grid", str(tmp_path / "absent.toml")])
    assert result.exit_code == 2
    assert "config file not found" in result.stderr


def test_grid_lists_the_draft_models_buckets_beside_the_targets(tmp_path):
    """The draft's grid is the target's with decode rows of one token: its own table."""
    path = tmp_path / "draft.toml"
    path.write_text(
        "[buckets]\nmax_num_seqs = 2\nnum_seqs_buckets = [1, 2]\nspeculation_length = 3\n"
        "[speculative]\nmethod = 'draft_model'\ndraft_model = 'small'\n"
    )
    result = runner.invoke(app, ["grid", str(path)])
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    target = expected_rows(load_config(path))
    assert rows[: len(target)] == target
    draft = rows[len(target) :]
    one_token_rows = [("decode", "1", "1", "256", "1"), ("decode", "2", "1", "256", "2")]
    assert [r for r in draft if r[0] == "decode"] == one_token_rows
    assert [r for r in draft if r[0] == "prefill"] == [r for r in target if r[0] == "prefill"]
    assert "draft model's bucket grid" in result.stdout
    assert result.stdout.rstrip().endswith(f"{len(rows)} buckets, {len(draft)} of them the draft model's")

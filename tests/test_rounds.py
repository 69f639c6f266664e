"""The rounds helper of the benches: who runs when, and which statistics a table gets; fake runners
return set figures, so nothing here is timed."""

from __future__ import annotations

import pytest

from bench.rounds import MIN_ROUNDS, Spread, best, median_ratio, order, run_rounds, spreads


def test_each_round_rotates_the_start_order_so_every_server_starts_first_as_often() -> None:
    servers = ["nb", "vLLM default", "vLLM all cores"]
    orders = [order(servers, r) for r in range(6)]
    assert orders[:3] == [servers, servers[1:] + servers[:1], servers[2:] + servers[:2]]
    assert orders[3:] == orders[:3]
    assert [o[0] for o in orders] == ["nb", "vLLM default", "vLLM all cores"] * 2
    assert [order(["nb", "vLLM"], r) for r in range(4)] == [["nb", "vLLM"], ["vLLM", "nb"]] * 2


def test_the_runner_is_called_in_that_order_and_its_figures_kept_by_round() -> None:
    calls: list[tuple[str, int]] = []
    tok_s = {"nb": [30.0, 10.0, 20.0], "vLLM": [12.0, 14.0, 13.0]}

    def run(server: str, r: int) -> dict:
        calls.append((server, r))
        return {"independent-c4": {"tok/s": tok_s[server][r], "ttft": 1.0 + r}}

    samples = run_rounds(["nb", "vLLM"], 3, run)
    assert calls == [("nb", 0), ("vLLM", 0), ("vLLM", 1), ("nb", 1), ("nb", 2), ("vLLM", 2)]
    assert samples["nb"]["independent-c4"] == {"tok/s": [30.0, 10.0, 20.0], "ttft": [1.0, 2.0, 3.0]}
    spread = spreads(samples)["nb"]["independent-c4"]["tok/s"]
    assert spread == Spread(low=10.0, median=20.0, high=30.0, rounds=3)
    assert spread.cell(".1f") == "10.0-30.0"
    assert median_ratio(samples, "nb", "vLLM", "independent-c4", "tok/s") == pytest.approx(20.0 / 13.0)
    assert best(samples, ["nb", "vLLM"], "independent-c4", "tok/s") == "nb"


def test_the_ratio_is_of_medians_not_of_any_one_round() -> None:
    figures = {"a": [1.0, 100.0, 3.0, 2.0], "b": [2.0, 2.0, 50.0, 1.0]}
    samples = run_rounds(["a", "b"], 4, lambda s, r: {"cell": {"x": figures[s][r]}})
    assert spreads(samples)["a"]["cell"]["x"].median == 2.5
    assert median_ratio(samples, "a", "b", "cell", "x") == 1.25
    assert best(samples, ["a", "b"], "cell", "x") == "a"
    assert best(samples, ["a", "b"], "cell", "x", higher=False) == "b"


def test_fewer_rounds_than_a_median_needs_or_repeated_servers_are_refused() -> None:
    with pytest.raises(ValueError, match=f"at least {MIN_ROUNDS}"):
        run_rounds(["nb", "vLLM"], MIN_ROUNDS - 1, lambda s, r: {})
    with pytest.raises(ValueError, match="distinct"):
        run_rounds(["nb", "nb"], MIN_ROUNDS, lambda s, r: {})

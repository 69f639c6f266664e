"""The runtime replay against the engine: 200 requests of a shared trace reaching LLMEngine as a
client would send them (a closed loop at a fixed concurrency, or at their arrivals on the
replayed clock) get exactly the per-bucket calls, real and padded tokens ``nb inspect`` predicts.

The artifact packs up to 8 segments per call, so at concurrency 4 the closed loop, not the row
bound, limits what is in flight: its steps differ from submitting everything at once.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from neuron_buckets.cli import app
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.traffic.replay_load import ALL_AT_ONCE, ReplayLoad
from neuron_buckets.traffic.runtime_replay import Replay, fit_requests, replay_runtime
from neuron_buckets.traffic.traces import load_trace
from tests.conftest import TINY_CONFIG, write_config
from tests.test_traces import CONV

REQUESTS = 200
WIDE = (
    TINY_CONFIG.replace('"inductor"', '"eager"')
    .replace("max_num_seqs = 2", "max_num_seqs = 8")
    .replace("num_seqs_buckets = [1, 2]", "num_seqs_buckets = [2, 4, 8]")
)
STEP_S, TOKEN_S = 0.02, 0.005  # the replayed clock of the arrival test


@pytest.fixture(scope="module")
def wide(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model's config with 8 rows per call (decode batches 2, 4 and 8), and its artifact."""
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    tmp = tmp_path_factory.mktemp("wide")
    config = write_config(tmp, hf_model_dir, WIDE)
    assert not Compiler(load_config(config), tmp / "artifact", tmp / "cache").run(jobs=1).failed
    return config, tmp / "artifact"


def write_sample(path: Path, requests: int) -> Path:
    """The first requests of the conversation trace, arrivals kept (ms), prompts scaled down 16x
    and clipped to the tiny model's 128 positions (as they are, nearly all fill every 32-token
    step alike), outputs clipped to 12 tokens (decode steps are what cost test time)."""
    full = load_trace(CONV)
    prompts, outputs = fit_requests(np.maximum(1, full.prompt_lens // 16), full.output_lens, 128, requests)
    outputs = [min(o, 12) for o in outputs]
    times = [round(1000 * t) for t in full.arrivals[:requests]]
    rows = "".join(f"{t},{p},{o}\n" for t, p, o in zip(times, prompts, outputs, strict=True))
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    return path


def predicted(config: Path, trace: Path, *options: str) -> dict[str, dict]:
    result = CliRunner().invoke(app, ["inspect", "--trace", str(trace), str(config), "--json", *options])
    assert result.exit_code == 0, result.output
    return {b.pop("bucket"): b for b in json.loads(result.stdout)["packed"]["per_bucket"]}


class Client:
    """Sends the trace's requests to an engine, random prompt tokens of the trace's lengths."""

    def __init__(self, artifact: Path, trace: Path) -> None:
        self.engine = LLMEngine(BucketRuntime.open(artifact))
        self.trace = load_trace(trace)
        gen = torch.Generator().manual_seed(0)
        lens = self.trace.prompt_lens.tolist()
        self.prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]
        self.in_flight_peak = 0

    def send(self, i: int) -> None:
        params = SamplingParams(max_tokens=int(self.trace.output_lens[i]), ignore_eos=True)
        self.engine.add_request(self.prompts[i], params)

    def step(self) -> int:
        """One engine step; how many requests finished in it."""
        done = sum(o.finished for o in self.engine.step())
        self.in_flight_peak = max(self.in_flight_peak, self.engine.num_running + self.engine.num_waiting)
        return done

    def measured(self) -> dict[str, dict]:
        return {name: s.to_json() for name, s in self.engine.stats.items() if s.calls}

    def real_tokens(self) -> int:
        return sum(s.real_tokens for s in self.engine.stats.values())


@pytest.mark.slow
def test_a_closed_loop_at_concurrency_4_counts_what_nb_inspect_predicts(wide, tmp_path) -> None:
    config, artifact = wide
    sample = write_sample(tmp_path / "sample.csv", REQUESTS)
    client = Client(artifact, sample)
    queue = deque(range(REQUESTS))
    for _ in range(4):
        client.send(queue.popleft())
    while client.engine.has_unfinished:
        for _ in range(client.step()):  # one request in for each that finished
            if queue:
                client.send(queue.popleft())
    measured = client.measured()

    assert client.in_flight_peak == 4
    assert measured == predicted(config, sample, "--concurrency", "4")
    assert measured != predicted(config, sample)  # all at once runs other steps


@pytest.mark.slow
def test_arrivals_on_the_replayed_clock_count_what_nb_inspect_predicts(wide, tmp_path) -> None:
    """100 requests: the client adds each once the clock has passed its arrival; each step
    advances the clock by the step-time model over the tokens the step computed (the counters'
    real tokens), and an idle engine waits for the next arrival."""
    config, artifact = wide
    sample = write_sample(tmp_path / "sample.csv", REQUESTS // 2)
    client = Client(artifact, sample)
    arrivals = client.trace.arrivals
    queue, clock, idle = deque(range(REQUESTS // 2)), 0.0, 0
    while queue or client.engine.has_unfinished:
        while queue and arrivals[queue[0]] <= clock:
            client.send(queue.popleft())
        if not client.engine.has_unfinished:
            clock, idle = arrivals[queue[0]], idle + 1
            continue
        before = client.real_tokens()
        client.step()
        clock += STEP_S + TOKEN_S * (client.real_tokens() - before)
    measured = client.measured()

    options = ["--arrivals", "--step-seconds", str(STEP_S), "--token-seconds", str(TOKEN_S)]
    assert measured == predicted(config, sample, *options)
    assert idle > 0 and client.in_flight_peak > 4  # the trace both runs dry and queues up
    assert measured != predicted(config, sample)


GRID = [Bucket("prefill", 4, 16, 64), Bucket("prefill", 4, 32, 64), Bucket("decode", 4, 1, 64)]


def replay(prompts: list[int], outputs: list[int], load: ReplayLoad) -> Replay:
    return replay_runtime(prompts, outputs, GRID, 64, 8, load=load)


requests_st = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6)), min_size=1, max_size=12)


@given(requests=requests_st, concurrency=st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_a_closed_loop_keeps_at_most_n_in_flight_and_n_large_is_all_at_once(requests, concurrency) -> None:
    prompts, outputs = (list(x) for x in zip(*requests, strict=True))
    loop = replay(prompts, outputs, ReplayLoad(concurrency))
    assert sum(s.real_tokens for s in loop.stats.values()) == sum(prompts) + sum(outputs) - len(prompts)
    if concurrency >= len(prompts):
        assert loop.stats == replay(prompts, outputs, ALL_AT_ONCE).stats
    if concurrency == 1:  # one request at a time: its prefill steps, then a decode step per token
        alone = [replay([p], [o], ALL_AT_ONCE).steps for p, o in requests]
        assert loop.steps == sum(alone)


def test_arrivals_further_apart_than_a_request_runs_replay_each_request_alone() -> None:
    prompts, outputs = [40, 5, 17], [3, 6, 1]
    load = ReplayLoad.of(None, np.array([0.0, 100.0, 200.0]), step_s=1.0, token_s=0.0)
    spaced = replay(prompts, outputs, load)
    alone = [replay([p], [o], ALL_AT_ONCE) for p, o in zip(prompts, outputs, strict=True)]
    assert spaced.steps == sum(r.steps for r in alone)
    assert spaced.seconds == 200.0 + alone[-1].steps  # the clock idles up to each arrival
    together = replay(prompts, outputs, ReplayLoad.of(None, np.zeros(3)))
    assert together.stats == replay(prompts, outputs, ALL_AT_ONCE).stats


def test_arrivals_are_taken_in_time_order_whatever_the_file_order() -> None:
    prompts, outputs = [9, 30, 12], [2, 4, 3]
    late_first = ReplayLoad.of(2, np.array([5.0, 0.0, 0.0]))
    in_order = ReplayLoad.of(2, np.array([0.0, 0.0, 5.0]))
    swapped = replay([30, 12, 9], [4, 3, 2], in_order)
    assert replay(prompts, outputs, late_first).stats == swapped.stats

"""The loop that re-plans a server's buckets: the trace it records, ``nb replan`` on it (nothing
better: nothing compiled; over budget; a failing piece; a new version compiling only what it
lacks), the swap between steps that keeps every request's tokens, and the server's admin routes.

One copy of the session's tiny artifact is re-planned once (its new pieces compile, in the
background, into a graph cache of this module's own) and shared by the tests that need a second
version; the others work on copies of their own.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest_versions import manifest_versions, newest_complete, read_version
from neuron_buckets.cli import app
from neuron_buckets.engine.llm_engine import LLMEngine, generate
from neuron_buckets.engine.open_artifact import open_artifact
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.replan.background_compile import BackgroundExecutor
from neuron_buckets.replan.replanner import replan
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.server.access import ServerAccess
from neuron_buckets.server.api_server import ServerLimits, create_app
from neuron_buckets.server.replan_timer import ReplanSchedule
from neuron_buckets.server.serving_admin import AdminOptions
from neuron_buckets.server.trace_recorder import ServedRequest, TraceRecorder
from neuron_buckets.traffic.traces import load_trace
from tests import failing_worker
from tests.conftest import error_line
from tests.steps_compared import assert_same_tokens
from tests.test_serve import eventually, metric_samples, post

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("replan")]
KEY = "s3cret"


def served(prompts: list[int], directory: Path, gap_ms: float = 1000.0) -> Path:
    """A trace file of ``prompts`` served ``gap_ms`` apart, 4 output tokens each, as a server
    records it."""
    recorder = TraceRecorder()
    for i, p in enumerate(prompts):
        recorder.add(ServedRequest(i * gap_ms, p, 0, 4))
    path = directory / f"trace-{len(list(directory.glob('trace-*')))}.jsonl"
    recorder.write(path)
    return path


def copy_of(artifact: Path, tmp: Path) -> Path:
    out = tmp / "artifact"
    shutil.copytree(artifact, out)
    return out


# prompts of 18 to 22 tokens: each pads to 32 on the artifact's [16, 32], to 24 on [24, 32]
BETWEEN = [18 + i % 5 for i in range(60)]


@pytest.fixture(scope="module")
def replanned(compiled_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A copy of the tiny artifact re-planned on BETWEEN: (directory, report, graph cache)."""
    tmp = tmp_path_factory.mktemp("replanned")
    directory = copy_of(compiled_dir, tmp)
    trace = load_trace(served(BETWEEN, tmp))
    report = replan(directory, trace, budget_s=3600, cache_dir=tmp / "cache", jobs=2)
    return directory, report, tmp / "cache"


def test_the_recorded_trace_holds_lengths_only_and_loads_as_nb_plan_reads_it(tmp_path):
    recorder = TraceRecorder(capacity=3)
    for i in range(5):
        recorder.add(ServedRequest(1000.0 * i, 20 + i, 8 * (i % 2), 3 + i))
    recorder.write(tmp_path / "trace.jsonl")
    trace = load_trace(tmp_path / "trace.jsonl")
    assert len(trace) == 3 and recorder.served == 5  # the newest three: the window rolls
    assert trace.prompt_lens.tolist() == [22, 23, 24]
    assert trace.cached_lens.tolist() == [0, 8, 0]
    assert trace.prefill_lens.tolist() == [22, 15, 24]
    assert trace.output_lens.tolist() == [5, 6, 7]
    assert trace.arrivals.tolist() == [0.0, 1.0, 2.0]
    keys = {k for line in recorder.jsonl().splitlines() for k in json.loads(line)}
    assert keys == {"timestamp", "input_length", "cached_tokens", "output_length"}


def test_a_replan_that_finds_nothing_better_compiles_nothing(compiled_dir, tmp_path):
    directory = copy_of(compiled_dir, tmp_path)
    trace = load_trace(served([16, 32] * 30, tmp_path))
    report = replan(directory, trace, budget_s=3600, cache_dir=tmp_path / "cache")
    assert report.outcome == "no_better", report.reason
    assert report.choice.chosen == report.choice.current == (16, 32)
    assert report.compiled == () and manifest_versions(directory) == [1]


def test_a_replan_over_its_budget_compiles_nothing(compiled_dir, tmp_path):
    directory = copy_of(compiled_dir, tmp_path)
    trace = load_trace(served(BETWEEN, tmp_path))
    report = replan(directory, trace, budget_s=0.001, cache_dir=tmp_path / "cache")
    assert report.outcome == "over_budget", report.reason
    assert report.estimate_s > 0.001 and "budget" in report.reason
    assert report.compiled == () and manifest_versions(directory) == [1]


def test_a_failing_piece_leaves_the_old_set_and_says_which_and_why(compiled_dir, tmp_path, monkeypatch):
    directory = copy_of(compiled_dir, tmp_path)
    monkeypatch.setattr(BackgroundExecutor, "run", staticmethod(failing_worker.fails))
    trace = load_trace(served(BETWEEN, tmp_path))
    report = replan(directory, trace, budget_s=3600, cache_dir=tmp_path / "cache")
    assert report.outcome == "failed"
    assert "t24" in report.reason and failing_worker.INJECTED in report.reason
    assert manifest_versions(directory) == [1] and newest_complete(directory)[0] == 1


def test_a_replan_compiles_only_the_pieces_the_new_set_lacks(replanned, compiled_dir, tmp_path):
    directory, report, cache = replanned
    assert report.outcome == "new_version", report.reason
    assert report.choice.chosen == (24, 32) and report.choice.gain > 0.5
    # only the new token bucket's layer pieces compiled; embed, head and every kept bucket's reused
    assert report.compiled and all("t24" in name for name in report.compiled)
    assert report.reused == len(read_version(directory, 2).pieces) - len(report.compiled)
    assert (directory / "manifest.json").read_bytes() == (compiled_dir / "manifest.json").read_bytes()
    version, manifest = newest_complete(directory)
    assert version == report.version == 2
    assert sorted(b.seq for b in manifest.buckets if b.kind == "prefill") == [24, 32]
    # on the new set the same traffic finds nothing better: a second run compiles nothing
    trace = served(BETWEEN, tmp_path)
    again = CliRunner().invoke(app, ["replan", str(directory), "--trace", str(trace), "--budget-s", "3600",
                                     "--cache-dir", str(cache), "--json"])
    assert again.exit_code == 0, again.output
    doc = json.loads(again.stdout)
    assert doc["outcome"] == "no_better" and doc["compiled"] == [] and doc["version"] == 2
    # a restart serves the newest complete version
    assert [b.seq for b in open_artifact(directory).runtime.buckets.prefill] == [24, 32]


def engine_on(directory: Path, version: int) -> LLMEngine:
    return LLMEngine(BucketRuntime.open(directory, manifest=read_version(directory, version)))


PROMPTS = [list(np.random.default_rng(s).integers(1, 255, n)) for s, n in enumerate((20, 23, 7, 30, 19, 21))]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_greedy_requests_in_flight_across_a_swap_keep_their_tokens(replanned):
    directory, report, _ = replanned
    want = [o.token_ids for o in generate(engine_on(directory, 1), PROMPTS, GREEDY)]
    engine = engine_on(directory, 1)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outputs: dict[int, list[int]] = {}
    for _ in range(3):  # the first requests prefill and decode on the old set
        for o in engine.step():
            outputs[o.request_id] = o.token_ids
    assert engine.num_running and engine.num_waiting  # in flight and queued, across the swap
    engine.use_manifest(read_version(directory, report.version))
    while engine.has_unfinished:
        for o in engine.step():
            outputs[o.request_id] = o.token_ids
    got = [outputs[i] for i in ids]
    assert_same_tokens(got, want, total=len(PROMPTS) * GREEDY.max_tokens)
    assert engine.stats["prefill_s24"].calls > 0  # the requests admitted after it ran on the new bucket


def test_the_server_records_its_trace_and_reloads_the_new_version_behind_the_key(replanned):
    directory, report, _ = replanned
    import threading

    import uvicorn

    engine = engine_on(directory, 1)
    hourly = AdminOptions(replan=ReplanSchedule(every_s=3600, budget_s=60))  # run by hand below
    application = create_app(engine, "tiny", ServerLimits(), ServerAccess(api_key=KEY), hourly)
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started, "the server started")
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        for p in PROMPTS[:3]:
            status, _ = post_with_key(f"{base}/v1/completions",
                                      {"model": "tiny", "prompt": [int(t) for t in p], "max_tokens": 3})
            assert status == 200
        assert get(f"{base}/admin/trace", key=None)[0] == 401
        status, text = get(f"{base}/admin/trace", key=KEY)
        records = [json.loads(line) for line in text.splitlines()]
        assert status == 200 and [r["input_length"] for r in records] == [len(p) for p in PROMPTS[:3]]
        assert [r["output_length"] for r in records] == [3, 3, 3]
        assert post(f"{base}/admin/reload", {})[0] == 401
        status, body = post_with_key(f"{base}/admin/reload", {})
        assert status == 200 and body == {"version": 2, "swapped": True, "token_buckets": [24, 32]}
        assert post_with_key(f"{base}/admin/reload", {})[1]["swapped"] is False
        samples = metric_samples(base)
        assert samples[("nb:manifest_version", frozenset({("model_name", "tiny")}))] == 2
        labels = frozenset({("model_name", "tiny"), ("bucket", "prefill_s24")})
        assert ("nb:bucket_padding_share", labels) in samples
        status, _ = post_with_key(f"{base}/v1/completions",
                                  {"model": "tiny", "prompt": [int(t) for t in PROMPTS[4]], "max_tokens": 3})
        assert status == 200 and engine.stats["prefill_s24"].calls == 1
        # the timer's re-plan: nb replan in a child process on the trace so far, which [24, 32] fits
        report = application.state.admin.timer.run_once()
        assert report["outcome"] == "no_better" and report["compiled"] == [], report
        runs = metric_samples(base)[("nb:replan_runs_total", frozenset({("model_name", "tiny"),
                                                                         ("outcome", "no_better")}))]
        assert runs == 1
    finally:
        server.should_exit = True
        thread.join(60)


def get(url: str, key: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post_with_key(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_nb_inspect_compares_two_manifest_versions_on_a_trace(replanned, tmp_path):
    directory, _, _ = replanned
    trace = served(BETWEEN, tmp_path)
    result = CliRunner().invoke(app, ["inspect", "--trace", str(trace), "--manifest", str(directory),
                                      "--versions", "1,2", "--json"])
    assert result.exit_code == 0, result.output
    old, new = json.loads(result.stdout)["versions"]
    assert (old["token_buckets"], new["token_buckets"]) == ([16, 32], [24, 32])
    assert old["calls"] == new["calls"] == len(BETWEEN) and old["real_tokens"] == sum(BETWEEN)
    # each prompt of 18 to 22 tokens pads to 32 on the old set, to 24 on the new
    assert (old["computed_tokens"], new["computed_tokens"]) == (32 * len(BETWEEN), 24 * len(BETWEEN))


def test_nb_replan_on_a_directory_that_is_no_artifact_says_so_in_one_line_and_creates_nothing(tmp_path):
    missing = tmp_path / "typo"
    result = CliRunner().invoke(app, ["replan", str(missing), "--trace", str(served(BETWEEN, tmp_path)),
                                      "--budget-s", "60"])
    assert result.exit_code == 2
    assert error_line(result) == f"error: {missing} is not an artifact directory: manifest.json is missing"
    assert not missing.exists()

"""Every key of every config section does something: it changes what ``nb compile`` records (the
manifest's header, the buckets, the pieces and their keys) or what a run does (the executor, its
retries, the drafting that ``nb generate``/``nb serve --config`` set up). A key that is checked
and then ignored fails here, and so does a new key nobody reads."""

from __future__ import annotations

import contextlib
import tomllib
from concurrent.futures import Future
from dataclasses import asdict, fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from neuron_buckets.backends import get_backend
from neuron_buckets.cli.generate import speculative_config
from neuron_buckets.compile import ray_executor
from neuron_buckets.compile.build_plan import BuildPlan
from neuron_buckets.compile.graph_cache import GraphCache
from neuron_buckets.compile.outcome import Outcome
from neuron_buckets.compile.piece_queue import PieceQueue
from neuron_buckets.compile.worker import Toolchain
from neuron_buckets.config import Config
from neuron_buckets.config.draft import draft_config
from neuron_buckets.config.loader import SECTIONS, parse_config
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.model.model_source import model_config_of
from neuron_buckets.model.pieces import PieceShape
from neuron_buckets.utils.package_data import read_package_data
from tests.conftest import save_tiny_llama

# A different valid value for each key, whose effect the probe named beside it sees.
CHANGES = {
    ("model", "path"): ("other_model_dir", "plan"),
    ("model", "task"): ("embed", "plan"),
    ("model", "pooling"): ("mean", "plan"),  # of an embedding artifact (raw_config)
    ("model", "normalize"): (False, "plan"),
    ("cache", "block_size"): (8, "plan"),
    ("cache", "num_blocks"): (64, "plan"),
    ("cache", "max_model_len"): (128, "plan"),
    ("cache", "dtype"): ("bfloat16", "plan"),
    ("cache", "enable_prefix_caching"): (False, "plan"),
    ("buckets", "max_num_seqs"): (8, "plan"),
    ("buckets", "max_num_batched_tokens"): (256, "plan"),
    ("buckets", "num_seqs_buckets"): ([1, 4], "plan"),
    ("buckets", "num_batched_tokens_buckets"): ([32, 128], "plan"),
    ("buckets", "speculation_length"): (2, "plan"),
    ("buckets", "decode_context_length_buckets"): ([128, 256], "plan"),
    ("compile", "backend"): ("eager", "plan"),
    ("compile", "device"): ("cuda", "plan"),
    ("compile", "flags"): ({"max_autotune": True}, "plan"),
    ("compile", "fresh_layers"): (True, "plan"),
    ("compile", "jobs"): (3, "executor"),
    ("compile", "executor"): ("ray", "executor"),
    ("compile", "task_cpus"): (2, "executor"),
    ("compile", "retries"): (0, "retries"),
    ("speculative", "method"): ("draft_model", "plan"),  # with a draft_model: a draft/ to build
    ("speculative", "draft_model"): ("other_model_dir", "plan"),
    ("speculative", "num_speculative_tokens"): (2, "engine"),
    ("speculative", "prompt_lookup_min"): (2, "engine"),
    ("speculative", "prompt_lookup_max"): (3, "engine"),
    ("speculative", "auto_off"): (False, "engine"),
    ("speculative", "auto_off_window"): (4, "engine"),
    ("speculative", "auto_off_probe_interval"): (7, "engine"),
    ("parallel", "tensor_parallel_size"): (2, "plan"),
}


def plan_probe(config: Config, tmp_path: Path) -> tuple:
    """What ``nb compile`` records: the manifest's header, buckets and piece keys, the draft's too."""
    def plan(c: Config) -> tuple:
        p = BuildPlan.make(c, tmp_path, get_backend(c.compile.backend), model_config_of(c.model.path), None)
        return asdict(p.header), p.buckets, sorted(p.keys.values())

    draft = draft_config(config)
    return plan(config), draft and plan(draft)


def queue(config: Config, tmp_path: Path) -> PieceQueue:
    cache = GraphCache.open(tmp_path / "cache")
    model = model_config_of(config.model.path)
    return PieceQueue(config, model, cache, Toolchain("", {}), fail_fast=False, ray_address=None)


def executor_probe(config: Config, tmp_path: Path, monkeypatch) -> tuple:
    """The executor the piece queue opens: its kind, slots and threads (Ray's, stood in for)."""
    class FakeRay:
        on_this_host = False

        def __init__(self, address, task_cpus, task_bytes, store_is_local) -> None:
            self.slots, self.threads = 4, task_cpus

        def close(self) -> None: ...

    monkeypatch.setattr(ray_executor, "RayExecutor", FakeRay)
    with queue(config, tmp_path).executor() as executor:
        return type(executor).__name__, executor.slots, executor.threads


def retries_probe(config: Config, tmp_path: Path, monkeypatch) -> int:
    """How many times the queue hands a piece whose worker always dies to a worker."""
    class Dying:
        slots, threads, on_this_host = 1, 1, True

        @contextlib.contextmanager
        def pool(self):
            def submit(task):
                fut = Future()
                fut.set_exception(RuntimeError("killed"))
                return fut
            yield submit

        def died(self, error) -> bool:
            return True

        def close(self) -> None: ...

    q = queue(config, tmp_path)
    monkeypatch.setattr(PieceQueue, "executor", lambda self, jobs=None: contextlib.nullcontext(Dying()))
    piece, done = Outcome(PieceShape("embed", 0), "k" * 64), {}
    q.run([piece], done, lambda o, err: done.setdefault(o.shape, o), lambda *_: None)
    return piece.attempts


def engine_probe(config: Config, tmp_path: Path) -> tuple:
    """The drafting ``nb serve --config`` sets up: the drafter, its gate and drafts per row."""
    file = tmp_path / "run.toml"
    spec = config.speculative
    lines = [f"{f.name} = {_toml(getattr(spec, f.name))}" for f in fields(spec)
             if f.name != "draft_model" and getattr(spec, f.name) is not None]
    file.write_text("[speculative]\n" + "\n".join(lines) + f'\ndraft_model = "{spec.draft_model}"\n')
    runtime = SimpleNamespace(
        block_size=4, num_blocks=64, manifest=SimpleNamespace(text=None),
        buckets=SimpleNamespace(token_budget=64, max_rows=4, decode_seq=4),
        owner=None, claim=lambda engine: None, check_generates=lambda: None,
    )
    loaded = replace(speculative_config(0, 0, file), method="ngram")  # a draft model needs an artifact
    engine = LLMEngine(runtime, pool=BlockPool(64, 4), speculative=loaded)
    gate = engine.gate and (engine.gate.window, engine.gate.probe_interval)
    return engine.drafter, gate, engine.scheduler.num_speculative_tokens


def _toml(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else f'"{value}"' if isinstance(
        value, str) else str(value)


def raw_config(hf_model_dir: Path, section: str, key: str) -> dict:
    """The embedded default as TOML tables, bucket lists left to follow their limits, drafting on,
    and what the key needs to act at all (Ray's task CPUs with the Ray executor, a draft model's
    path with that method, pooling an embedding artifact)."""
    raw = tomllib.loads(read_package_data("default.toml"))
    for derived in ("num_seqs_buckets", "num_batched_tokens_buckets"):
        del raw["buckets"][derived]
    raw["speculative"] = {"num_speculative_tokens": 1, "draft_model": str(hf_model_dir)}
    if key == "task_cpus":
        raw["compile"]["executor"] = "ray"
    if key == "draft_model":
        raw["speculative"]["method"] = "draft_model"
    if key in ("pooling", "normalize"):
        raw.setdefault("model", {})["task"] = "embed"
    return raw


def test_every_key_of_every_section_is_listed():
    listed = {(section.SECTION, f.name) for section in SECTIONS.values() for f in fields(section)}
    assert set(CHANGES) == listed


@pytest.mark.parametrize(("section", "key"), list(CHANGES))
def test_every_key_changes_the_manifest_or_what_a_run_does(section, key, hf_model_dir, tmp_path, monkeypatch):
    value, probe = CHANGES[section, key]
    if value == "other_model_dir":
        value = str(save_tiny_llama(tmp_path / "other", seed=1))
    raw = raw_config(hf_model_dir, section, key)
    base = parse_config(raw)
    changed = parse_config({**raw, section: {**raw.get(section, {}), key: value}})
    if key == "method":
        assert draft_config(changed) is not None and draft_config(base) is None
    probes = {
        "plan": lambda c: plan_probe(c, tmp_path),
        "executor": lambda c: executor_probe(c, tmp_path, monkeypatch),
        "retries": lambda c: retries_probe(c, tmp_path, monkeypatch),
        "engine": lambda c: engine_probe(c, tmp_path),
    }
    assert probes[probe](changed) != probes[probe](base)


def test_max_num_seqs_has_one_default():
    """A config that leaves it out, ``nb plan`` without a config and the embedded default file all
    mean the same number of requests per call."""
    from neuron_buckets.config.buckets import BucketConfig
    from neuron_buckets.traffic.planner import PlanOptions

    embedded = tomllib.loads(read_package_data("default.toml"))["buckets"]["max_num_seqs"]
    assert BucketConfig().max_num_seqs == PlanOptions(graphs=1).max_num_seqs == embedded

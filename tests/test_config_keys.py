"""Every key of every config section does something for each reader and task that accepts it, or
is refused in one line naming it. The readers are the compile config (``nb compile`` records the
manifest's header, buckets, pieces and keys, and runs its executor and retries) and the runtime
file of ``nb generate``/``nb serve --config`` (the drafting the engine sets up); the compile
config is tried for each ``model.task``. A key accepted and then ignored fails here, and so does
a new key nobody reads: the keys come from the schema, so the list cannot go stale."""

from __future__ import annotations

import contextlib
import json
import tomllib
from concurrent.futures import Future
from dataclasses import asdict, fields
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
from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.draft import draft_config
from neuron_buckets.config.loader import SECTIONS, parse_config
from neuron_buckets.config.setting import COMPILE, RUN, TASKS
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.engine import llm_engine
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.draft_model_drafter import DraftModelDrafter
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.model.model_source import model_config_of
from neuron_buckets.model.pieces import PieceShape
from neuron_buckets.utils.package_data import read_package_data
from tests.conftest import save_tiny_llama

# A different valid value for each key, whose effect the probes named beside it see (the one of
# the reader that accepts it).
CHANGES = {
    ("model", "path"): ("other_model_dir", ("plan",)),
    ("model", "task"): ("the other task", ("plan",)),
    ("model", "pooling"): ("mean", ("plan",)),
    ("model", "normalize"): (False, ("plan",)),
    ("cache", "block_size"): (8, ("plan",)),
    ("cache", "num_blocks"): (64, ("plan",)),
    ("cache", "max_model_len"): (128, ("plan",)),
    ("cache", "dtype"): ("bfloat16", ("plan",)),
    ("cache", "enable_prefix_caching"): (False, ("plan",)),
    ("buckets", "max_num_seqs"): (8, ("plan",)),
    ("buckets", "max_num_batched_tokens"): (256, ("plan",)),
    ("buckets", "num_seqs_buckets"): ([1, 4], ("plan",)),
    ("buckets", "num_batched_tokens_buckets"): ([32, 128], ("plan",)),
    ("buckets", "speculation_length"): (2, ("plan",)),
    ("buckets", "decode_context_length_buckets"): ([128, 256], ("plan",)),
    ("compile", "backend"): ("eager", ("plan",)),
    ("compile", "device"): ("cuda", ("plan",)),
    ("compile", "flags"): ({"max_autotune": True}, ("plan",)),
    ("compile", "fresh_layers"): (True, ("plan",)),
    ("compile", "jobs"): (3, ("executor",)),
    ("compile", "executor"): ("ray", ("executor",)),
    ("compile", "task_cpus"): (2, ("executor",)),
    ("compile", "retries"): (0, ("retries",)),
    # the compile config's: a draft/ to build (with a draft_model); a runtime file's: the drafter
    ("speculative", "method"): ("draft_model", ("plan", "engine")),
    ("speculative", "draft_model"): ("other_model_dir", ("plan",)),
    ("speculative", "num_speculative_tokens"): (2, ("engine",)),
    ("speculative", "prompt_lookup_min"): (2, ("engine",)),
    ("speculative", "prompt_lookup_max"): (3, ("engine",)),
    ("speculative", "auto_off"): (False, ("engine",)),
    ("speculative", "auto_off_window"): (4, ("engine",)),
    ("speculative", "auto_off_probe_interval"): (7, ("engine",)),
    ("parallel", "tensor_parallel_size"): (2, ("plan",)),
    ("lora", "max_loras"): (2, ("plan",)),
    ("lora", "max_lora_rank"): (8, ("plan",)),
    ("lora", "target_modules"): (["q_proj"], ("plan",)),
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


def engine_probe(spec: SpeculativeConfig, monkeypatch) -> tuple:
    """The drafting the engine sets up: the drafter (the artifact's draft model stood in for), its
    gate and drafts per row."""
    runtime = SimpleNamespace(
        block_size=4, num_blocks=64, manifest=SimpleNamespace(text=None),
        buckets=SimpleNamespace(token_budget=64, max_rows=4, decode_seq=4, prefill=(), mix_decode=True),
        owner=None, claim=lambda engine: None, check_generates=lambda: None,
    )
    stand_in = object.__new__(DraftModelDrafter)
    monkeypatch.setattr(llm_engine.DraftModelDrafter, "open", lambda runtime, kv_cache: stand_in)
    engine = LLMEngine(runtime, pool=BlockPool(64, 4), speculative=spec)
    gate = engine.gate and (engine.gate.window, engine.gate.probe_interval)
    drafter = "the draft model" if isinstance(engine.drafter, DraftModelDrafter) else engine.drafter
    return drafter, gate, engine.scheduler.num_speculative_tokens


def runtime_file(doc: dict, tmp_path: Path) -> SpeculativeConfig:
    """A runtime file's document, as ``nb serve --config`` loads it."""
    file = tmp_path / "run.toml"
    file.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in table.items())
                            for name, table in doc.items()))
    return speculative_config(0, 0, file)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return f"[{', '.join(map(_toml, value))}]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    return str(value)


def base_document(reader: str, task: str, key: str, hf_model_dir: Path) -> dict:
    """A valid document for ``reader`` and ``task`` without ``key``'s change, holding what the key
    needs to act at all. The compile config: the embedded default, bucket lists left to follow
    their limits (an embedding one without the decode keys), Ray's executor for its task CPUs, a
    draft model's path for a method to build it (where the task decodes), LoRA slots for their rank
    and targets. A runtime file: drafting on."""
    if reader == RUN:
        return {"speculative": {"num_speculative_tokens": 1}}
    raw = tomllib.loads(read_package_data("default.toml"))
    for derived in ("num_seqs_buckets", "num_batched_tokens_buckets", "speculation_length"):
        del raw["buckets"][derived]
    raw.setdefault("model", {})["task"] = task
    if key == "task_cpus":
        raw["compile"]["executor"] = "ray"
    if key in ("max_lora_rank", "target_modules") and task == "generate":
        raw["lora"] = {"max_loras": 1}  # slots, for their rank and targets to shape
    if key in ("method", "draft_model") and task == "generate":
        raw["speculative"] = {"draft_model": str(hf_model_dir)}
        if key == "draft_model":
            raw["speculative"]["method"] = "draft_model"
    return raw


# Each reader's probes: what it would change if it read the key.
PROBES = {COMPILE: ("plan", "executor", "retries"), RUN: ("engine",)}
CASES = [(COMPILE, task) for task in TASKS] + [(RUN, "generate")]


def test_every_key_of_every_section_is_listed():
    listed = {(section.SECTION, f.name) for section in SECTIONS.values() for f in fields(section)}
    assert set(CHANGES) == listed
    assert len(listed) >= 32


@pytest.mark.parametrize(("reader", "task"), CASES)
@pytest.mark.parametrize(("section", "key"), list(CHANGES))
def test_every_key_is_used_or_refused_by_each_reader(
    reader, task, section, key, hf_model_dir, tmp_path, monkeypatch
):
    value, probes = CHANGES[section, key]
    if value == "other_model_dir":
        value = str(save_tiny_llama(tmp_path / "other", seed=1))
    if value == "the other task":
        value = next(t for t in TASKS if t != task)
    raw = base_document(reader, task, key, hf_model_dir)
    changed_raw = {**raw, section: {**raw.get(section, {}), key: value}}
    load = parse_config if reader == COMPILE else lambda doc: runtime_file(doc, tmp_path)
    try:
        changed = load(changed_raw)
    except ConfigError as e:  # refused: in one line naming the key (or its whole table)
        message = str(e)
        assert f"{section}.{key}" in message or f"[{section}]" in message, message
        assert "\n" not in message
        return
    probe = next((p for p in probes if p in PROBES[reader]), None)
    assert probe is not None, f"{reader} accepts {section}.{key} (task {task}) and nothing reads it"
    base = load(raw)
    if key == "method" and reader == COMPILE:
        assert draft_config(changed) is not None and draft_config(base) is None
    run = {
        "plan": lambda c: plan_probe(c, tmp_path),
        "executor": lambda c: executor_probe(c, tmp_path, monkeypatch),
        "retries": lambda c: retries_probe(c, tmp_path, monkeypatch),
        "engine": lambda c: engine_probe(c, monkeypatch),
    }
    assert run[probe](changed) != run[probe](base)


def test_every_key_is_accepted_by_some_reader_and_task(hf_model_dir, tmp_path):
    """Refusal is no escape for the test above: each key is read somewhere, and the readers and
    tasks accept the keys the schema declares for them (a floor on the probed cases)."""
    accepted = {}
    for section, key in CHANGES:
        value = CHANGES[section, key][0]
        value = str(hf_model_dir) if value == "other_model_dir" else value
        for reader, task in CASES:
            raw = base_document(reader, task, key, hf_model_dir)
            doc = {**raw, section: {**raw.get(section, {}), key: task if key == "task" else value}}
            with contextlib.suppress(ConfigError):
                (parse_config if reader == COMPILE else lambda d: runtime_file(d, tmp_path))(doc)
                accepted.setdefault((section, key), []).append((reader, task))
    assert set(accepted) == set(CHANGES)
    assert sum(map(len, accepted.values())) >= 50
    assert accepted["speculative", "method"] == [(COMPILE, "generate"), (RUN, "generate")]


def test_max_num_seqs_has_one_default():
    """A config that leaves it out, ``nb plan`` without a config and the embedded default file all
    mean the same number of requests per call."""
    from neuron_buckets.config.buckets import BucketConfig
    from neuron_buckets.traffic.planner import PlanOptions

    embedded = tomllib.loads(read_package_data("default.toml"))["buckets"]["max_num_seqs"]
    assert BucketConfig().max_num_seqs == PlanOptions(graphs=1).max_num_seqs == embedded

"""Multi-LoRA in fixed slots: adapters built with peft on the tiny Llama, served by one artifact
whose layer pieces take the slots as inputs, checked against transformers + peft in float32."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from functools import reduce
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from neuron_buckets.artifact.manifest import read_manifest
from neuron_buckets.backends import get_backend
from neuron_buckets.compile.build_plan import BuildPlan
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.config import ConfigError, load_config, parse_config
from neuron_buckets.config.lora import TARGETS
from neuron_buckets.engine.llm_engine import LLMEngine, generate
from neuron_buckets.engine.lora_pool import UnknownAdapter
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.model.lora import LoraShape
from neuron_buckets.model.model_source import model_config_of
from neuron_buckets.runtime.lora_adapter import AdapterError, read_adapter
from tests.conftest import TINY_CONFIG, save_tiny_llama, wait_for_line, write_config
from tests.steps_compared import assert_follows

MAX_NEW = 8
ATOL = 1e-4  # float32 against float32
# The tiny grid with four requests a call (and eager graphs, fast to build), three slots of rank up
# to 8 over every projection.
GRID = {"inductor": "eager", "max_num_seqs = 2": "max_num_seqs = 4", "[1, 2]": "[1, 2, 4]",
        "max_num_batched_tokens = 32": "max_num_batched_tokens = 64", "[16, 32]": "[16, 32, 64]"}
LORA_CONFIG = reduce(lambda text, edit: text.replace(*edit), GRID.items(), TINY_CONFIG) + (
    "[lora]\nmax_loras = 3\nmax_lora_rank = 8\n"
)
# name -> (rank, targets): three ranks, different projections, and a fourth for more than the slots
ADAPTERS = {
    "a2": (2, ["q_proj", "v_proj"]),
    "a4": (4, list(TARGETS)),
    "a8": (8, ["o_proj", "gate_proj", "down_proj"]),
    "b4": (4, ["k_proj", "up_proj"]),
}


def save_adapter(model_dir: Path, out: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT LoRA adapter of the model, A and B both random (PEFT starts B at zeros otherwise)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


def compile_lora(directory: Path, model_dir: Path, text: str, cache: Path, jobs: int) -> Path:
    """``text`` compiled for ``model_dir`` into ``directory / "artifact"``, every piece built."""
    config = load_config(write_config(directory, model_dir, text))
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):  # the session's graph cache is shared by the xdist workers
        report = Compiler(config, directory / "artifact", cache).run(jobs=jobs)
    assert not report.failed, [o.error for o in report.failed]
    return directory / "artifact"


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Path]]:
    """The tiny Llama, its LoRA artifact (eager backend) and the adapters' directories."""
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = save_tiny_llama(tmp / "model")
    artifact = compile_lora(tmp, model_dir, LORA_CONFIG, tmp / "cache", jobs=1)
    adapters = {name: save_adapter(model_dir, tmp / name, r, t, seed)
                for seed, (name, (r, t)) in enumerate(ADAPTERS.items())}
    return artifact, model_dir, adapters


def reference(model_dir: Path, adapter: Path | None, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers (with the adapter applied as peft applies it) greedy tokens and step logits."""
    import transformers
    from peft import PeftModel

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=None,
                                    return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def poisoned_engine(artifact: Path, adapters: dict[str, Path]) -> LLMEngine:
    """An engine over caches full of NaN, with ``adapters`` loaded."""
    engine = LLMEngine.open(artifact)
    engine.runtime.k_cache.fill_(float("nan"))
    engine.runtime.v_cache.fill_(float("nan"))
    for name, path in adapters.items():
        engine.adapters.add(name, path)
    return engine


def check_against_peft(engine: LLMEngine, model_dir: Path, adapters: dict[str, Path],
                       loras: list[str | None], lengths: list[int]) -> None:
    """One ``generate`` of prompts of ``lengths`` on ``loras`` equals, per request, transformers +
    peft greedy (up to a near-tie, at least 90% of the steps), and each adapter changes the model."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.token_ids for o in generate(engine, prompts, params, loras)]
    refs = [reference(model_dir, lo and adapters[lo], p) for p, lo in zip(prompts, loras, strict=True)]
    for p, lo, (_, logits) in zip(prompts, loras, refs, strict=True):
        if lo is not None:  # the adapter matters: its logits are not the base model's
            assert (reference(model_dir, None, p)[1] - logits).abs().max() > 0.1, lo
    want, logits = zip(*refs, strict=True)
    assert_follows(want, logits, ATOL, got)


def test_a_batch_mixing_base_and_three_adapters_equals_transformers_peft(lora_setup):
    artifact, model_dir, adapters = lora_setup
    three = {n: adapters[n] for n in ("a2", "a4", "a8")}
    engine = poisoned_engine(artifact, three)
    check_against_peft(engine, model_dir, adapters, [None, "a2", "a4", "a8"], [5, 13, 9, 20])
    assert engine.adapters.swaps == 0
    assert dict(engine.adapters.requests) == {"a2": 1, "a4": 1, "a8": 1}


def test_more_adapters_than_slots_in_one_run(lora_setup):
    """Four adapters over three slots: the fourth waits for a slot, swaps an idle adapter out, and
    every request still equals its reference."""
    artifact, model_dir, adapters = lora_setup
    engine = poisoned_engine(artifact, adapters)
    loras = ["a2", "a4", "a8", "b4", None, "a2"]
    check_against_peft(engine, model_dir, adapters, loras, [6, 11, 8, 17, 4, 9])
    assert engine.adapters.swaps >= 1


def test_inductor_lora_pieces_equal_transformers_peft(lora_setup, graph_cache_dir: Path, tmp_path: Path):
    """The slots are inputs of the compiled layer piece too: the tiny grid built by inductor (the
    default backend) serves base and two adapters of other ranks as peft computes them. Its embed
    and head are the tiny artifact's, taken from the session's graph cache."""
    _, model_dir, adapters = lora_setup
    text = TINY_CONFIG + "[lora]\nmax_loras = 2\nmax_lora_rank = 8\n"
    artifact = compile_lora(tmp_path, model_dir, text, graph_cache_dir, jobs=2)
    assert read_manifest(artifact).backend.name == "inductor"
    engine = poisoned_engine(artifact, {n: adapters[n] for n in ("a2", "a8")})
    check_against_peft(engine, model_dir, adapters, ["a8", None, "a2"], [13, 6, 9])


def test_adapters_never_share_prefix_blocks(lora_setup):
    """The prefix cache is salted by adapter: a prompt cached for one adapter is a hit for the same
    adapter only."""
    artifact, _, adapters = lora_setup
    engine = poisoned_engine(artifact, {"a2": adapters["a2"], "same": adapters["a2"], "a4": adapters["a4"]})
    prompt, params = list(range(1, 34)), SamplingParams(max_tokens=2, ignore_eos=True)
    generate(engine, [prompt], params, ["a2"])
    hits = engine.pool.hits
    generate(engine, [prompt], params, ["a4"])
    generate(engine, [prompt], params, [None])
    assert engine.pool.hits == hits  # another adapter, or the base model: nothing shared
    generate(engine, [prompt], params, ["same"])  # the same bytes under another name: one adapter
    assert engine.pool.hits > hits


def test_loading_an_adapter_compiles_nothing(lora_setup):
    artifact, _, adapters = lora_setup
    engine = LLMEngine.open(artifact)
    pieces, files = dict(engine.runtime.manifest.pieces), sorted((artifact / "graphs").iterdir())
    engine.adapters.add("a8", adapters["a8"])
    generate(engine, [[1, 2, 3]], SamplingParams(max_tokens=2), ["a8"])
    assert engine.runtime.manifest.pieces == pieces and sorted((artifact / "graphs").iterdir()) == files


def test_lora_slots_add_no_bucket_and_key_only_layers(hf_model_dir: Path, tmp_path: Path):
    """The [lora] section changes the layer pieces' keys and adds nothing: same buckets, same
    pieces, embed and head shared with the artifact without slots."""
    def plan(text: str) -> BuildPlan:
        config = load_config(write_config(tmp_path, hf_model_dir, text))
        model = model_config_of(hf_model_dir)
        return BuildPlan.make(config, tmp_path / "out", get_backend("eager"), model, None)

    base = plan(LORA_CONFIG.split("[lora]")[0])
    lora = plan(LORA_CONFIG)
    assert lora.buckets == base.buckets and list(lora.keys) == list(base.keys)
    for shape, key in lora.keys.items():
        assert (key == base.keys[shape]) == (shape.role != "layer"), shape
    assert lora.header.lora is not None and asdict(lora.header.lora)["max_loras"] == 3


@pytest.mark.parametrize(("doc", "message"), [
    ({"lora": {"max_loras": -1}}, "lora.max_loras must be a non-negative integer"),
    ({"lora": {"max_lora_rank": 0}}, "lora.max_lora_rank must be positive"),
    ({"lora": {"target_modules": ["lm_head"]}}, "lora.target_modules must be a non-empty list"),
    ({"lora": {"max_loras": 2, "max_lora_ranks": 8}}, "[lora] unknown key(s) ['max_lora_ranks']"),
    ({"lora": {"max_loras": 2}, "parallel": {"tensor_parallel_size": 2}}, "LoRA slots run on one"),
    ({"lora": {"max_loras": 2}, "compile": {"backend": "stablehlo"}}, "LoRA slots are built"),
])
def test_bad_lora_sections_are_one_line(doc, message):
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_adapters_the_slots_cannot_hold_are_refused_in_one_line(lora_setup, tmp_path: Path):
    artifact, model_dir, adapters = lora_setup
    config, f32 = model_config_of(model_dir), torch.float32
    big = save_adapter(model_dir, tmp_path / "r16", 16, ["q_proj"], 9)
    wide = save_tiny_llama(tmp_path / "wide", intermediate_size=96)
    other = save_adapter(wide, tmp_path / "wide_a", 2, ["down_proj"], 9)
    cases = [
        (big, LoraShape(3, 8, TARGETS), "rank 16 is above the artifact's lora.max_lora_rank 8"),
        (adapters["a2"], LoraShape(3, 8, ("q_proj",)), "targets v_proj, which this artifact's slots lack"),
        (other, LoraShape(3, 8, TARGETS), "layer 0 down_proj has A, B of shapes ((2, 96), (64, 2))"),
        (tmp_path, LoraShape(3, 8, TARGETS), "has no adapter_config.json"),
    ]
    for path, shape, message in cases:
        with pytest.raises(AdapterError) as e:
            read_adapter("x", path, config, shape, f32)
        assert message in str(e.value) and "\n" not in str(e.value)
    engine = LLMEngine.open(artifact)
    with pytest.raises(UnknownAdapter, match="unknown LoRA adapter 'nope'"):
        engine.add_request([1, 2], SamplingParams(), "nope")


def test_nb_generate_runs_each_prompt_on_its_adapter(lora_setup):
    """``nb generate --lora NAME=PATH --adapter ...``: each prompt's ids equal transformers + peft's
    with its adapter, the base model's for ``base``; a bad adapter is one line, exit 2."""
    from typer.testing import CliRunner

    from neuron_buckets.cli import app

    artifact, model_dir, adapters = lora_setup
    prompts, loras = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8]], ["a4", None]
    args = ["generate", str(artifact), "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--stats"]
    args += [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    args += ["--lora", f"a4={adapters['a4']}", "--lora", f"a8={adapters['a8']}"]
    args += ["--adapter", "a4", "--adapter", "base"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    got = [list(map(int, line.split(","))) for line in result.stdout.splitlines() if line[:1].isdigit()]
    refs = [reference(model_dir, lo and adapters[lo], p) for p, lo in zip(prompts, loras, strict=True)]
    want, logits = zip(*refs, strict=True)
    assert_follows(want, logits, ATOL, got)
    assert "LoRA: requests per adapter a4: 1" in result.output
    a4 = f"a4={adapters['a4']}"
    for bad, line in [(["--lora", "a4"], "--lora 'a4': expected NAME=PATH"),
                      (["--lora", "a4=/nowhere"], "has no adapter_config.json"),
                      (["--lora", a4, "--adapter", "zz"], "--adapter 'zz' is no --lora name")]:
        result = CliRunner().invoke(app, ["generate", str(artifact), "--prompt-ids", "1,2", *bad])
        assert result.exit_code == 2 and line in result.output, result.output


def test_serve_picks_the_adapter_by_model_and_loads_adapters_at_run_time(lora_setup):
    """The official openai client: ``model`` names the adapter, ``/v1/models`` lists them with their
    parent, a fifth adapter loaded while serving (behind the API key) compiles nothing and serves
    at once, more adapters than slots swap (counted in ``/metrics``), errors are 400 or 404."""
    import asyncio
    import threading
    import time
    import urllib.request

    import openai
    import uvicorn

    from neuron_buckets.server.access import ServerAccess
    from neuron_buckets.server.api_server import ServerLimits, create_app

    artifact, model_dir, adapters = lora_setup
    engine = poisoned_engine(artifact, {"a2": adapters["a2"], "a4": adapters["a4"]})
    access = ServerAccess.for_bind("127.0.0.1", "key", False, ())
    app = create_app(engine, "tiny", ServerLimits(), access)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    def admin(route: str, body: dict, key: str = "key") -> int:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        request = urllib.request.Request(f"{base}/v1/{route}", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code

    async def complete(pairs: list[tuple[str, list[int]]]) -> list[list[int]]:
        c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="key", max_retries=0)
        outs = await asyncio.gather(*(c.completions.create(
            model=m, prompt=p, max_tokens=MAX_NEW, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}) for m, p in pairs))
        return [o.choices[0].token_ids for o in outs]

    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="key", max_retries=0)
        listed = [(m.id, m.parent) for m in client.models.list()]
        assert listed == [("tiny", None), ("a2", "tiny"), ("a4", "tiny")]
        graphs = (dict(engine.runtime.manifest.pieces), sorted((artifact / "graphs").iterdir()))
        a8 = {"lora_name": "a8", "lora_path": str(adapters["a8"])}
        assert admin("load_lora_adapter", a8, "wrong") == 401
        start = time.monotonic()
        assert admin("load_lora_adapter", a8) == 200
        assert time.monotonic() - start < 1.0
        assert admin("load_lora_adapter", {"lora_name": "b4", "lora_path": str(adapters["b4"])}) == 200
        assert (dict(engine.runtime.manifest.pieces), sorted((artifact / "graphs").iterdir())) == graphs
        pairs = [("tiny", [5, 6, 7]), ("a2", [8, 1, 2, 3]), ("a4", [9, 9, 4]), ("a8", [1, 7, 7, 2, 5])]
        got = asyncio.run(complete(pairs))
        got += asyncio.run(complete([("b4", [2, 4, 6, 8])]))  # four adapters, three slots: a swap
        pairs.append(("b4", [2, 4, 6, 8]))
        refs = [reference(model_dir, adapters.get(m), p) for m, p in pairs]
        want, logits = zip(*refs, strict=True)
        assert_follows(want, logits, ATOL, got)

        with urllib.request.urlopen(urllib.request.Request(f"{base}/metrics"), timeout=60) as response:
            text = response.read().decode()
        assert 'nb:lora_requests_total{lora_name="a8",model_name="tiny"} 1.0' in text
        assert re.search(r'nb:lora_slot_swaps_total\{model_name="tiny"\} [1-9]', text), text

        with pytest.raises(openai.NotFoundError, match="unknown|does not exist"):
            client.completions.create(model="nope", prompt=[1, 2], max_tokens=1)
        too_big = save_adapter(model_dir, artifact.parent / "r16", 16, ["q_proj"], 9)
        assert admin("load_lora_adapter", {"lora_name": "big", "lora_path": str(too_big)}) == 400
        assert admin("load_lora_adapter", {"lora_name": "none", "lora_path": "/nowhere"}) == 400
        assert admin("unload_lora_adapter", {"lora_name": "nope"}) == 404
        assert admin("unload_lora_adapter", {"lora_name": "a2"}) == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="a2", prompt=[1, 2], max_tokens=1)
    finally:
        server.should_exit = True
        thread.join(60)


def test_unloading_an_adapter_keeps_its_slot_until_its_requests_end(lora_setup):
    """Three slots held by running requests; the first's adapter is unloaded and a fourth loaded:
    its request waits for a slot rather than take the one the unloaded adapter's request still runs
    on, and every request equals its reference."""
    artifact, model_dir, adapters = lora_setup
    engine = poisoned_engine(artifact, {n: adapters[n] for n in ("a2", "a4", "a8")})
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    pairs = [("a2", [4, 8, 15]), ("a4", [16, 23, 42]), ("a8", [7, 1, 3, 9])]
    ids = [engine.add_request(p, params, lo) for lo, p in pairs]
    engine.step()
    engine.adapters.remove("a2")
    engine.adapters.add("b4", adapters["b4"])
    pairs.append(("b4", [5, 5, 2, 1]))
    ids.append(engine.add_request(pairs[-1][1], params, "b4"))
    engine.step()
    assert engine.num_waiting == 1  # every slot is held
    done = {}
    while engine.has_unfinished:
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    refs = [reference(model_dir, adapters[lo], p) for lo, p in pairs]
    want, logits = zip(*refs, strict=True)
    assert_follows(want, logits, ATOL, [done[i] for i in ids])


@pytest.mark.slow
def test_nb_serve_lora_modules_serve_each_adapter_by_name(lora_setup):
    """``nb serve --lora-modules NAME=PATH`` as a user starts it: the adapter is listed and serves
    transformers + peft's ids; a bad module is one line, exit 2, before anything listens."""
    import subprocess
    import sys

    import openai

    artifact, model_dir, adapters = lora_setup
    cmd = [sys.executable, "-m", "neuron_buckets.cli", "serve", str(artifact), "--port", "0",
           "--served-model-name", "tiny", "--lora-modules", f"a4={adapters['a4']}"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        m, _ = wait_for_line(proc, r"serving 'tiny' at (http://127\.0\.0\.1:\d+)")
        client = openai.OpenAI(base_url=f"{m.group(1)}/v1", api_key="unused", max_retries=0)
        assert [(c.id, c.parent) for c in client.models.list()] == [("tiny", None), ("a4", "tiny")]
        out = client.completions.create(model="a4", prompt=[6, 2, 8], max_tokens=MAX_NEW, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        want, logits = reference(model_dir, adapters["a4"], [6, 2, 8])
        assert_follows([want], [logits], ATOL, [out.choices[0].token_ids])
    finally:
        proc.terminate()
        proc.wait(60)
    nowhere = f"a4={adapters['a4'].parent / 'nowhere'}"
    bad = subprocess.run([*cmd[:-1], nowhere], capture_output=True, text=True)
    assert bad.returncode == 2 and "has no adapter_config.json" in bad.stderr, bad.stderr

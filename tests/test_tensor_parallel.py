"""Tensor parallelism: the split, the shards, the plans the ranks share, and two ranks generating.

The compiled cases run an artifact at ``tensor_parallel_size = 2`` as two processes: this one as
rank 0 (the engine) and a follower it starts as torch.distributed's rendezvous variables say, each
over a NaN-poisoned cache, against the same grid compiled at TP=1 and against transformers. The
grid is test_architectures.py's: one 80-token packed prefill bucket (a 100-token prompt chunks over
two calls, the other prompts pack beside it), decode rows of 1 + 2 speculative positions, ngram
drafting on, and a second round whose prompts extend the first's (prefix-cache hits).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from filelock import FileLock
from safetensors.torch import save_file

from neuron_buckets import SamplingParams, generate
from neuron_buckets.artifact.manifest import read_manifest
from neuron_buckets.backends import get_backend
from neuron_buckets.compile.build_plan import BuildPlan
from neuron_buckets.config import ConfigError, load_config
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.model.checkpoint import (
    checkpoint_tensors,
    load_model,
    load_weights,
    read_config,
    read_state_dict,
)
from neuron_buckets.model.checkpoint_quantizer import quantize_checkpoint
from neuron_buckets.model.model_config import LlamaConfig
from neuron_buckets.model.quant.quant_scheme import QuantScheme
from neuron_buckets.model.quant.quantized_weight import QuantizedWeight
from neuron_buckets.model.tp.sharding import part_rank, read_shard, shard_tensor
from neuron_buckets.model.tp.tensor_parallel import TensorParallel
from neuron_buckets.model.weights import PROJECTIONS
from neuron_buckets.runtime import rank_group
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.runtime.memory import weights_bytes
from neuron_buckets.runtime.rank_group import RankGroup, RankLost, decode, encode
from tests import test_quantized as quant
from tests.conftest import PEAKED, free_port, save_tiny_model, write_config
from tests.steps_compared import FLOOR, assert_follows
from tests.test_architectures import ARCH_CONFIG, TOLERANCE
from tests.test_architectures import prompts as arch_prompts
from tests.test_engine import greedy
from tests.test_quantized import SCHEMES, dequantized_checkpoint, float_model  # noqa: F401

TP2 = TensorParallel(2)


def tiny(**overrides) -> LlamaConfig:
    base = dict(vocab_size=255, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    return LlamaConfig(**{**base, **overrides})


def test_a_rank_holds_its_heads_and_one_kv_head_replicated_when_fewer_than_ranks():
    config = tiny()
    local = TP2.local(config)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4, 1, 64)
    assert local.vocab_size == 128  # 255 rows over two ranks: the last one padded
    four = TensorParallel(4)
    assert (four.local(config).num_heads, four.local(config).num_kv_heads) == (2, 1)
    # ranks 0 and 1 share KV head 0, ranks 2 and 3 KV head 1: the heads their q heads group with
    assert [part_rank(config, "qkv", 1, r, four) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [part_rank(config, "qkv", 0, r, four) for r in range(4)] == [(r, 4) for r in range(4)]
    w8a8 = QuantScheme("int8", "channel", "int8_token")
    assert TP2.local(tiny(quantization=w8a8)).quantization == w8a8  # every rank computes the scheme
    for bad, problem in ((tiny(num_heads=6, num_kv_heads=3), "num_key_value_heads 3"),
                         (tiny(intermediate_size=129), "intermediate_size 129")):
        with pytest.raises(ValueError, match=problem):
            TP2.local(bad)


def test_a_size_that_does_not_split_the_model_is_one_config_error(tiny_config_file):
    config = load_config(tiny_config_file)
    config = replace(config, parallel=replace(config.parallel, tensor_parallel_size=3))
    model = read_config(config.model.path)
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size: num_attention_heads 4"):
        BuildPlan.make(config, Path("out"), get_backend("eager"), model, None)


@pytest.mark.parametrize("arch", ["llama-bias", "qwen3"])
def test_the_shards_are_the_checkpoint_cut_by_field_and_half_its_bytes(arch, tmp_path):
    """Both ranks' shards put back together are the checkpoint; each holds at most 0.55 of it."""
    model_dir = save_tiny_model(tmp_path / "m", arch)
    config, full = read_config(model_dir), read_state_dict(model_dir)
    (file,) = model_dir.glob("*.safetensors")
    shards = [read_shard(file, config, r, TP2) for r in range(2)]
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        if name.endswith(("norm.weight", "o_proj.bias")):  # replicated (o's bias added after the sum)
            assert all(torch.equal(p, tensor) for p in parts), name
            continue
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0  # input or output features
        whole = torch.cat(parts, dim=dim)
        assert whole.shape[dim] == 2 * parts[0].shape[dim], name
        assert torch.equal(whole.narrow(dim, 0, tensor.shape[dim]), tensor), name  # vocab: padding last
    assert shards[1]["model.layers.0.self_attn.q_proj.weight"].shape[0] == q // 2
    assert shards[1]["model.layers.0.self_attn.k_proj.weight"].shape[0] == kv // 2

    def nbytes(weights) -> int:
        return sum(t.numel() * t.element_size() for t in weights.tensors())

    whole = nbytes(load_weights(config, read_state_dict(model_dir)))
    for rank in range(2):
        mine = nbytes(load_weights(TP2.local(config), read_shard(file, config, rank, TP2)))
        assert mine <= 0.55 * whole


@pytest.mark.parametrize("scheme", ["w8a16-int8-channel", "w8a8-int8-channel", "w8a16-fp8-tensor"])
def test_a_quantized_shard_stands_for_the_dense_shard_of_its_dequantized_weights(scheme, tmp_path):
    """Each rank's quantized projections dequantize to its shard of the dense weights the whole
    ones stand for: the scales were cut with their output channels (q/k/v, gate/up) or kept whole
    (o, down, whose shards hold every output channel), as the artifact stores them."""
    quantized = quantize_checkpoint(save_tiny_model(tmp_path / "m"), tmp_path / "q", SCHEMES[scheme])
    model = load_model(quantized)
    file = tmp_path / "weights.safetensors"
    tensors = checkpoint_tensors(model.config, model.weights)  # what an artifact stores
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file))
    dense = dequantized_checkpoint(quantized, tmp_path / "dense")
    dense_config = read_config(dense)
    for rank in range(2):
        mine = load_weights(TP2.local(model.config), read_shard(file, model.config, rank, TP2))
        dense_shard = read_shard(dense / "model.safetensors", dense_config, rank, TP2)
        want = load_weights(TP2.local(dense_config), dense_shard)
        for got_layer, want_layer in zip(mine.layers, want.layers, strict=True):
            for field in PROJECTIONS:
                weight = getattr(got_layer, field)
                assert isinstance(weight, QuantizedWeight) and weight.scheme == SCHEMES[scheme]
                assert torch.equal(weight.dequantize(torch.float32), getattr(want_layer, field)), field
        if SCHEMES[scheme].weights == "int8":  # held as stored: the per-rank estimate is what a rank holds
            assert sum(t.nbytes for t in mine.tensors()) == weights_bytes(TP2.local(model.config), "float32")
    one = torch.tensor([0.5])  # one scale for the whole tensor (a checkpoint's): every rank's
    for name in ("model.layers.0.self_attn.q_proj.weight_scale", "model.layers.0.mlp.down_proj.weight_scale"):
        assert shard_tensor(model.config, name, one, 1, TP2) is one


def test_one_graph_set_serves_every_rank_as_a_tp1_build_of_one_ranks_shapes(tiny_config_file, tmp_path):
    """The TP=2 plan builds the pieces a TP=1 plan of a checkpoint with one rank's shapes builds, over
    the same cache, one key each whatever the rank: no piece is compiled per rank (the keys differ
    from TP=1's by the degree: the graphs hold collectives)."""
    config = load_config(tiny_config_file)
    model = read_config(config.model.path)
    tp2 = replace(config, parallel=replace(config.parallel, tensor_parallel_size=2))
    backend = get_backend("inductor")
    plans = [BuildPlan.make(tp2, tmp_path, backend, model, None),
             BuildPlan.make(config, tmp_path, backend, TP2.local(model), None)]
    assert [s.name for s in plans[0].shapes] == [s.name for s in plans[1].shapes]
    assert len(set(plans[0].keys.values())) == len(plans[0].keys) == len(plans[1].keys)
    assert plans[0].header.cache == plans[1].header.cache  # one rank's KV heads
    assert plans[0].header.parallel.tensor_parallel_size == 2 != plans[1].header.parallel.tensor_parallel_size


def test_a_plan_reaches_the_other_ranks_as_it_was():
    plan = (Segment(3, [5, 6, 7], 16, [2, 3, 9], 1), Segment(0, torch.tensor([1]), 4, [7], 1),
            Segment(9, [], 0, [], 0))
    got = decode(encode(plan))
    assert [(s.request_id, list(map(int, s.token_ids)), s.context_len, list(s.block_ids), s.num_samples)
            for s in got] == [(3, [5, 6, 7], 16, [2, 3, 9], 1), (0, [1], 4, [7], 1), (9, [], 0, [], 0)]
    assert decode(encode(())) == ()


def test_abandoning_the_group_ends_and_reaps_the_ranks_it_spawned():
    """A spawned rank that sits in a collective is killed and waited for: none is left a zombie.
    The group drops its store, and leaving it again (rank 0's exit hook, a second ``close``) does
    nothing: the process group current by then is a later group's, not this one's to destroy."""
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    group = RankGroup(0, 3, dist.HashStore(), sleepers)
    group.abandon()
    assert [w.returncode for w in sleepers] == [-signal.SIGKILL] * 2
    assert group.store is None
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        group.close()
        group.abandon()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
    with pytest.raises(RankLost, match="left the group of 3 ranks"):
        group.send(())


def test_a_join_that_fails_reaps_the_ranks_it_spawned(tmp_path: Path):
    """Rank 0 spawns a follower that cannot open the artifact (there is none): the join fails in
    one line as soon as the follower exits, which is reaped, and no process group is left."""
    before = children()
    with pytest.raises(RankLost, match="a rank exited before the ranks could start"):
        RankGroup.join(tmp_path / "missing", 2)
    assert children() == before and not dist.is_initialized()


def children() -> set[int]:
    """This process's child processes, zombies (exited, not reaped) included."""
    tasks = Path(f"/proc/{os.getpid()}/task").glob("*")
    return {int(c) for t in tasks for c in (t / "children").read_text().split()}


# Compiled: both architectures the split treats differently (Qwen3's q/k norms and head_dim), each in
# float32 and bfloat16.
CASES = [("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16"), ("qwen3", "bfloat16")]
MAX_NEW = 10
SPEC = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2, auto_off=False)
FOLLOWER = (
    "import sys; from neuron_buckets import BucketRuntime\n"
    "runtime = BucketRuntime.open(sys.argv[1])\n"
    "runtime.k_cache.fill_(float('nan')); runtime.v_cache.fill_(float('nan'))\n"
    "runtime.follow()\n"
)


@dataclass
class Compiled:
    arch: str
    dtype: str
    directories: dict[int, Path]  # tensor_parallel_size -> artifact
    hf: torch.nn.Module


def case(c: tuple[str, str]) -> pytest.param:
    """A compiled case, in its xdist group (the group shares its compiled artifacts)."""
    name = "-".join(c)
    return pytest.param(c, id=name, marks=[pytest.mark.slow, pytest.mark.xdist_group(f"tp-{name}")])


@pytest.fixture(scope="module", params=[case(c) for c in CASES])
def compiled(request, tmp_path_factory: pytest.TempPathFactory, graph_cache_dir: Path) -> Compiled:
    import transformers

    from neuron_buckets.compile.compiler import Compiler

    arch, dtype = request.param
    root = tmp_path_factory.mktemp(f"tp-{arch}-{dtype}")
    peaked = PEAKED if dtype != "float32" else {}  # bfloat16 decides few steps of a random model
    model_dir = save_tiny_model(root / "model", arch, dtype=getattr(torch, dtype), **peaked)
    text = ARCH_CONFIG.replace("DTYPE", dtype).replace("fresh_layers = true", "fresh_layers = false")
    directories = {}
    for size in (1, 2):
        parallel = f"\n[parallel]\ntensor_parallel_size = {size}\n"
        config = load_config(write_config(root, model_dir, text + parallel))
        graph_cache_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(str(graph_cache_dir) + ".lock"):
            report = Compiler(config, root / f"tp{size}", graph_cache_dir).run(jobs=2)
        assert not report.failed, [o.error for o in report.failed]
        directories[size] = root / f"tp{size}"
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None
    return Compiled(arch, dtype, directories, hf)


@contextlib.contextmanager
def two_ranks(directory: Path, follower_script: str = FOLLOWER) -> Iterator[BucketRuntime]:
    """Rank 0 here and rank 1 in a process of its own, joined by the rendezvous variables (as on two
    machines), both caches NaN everywhere. However the body ends, this process leaves the group, so
    a failure here does not fail the next test that joins one."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    follower = subprocess.Popen([sys.executable, "-c", follower_script, str(directory)],
                                env={**os.environ, **env, "RANK": "1"})
    saved = {k: os.environ.get(k) for k in [*env, "RANK"]}
    os.environ.update({**env, "RANK": "0"})
    try:
        runtime = BucketRuntime.open(directory)
        runtime.k_cache.fill_(float("nan"))
        runtime.v_cache.fill_(float("nan"))
        yield runtime
        runtime.close()
        assert follower.wait(30) == 0
    finally:
        follower.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def prompts() -> list[list[int]]:
    """A 100-token prompt (two chunks), a repeating one (ngram drafts that get accepted), and one
    more to pack beside them."""
    gen = torch.Generator().manual_seed(5)
    short, other, long = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 33, 100))
    return [long, short * 3, other]


def rounds(runtime: BucketRuntime) -> tuple[list[list[int]], int]:
    """Greedy tokens of two rounds with drafting (the second's prompts extend the first's: prefix
    hits), and the prompt tokens the second round's prefill computed."""
    engine = LLMEngine(runtime, speculative=SPEC)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    first = prompts()
    out = [o.token_ids for o in generate(engine, first, params)]
    before = runtime.stats["prefill_s80"].real_tokens
    out += [o.token_ids for o in generate(engine, [p + [7, 8] for p in first], params)]
    assert engine.spec_stats.num_accepted_tokens > 0
    return out, runtime.stats["prefill_s80"].real_tokens - before


def hf_tokens(compiled: Compiled, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = compiled.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=MAX_NEW, pad_token_id=0, return_dict_in_generate=True,
                                   output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def test_two_ranks_generate_what_one_rank_and_transformers_do(compiled: Compiled):
    """Packed prefill of several segments, a chunked prompt, mixed steps, speculative rows and
    prefix hits: TP=2's greedy tokens of both rounds are TP=1's and transformers' up to the first
    near-tie (its top two logits within twice the dtype's tolerance), which float32 never meets
    here; bfloat16 (a peaked model) decides at least 90% of the steps."""
    manifests = [read_manifest(compiled.directories[n]) for n in (1, 2)]
    names = [sorted(p.name for p in m.pieces.values()) for m in manifests]
    assert names[0] == names[1]  # the same graphs, once for both ranks
    one = BucketRuntime.open(compiled.directories[1])
    one.k_cache.fill_(float("nan"))
    one.v_cache.fill_(float("nan"))
    want, want_computed = rounds(one)
    with two_ranks(compiled.directories[2]) as runtime:
        got, computed = rounds(runtime)
    assert computed == want_computed < sum(len(p) + 2 for p in prompts())  # prefix hits
    hf, logits = zip(*(hf_tokens(compiled, p) for p in [*prompts(), *(p + [7, 8] for p in prompts())]),
                     strict=True)
    atols = [TOLERANCE[compiled.dtype] * float(x.abs().max()) for x in logits]
    assert_follows(hf, logits, atols, got, want, floor=1.0 if compiled.dtype == "float32" else FLOOR)
    if compiled.dtype == "float32":
        assert got == want


# One case is enough for how the ranks start and fail: the compiled fixture's first.
FIRST = case(CASES[0])
# A follower that loads its shard late, as one started later or starved on a busy machine does.
LATE_FOLLOWER = (
    "import time; from neuron_buckets import BucketRuntime\n"
    "load = BucketRuntime._load_weights\n"
    "BucketRuntime._load_weights = lambda self, rank: (time.sleep(LATE), load(self, rank))[1]\n"
)


@pytest.mark.parametrize("compiled", [FIRST], indirect=True)
def test_a_rank_that_loads_late_holds_back_the_first_step_not_past_its_timeout(
    compiled: Compiled, monkeypatch: pytest.MonkeyPatch
):
    """The ranks meet once all have loaded: the first step's collectives never wait for a rank
    still loading. Here a collective may wait 4 s, and rank 1 loads 10 s after rank 0."""
    monkeypatch.setattr(rank_group, "TIMEOUT", timedelta(seconds=4))  # rank 0's; the follower's stays 60 s
    late = LATE_FOLLOWER.replace("LATE", "10") + FOLLOWER
    with two_ranks(compiled.directories[2], late) as runtime:
        got = greedy(runtime, prompts(), MAX_NEW)
    one = BucketRuntime.open(compiled.directories[1])
    assert got == greedy(one, prompts(), MAX_NEW)


# How long a step's collective waits for a hung rank in the test below: long enough for a loaded
# machine's steps, far below the default (rank_group.TIMEOUT).
HUNG_AFTER = 8


@pytest.mark.parametrize("compiled", [FIRST], indirect=True)
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_rank_fails_the_next_step_and_the_same_process_serves_again(
    compiled: Compiled, how: str, monkeypatch: pytest.MonkeyPatch
):
    """Rank 0 spawns rank 1 (one machine) and loses it between steps: killed (its sockets close, so
    the next step fails at once) or hung (stopped: the next step's collective gives up after the
    ranks' timeout, ``NB_RANK_TIMEOUT_S``). Either way the step raises ``RankLost``, rank 0 leaves
    the group (the follower killed and reaped, the process group destroyed), and the same process
    opens the artifact again, as the next test of a pytest worker does, and generates what it did
    before."""
    monkeypatch.setenv(rank_group.TIMEOUT_ENV, str(HUNG_AFTER))  # the follower inherits it
    # closing: however the test ends, no group is left for the next test (a no-op once left)
    with contextlib.closing(BucketRuntime.open(compiled.directories[2])) as runtime:
        want = greedy(runtime, prompts(), MAX_NEW)
        [worker] = runtime.ranks.workers
        os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RankLost, match="a step failed across the 2 ranks") as lost:
            greedy(runtime, prompts(), MAX_NEW)
        waited = time.monotonic() - started
    assert worker.returncode == -signal.SIGKILL  # reaped: a hung rank is killed too
    assert not dist.is_initialized() and runtime.ranks.store is None
    timed_out = "timed out" in str(lost.value).lower()
    assert timed_out == (how == "hung"), lost.value
    if how == "hung":  # the configured timeout, not the default
        assert HUNG_AFTER <= waited < rank_group.TIMEOUT.total_seconds()
    with contextlib.closing(BucketRuntime.open(compiled.directories[2])) as again:
        got = greedy(again, prompts(), MAX_NEW)
    assert not dist.is_initialized()
    assert got == want and sum(map(len, got)) == MAX_NEW * len(prompts()) >= 30


def test_a_rank_timeout_that_is_not_a_positive_number_is_refused_in_one_line(monkeypatch):
    for bad in ("soon", "0", "-5", "nan", "inf"):
        monkeypatch.setenv(rank_group.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"NB_RANK_TIMEOUT_S is '{bad}'"):
            rank_group.timeout()
    monkeypatch.setenv(rank_group.TIMEOUT_ENV, "2.5")
    assert rank_group.timeout() == timedelta(seconds=2.5)
    monkeypatch.delenv(rank_group.TIMEOUT_ENV)
    assert rank_group.timeout() == rank_group.TIMEOUT == timedelta(seconds=60)


# Quantized: int8 weights, float8 weights (one scale for each whole tensor) and W8A8, each the
# quantized tests' (peaked) checkpoint and grid, so TP=1's graphs are theirs. W8A8 quantizes o's and
# down's input per token over each rank's features (as vLLM), which rounds otherwise than one rank:
# on a random model that moves the logits by some 6% of the largest, hence its tolerance.
QUANTIZED = ["w8a16-int8-channel", "w8a16-fp8-tensor", "w8a8-int8-channel"]
TP_TOLERANCE = {"w8a8-int8-channel": 0.1}  # of the largest |logit|; the others: quant.TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"quant-{n}"))
                                  for n in QUANTIZED])
def test_two_ranks_of_a_quantized_checkpoint_generate_what_one_rank_does(
    name: str, float_model: Path, tmp_path: Path, graph_cache_dir: Path  # noqa: F811
):
    """Each rank's share of the quantized projections through the schemes' kernels: TP=2's greedy
    tokens over NaN-poisoned caches are TP=1's up to the first near-tie of TP=1's logits (at least
    90% of the steps), and its logits along TP=1's path lie within the tolerance."""
    checkpoint = quantize_checkpoint(float_model, tmp_path / "q", SCHEMES[name])
    one, two = (quant.compile_artifact(checkpoint, tmp_path / f"tp{n}", "inductor", graph_cache_dir, n)
                for n in (1, 2))
    batch = arch_prompts(quant.PROMPT_LENS, seed=1)
    want = greedy(quant.poisoned(one), batch, quant.MAX_NEW)
    logits = quant.along(quant.poisoned(one), batch, want)
    with two_ranks(two) as runtime:
        got = greedy(runtime, batch, quant.MAX_NEW)
        ours = quant.along(runtime, batch, want)
    atol = TP_TOLERANCE.get(name, quant.TOLERANCE) * float(logits.abs().max())
    assert_follows(want, logits, atol, got, along=ours)

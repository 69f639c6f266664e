"""End to end: a transformers Llama, compiled to bucket graphs, generates what transformers does.

The session artifact has prefill buckets of 16 and 32 tokens (each packing up to 2 requests) and
decode batches of 1 and 2, so prompts of 5, 8, 45 and 11 tokens mix the prefill buckets (5 + 8
packed in 16 tokens), the 45-token one is prefilled in two chunks (32, then 13 packed with the
11-token prompt), and four running requests split every decode step over two graph calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.llm_engine import LLMEngine, generate
from neuron_buckets.engine.request_check import RequestError
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from tests.conftest import write_config
from tests.steps_compared import assert_same_tokens
from tests.test_traces import CONV

PROMPT_LENS = (5, 8, 45, 11)
MAX_NEW = 10


def make_prompts(lens: tuple[int, ...], vocab: int = 256, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def greedy(
    runtime: BucketRuntime, prompts: list[list[int]], max_new: int | list[int], pool: BlockPool | None = None
) -> list[list[int]]:
    """The engine's greedy tokens, every request running to its length as transformers' does here."""
    news = [max_new] * len(prompts) if isinstance(max_new, int) else max_new
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in news]
    return [o.token_ids for o in generate(LLMEngine(runtime, pool=pool), prompts, params)]


@pytest.fixture(scope="module")
def hf_greedy(hf_model_dir: Path):
    """transformers' own greedy ``generate``, one prompt at a time: the oracle."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(hf_model_dir).eval()
    model.generation_config.eos_token_id = None  # the engine has no stop token: compare full lengths

    def run(prompts: list[list[int]], max_new: int) -> list[list[int]]:
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new,
                    pad_token_id=0,
                )
            outs.append(out[0, len(p) :].tolist())
        return outs

    return run


@pytest.mark.slow
def test_compiled_buckets_generate_exactly_what_transformers_does(compiled_dir, hf_greedy):
    runtime = BucketRuntime.open(compiled_dir)
    prompts = make_prompts(PROMPT_LENS)
    pool = BlockPool(runtime.num_blocks, runtime.block_size)

    got = greedy(runtime, prompts, MAX_NEW, pool=pool)

    assert_same_tokens(got, hf_greedy(prompts, MAX_NEW), total=len(prompts) * MAX_NEW)
    assert pool.num_free == runtime.num_blocks - 1  # every block back, the null block never lent
    used = {label: s.calls for label, s in runtime.stats.items() if s.calls}
    # step 1 packs 5 + 8 in prefill 16; step 2 prefills 32 of the 45; step 3 packs its last 13 with
    # the 11-token prompt in prefill 32; every decode step of four rows is split 2 + 2
    assert used == {"prefill_s16": 1, "prefill_s32": 2, "decode_b2_c128": 2 * (MAX_NEW - 1)}
    s16, s32 = runtime.stats["prefill_s16"], runtime.stats["prefill_s32"]
    assert (s16.real_tokens, s16.padded_tokens) == (5 + 8, 16)
    assert (s32.real_tokens, s32.padded_tokens) == (32 + 13 + 11, 64)


@pytest.mark.slow
def test_a_small_pool_makes_requests_wait_without_changing_tokens(compiled_dir, hf_greedy):
    runtime = BucketRuntime.open(compiled_dir)
    prompts = make_prompts(PROMPT_LENS)
    # 8 usable blocks of 8 tokens: the 45-token prompt needs 7 blocks, so it runs nearly alone
    pool = BlockPool(9, runtime.block_size)

    got = greedy(runtime, prompts, MAX_NEW, pool=pool)

    assert_same_tokens(got, hf_greedy(prompts, MAX_NEW), total=len(prompts) * MAX_NEW)
    assert pool.num_free == 8
    # waiting requests were admitted one prefill step at a time, not all at once
    assert sum(s.calls for label, s in runtime.stats.items() if label.startswith("prefill")) >= 4
    assert runtime.stats["decode_b1_c128"].calls > 0  # the 45-token prompt decoded alone


@pytest.mark.slow
def test_one_max_new_tokens_per_prompt(compiled_dir, hf_greedy):
    """Requests that finish early give their blocks back while the others run on unchanged."""
    runtime = BucketRuntime.open(compiled_dir)
    prompts = make_prompts(PROMPT_LENS, seed=2)
    news = [3, 12, 1, 7]
    pool = BlockPool(runtime.num_blocks, runtime.block_size)

    got = greedy(runtime, prompts, news, pool=pool)

    assert [len(g) for g in got] == news
    want = [hf_greedy([p], n)[0] for p, n in zip(prompts, news, strict=True)]
    assert_same_tokens(got, want, total=sum(news))
    assert pool.num_free == runtime.num_blocks - 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompts", "max_new", "message"),
    [
        ([[1] * 120], 9, r"prompt 0: 120 prompt tokens \+ max_tokens 9 = 129 exceeds max_model_len 128"),
        ([[1, 2], []], 4, "prompt 1 is empty"),
        ([[1, 256, 3]], 4, r"prompt 0 has token ids \[256\] outside the vocabulary \[0, 256\)"),
        ([[1.7, 2]], 4, r"prompt 0 token ids must be integers, got \[1.7\]"),  # not truncated
    ],
)
def test_impossible_requests_fail_before_anything_runs(compiled_dir, prompts, max_new, message):
    runtime = BucketRuntime.open(compiled_dir)
    with pytest.raises(RequestError, match=message):
        generate(runtime, prompts, SamplingParams(max_tokens=max_new))
    assert runtime.loaded == [] and not any(s.calls for s in runtime.stats.values())


@pytest.mark.slow
def test_a_request_larger_than_the_pool_fails_before_anything_runs(compiled_dir):
    runtime = BucketRuntime.open(compiled_dir)
    pool = BlockPool(4, runtime.block_size)  # 3 usable blocks = 24 tokens
    with pytest.raises(RequestError, match="prompt 1 needs 4 blocks of 8 tokens, the pool has 3"):
        greedy(runtime, [[1] * 10, [2] * 25], 8, pool=pool)  # its output could preempt; its prompt never fits
    assert runtime.loaded == [] and pool.num_free == 3


EAGER_SPECULATIVE = """
[model]
path = "{model}"

[cache]
block_size = 8
num_blocks = 32
max_model_len = 96

[buckets]
max_num_seqs = 2
max_num_batched_tokens = 32
num_seqs_buckets = [2]
num_batched_tokens_buckets = [32]
speculation_length = 2

[compile]
backend = "eager"
jobs = 1
"""


def test_eager_backend_with_speculative_decode_rows_generates_the_same_tokens(
    hf_model_dir, hf_greedy, tmp_path
):
    """Decode graphs of 3 positions per row: one real token each, the other two padded."""
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    config = load_config(write_config(tmp_path, hf_model_dir, EAGER_SPECULATIVE))
    out = tmp_path / "artifact"
    assert not Compiler(config, out, tmp_path / "cache").run(jobs=1).failed
    runtime = BucketRuntime.open(out)
    assert runtime.buckets.decode_seq == 3
    prompts = make_prompts((7, 40, 3))

    assert_same_tokens(greedy(runtime, prompts, 6), hf_greedy(prompts, 6), total=3 * 6)
    assert [b.name for b in runtime.buckets.decode] == ["decode_b2_s3_c96"]
    decode = runtime.stats["decode_b2_s3_c96"]
    assert decode.padded_tokens >= 3 * decode.real_tokens  # at least two of every three positions are pads


def test_decode_context_buckets_serve_short_contexts_with_short_graphs(hf_model_dir, hf_greedy, tmp_path):
    """With decode ctx buckets [32, 128], a row runs the c32 graph until its context outgrows it."""
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config
    from tests.conftest import TINY_CONFIG

    text = TINY_CONFIG.replace('backend = "inductor"', 'backend = "eager"').replace(
        "num_seqs_buckets = [1, 2]", "num_seqs_buckets = [1, 2]\ndecode_context_length_buckets = [32, 128]"
    )
    config = load_config(write_config(tmp_path, hf_model_dir, text))
    out = tmp_path / "artifact"
    assert not Compiler(config, out, tmp_path / "cache").run(jobs=1).failed
    runtime = BucketRuntime.open(out)
    prompts = make_prompts((20,))  # contexts 20..35 over 16 new tokens: crosses 32

    assert_same_tokens(greedy(runtime, prompts, 16), hf_greedy(prompts, 16), total=16)
    short, long = runtime.stats["decode_b1_c32"], runtime.stats["decode_b1_c128"]
    assert (short.calls, long.calls) == (12, 3)  # decode context 21..32 in c32, then 33..35


def test_runtime_counters_equal_what_nb_inspect_predicts(compiled_dir, tiny_config_file, tmp_path):
    """200 requests of a shared trace, clipped to the tiny model's 128 positions: the runtime's
    per-bucket calls, real and padded tokens equal nb inspect's packed replay of the same file."""
    from typer.testing import CliRunner

    from neuron_buckets.cli import app
    from neuron_buckets.traffic.runtime_replay import fit_requests
    from neuron_buckets.traffic.traces import load_trace

    full = load_trace(CONV)
    prompts, outputs = fit_requests(full.prompt_lens, full.output_lens, 128, 200)
    outputs = [min(o, 12) for o in outputs]  # decode steps are what cost test time
    trace = tmp_path / "sample.csv"
    rows = "".join(f"{i},{p},{o}\n" for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)))
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    result = CliRunner().invoke(app, ["inspect", "--trace", str(trace), str(tiny_config_file), "--json"])
    assert result.exit_code == 0, result.output
    predicted = {b.pop("bucket"): b for b in json.loads(result.stdout)["packed"]["per_bucket"]}

    runtime = BucketRuntime.open(compiled_dir)
    gen = torch.Generator().manual_seed(0)
    greedy(runtime, [torch.randint(0, 256, (n,), generator=gen).tolist() for n in prompts], outputs)
    measured = {name: s.to_json() for name, s in runtime.stats.items() if s.calls}
    assert measured == predicted
    assert any(s["real_tokens"] > s["calls"] * 8 for name, s in measured.items() if "prefill" in name)

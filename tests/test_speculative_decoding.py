"""Speculative decoding end to end: n-gram drafts verified in decode rows of 1 + 3 tokens.

One eager artifact with ``speculation_length = 3`` and blocks of 8, so drafts cross block
boundaries often. Greedy tokens with speculation must equal those without (and transformers'),
with drafts actually accepted; rejected drafts must leave nothing that a later step reads.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.core.step_plan import StepPlan
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.llm_engine import LLMEngine, generate
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.runtime.step_check import StepLimits
from tests.conftest import error_line, first_new, write_config
from tests.steps_compared import assert_same_tokens
from tests.test_engine import EAGER_SPECULATIVE, make_prompts
from tests.test_engine import hf_greedy as hf_greedy  # the transformers oracle fixture

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
# Text that repeats (prompt lookup's home ground), a random prompt, and one long enough to be
# prefilled in two chunks beside the others' decode rows.
PROMPTS = [[5, 6, 7, 8, 9] * 4, make_prompts((9,))[0], [3, 1, 4, 1, 5, 9, 2, 6] * 5]


@pytest.fixture(scope="module")
def runtime(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> BucketRuntime:
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    tmp = tmp_path_factory.mktemp("speculative")
    text = EAGER_SPECULATIVE.replace("speculation_length = 2", "speculation_length = 3").replace(
        "max_num_seqs = 2", "max_num_seqs = 4"  # four rows: a chunk beside drafted rows
    ).replace("num_seqs_buckets = [2]", "num_seqs_buckets = [2, 4]")
    config = load_config(write_config(tmp, hf_model_dir, text))
    assert not Compiler(config, tmp / "artifact", tmp / "cache").run(jobs=1).failed
    runtime = BucketRuntime.open(tmp / "artifact")
    assert runtime.buckets.decode_seq == 4
    return runtime


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    return generate(engine, prompts, params)


def greedy_params(*max_tokens: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True, **kw) for n in max_tokens]


def recording(engine: LLMEngine) -> list[StepPlan]:
    """The plans ``engine`` runs from now on."""
    plans: list[StepPlan] = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]  # type: ignore[method-assign]
    return plans


def test_greedy_tokens_are_identical_with_speculation_and_drafts_are_accepted(runtime, hf_greedy):
    params = greedy_params(40, 40, 40)
    plain = run(LLMEngine(runtime), PROMPTS, params)
    engine = LLMEngine(runtime, speculative=SPEC)
    plans = recording(engine)
    spec = run(engine, PROMPTS, params)
    got = [o.token_ids for o in spec]
    assert_same_tokens(got, [o.token_ids for o in plain], hf_greedy(PROMPTS, 40), total=3 * 40)
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens <= 3 * stats.num_drafts
    assert 1 < stats.mean_accepted_length <= 4
    rows = [s for plan in plans for s in plan if s.num_samples > 1]
    bs = runtime.block_size
    assert any(s.context_len // bs != (s.end - 1) // bs for s in rows)  # drafts across a block edge
    # packed prefill: the long prompt's second chunk ran in a step beside drafted decode rows
    assert any(any(s.num_samples > 1 for s in p) and any(s.num_samples <= 1 and len(s.token_ids) > 1
               for s in p) for p in plans)
    # every accepted draft is a token that needed no row of its own
    rows_sampled = sum(1 for p in plans for s in p if s.num_samples)
    assert rows_sampled + stats.num_accepted_tokens == 3 * 40


def test_requests_end_mid_draft_exactly_where_they_would_without(runtime):
    """Short max_tokens cap the drafts; a stop token ends a request inside an accepted draft."""
    params = greedy_params(40, 40, 40)
    plain = [o.token_ids for o in run(LLMEngine(runtime), PROMPTS, params)]
    for lengths in ((1, 2, 3), (5, 6, 7)):
        engine = LLMEngine(runtime, speculative=SPEC)
        got = run(engine, PROMPTS, greedy_params(*lengths))
        want = [p[:n] for p, n in zip(plain, lengths, strict=True)]
        assert_same_tokens([o.token_ids for o in got], want, total=sum(lengths))
        assert all(o.finish_reason == "length" for o in got)
    stops = [p[12] for p in plain]  # a token late enough that drafts were accepted before it
    engine = LLMEngine(runtime, speculative=SPEC)
    got = run(engine, PROMPTS, [SamplingParams(max_tokens=40, stop_token_ids=(t,)) for t in stops])
    for o, p, t in zip(got, plain, stops, strict=True):
        assert o.token_ids == p[: p.index(t) + 1] and o.finish_reason == "stop" and o.stop_reason == t
    assert engine.spec_stats.num_accepted_tokens > 0


def test_min_tokens_masks_stops_in_drafted_rows_as_in_plain_ones(runtime):
    """Each request's first new token greedy decoding reaches is its stop id, masked for the first
    ``min_tokens`` tokens at every draft position of a verified row too: the tokens equal those
    without speculation."""
    plain = [o.token_ids for o in run(LLMEngine(runtime), PROMPTS, greedy_params(40, 40, 40))]
    firsts = [first_new(p) for p in plain]
    params = [SamplingParams(max_tokens=40, min_tokens=k + 6, stop_token_ids=(p[k],))
              for p, k in zip(plain, firsts, strict=True)]
    masked = [o.token_ids for o in run(LLMEngine(runtime), PROMPTS, params)]
    engine = LLMEngine(runtime, speculative=SPEC)
    assert [o.token_ids for o in run(engine, PROMPTS, params)] == masked
    assert engine.spec_stats.num_accepted_tokens > 0
    for tokens, p, k in zip(masked, plain, firsts, strict=True):
        assert tokens[:k] == p[:k] and p[k] not in tokens[: k + 6]  # the same until the masked id
        assert len(tokens) == 40 or (len(tokens) > k + 6 and tokens[-1] == p[k])


def test_a_request_filling_max_model_len_drafts_no_further(runtime):
    """Prompt plus max_tokens equal to max_model_len: drafts stop at the last position the request
    may write, so no row reaches past the artifact's largest context."""
    prompt = ([5, 6, 7, 8, 9] * 20)[: runtime.max_model_len - 12]
    params = greedy_params(12)
    plain = run(LLMEngine(runtime), [prompt], params)[0]
    engine = LLMEngine(runtime, speculative=SPEC)
    plans = recording(engine)
    assert_same_tokens([run(engine, [prompt], params)[0].token_ids], [plain.token_ids], total=12)
    assert max(s.end for p in plans for s in p) == runtime.max_model_len - 1
    assert engine.spec_stats.num_drafts > 0


def test_rejected_drafts_leave_nothing_behind_and_a_poisoned_cache_changes_nothing(runtime):
    """Everything at or past each request's ``cached`` (rejected drafts' K/V included) is set to
    NaN after every step, and the whole cache before the first: any read of a slot the engine does
    not count as valid would turn the logits to NaN and change the tokens."""
    params = greedy_params(30, 30, 30)
    plain = [o.token_ids for o in run(LLMEngine(runtime), PROMPTS, params)]
    runtime.k_cache.fill_(float("nan"))
    runtime.v_cache.fill_(float("nan"))
    engine = LLMEngine(runtime, speculative=SPEC)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    final, bs, poisoned = {}, runtime.block_size, 0
    while len(final) < len(ids):
        final.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        for req in engine.scheduler.running:
            slots = torch.arange(engine.kv_cache.num_cached(req), len(engine.kv_cache.blocks(req)) * bs)
            blocks = torch.tensor(engine.kv_cache.blocks(req))[slots // bs]
            for cache in (runtime.k_cache, runtime.v_cache):
                cache[:, blocks, slots % bs] = float("nan")
            poisoned += len(slots)
    assert_same_tokens([final[i] for i in ids], plain, total=3 * 30)
    assert poisoned and engine.spec_stats.num_draft_tokens > engine.spec_stats.num_accepted_tokens > 0


def test_sampled_requests_speculate_and_a_request_may_opt_out(runtime):
    engine = LLMEngine(runtime, speculative=SPEC)
    sampled = SamplingParams(max_tokens=30, temperature=0.7, seed=3, ignore_eos=True)
    out = run(engine, PROMPTS[:1], [sampled])[0]
    assert len(out.token_ids) == 30 and all(0 <= t < runtime.limits.vocab_size for t in out.token_ids)
    assert engine.spec_stats.num_drafts > 0
    always = replace(SPEC, auto_off=False)  # which steps draft, and so the random stream, is fixed
    once, again = (run(LLMEngine(runtime, speculative=always), PROMPTS[:1], [sampled])[0] for _ in "ab")
    assert once.token_ids == again.token_ids  # a seed still decides the tokens
    off = greedy_params(20, 20, 20, speculative=False)
    penalised = [SamplingParams(max_tokens=20, repetition_penalty=1.3, ignore_eos=True)] * 3
    plain = run(LLMEngine(runtime), PROMPTS, penalised)
    engine = LLMEngine(runtime, speculative=SPEC)  # the runtime's engine from here on
    got = [o.token_ids for o in run(engine, PROMPTS, penalised)]
    assert_same_tokens(got, [o.token_ids for o in plain], total=3 * 20)
    run(engine, PROMPTS, off)
    assert engine.spec_stats.num_drafts == 0


def test_more_drafts_than_the_artifact_compiled_is_one_line(runtime):
    with pytest.raises(ValueError, match="num_speculative_tokens = 4 exceeds the artifact's "
                       "buckets.speculation_length = 3"):
        LLMEngine(runtime, speculative=SpeculativeConfig(num_speculative_tokens=4))


def test_nb_generate_speculates_with_the_same_tokens_and_prints_acceptance(runtime):
    from typer.testing import CliRunner

    from neuron_buckets.cli import app

    args = ["generate", str(runtime.directory), "--prompt-ids", ",".join(map(str, PROMPTS[0])),
            "--max-new-tokens", "20", "--ignore-eos", "--stats"]  # fmt: skip
    plain, spec = (CliRunner().invoke(app, [*args, *extra]) for extra in ([], ["--speculative-ngram", "3"]))
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert plain.stdout.splitlines()[0] == spec.stdout.splitlines()[0]
    assert "speculation:" not in plain.output
    line = next(line for line in spec.output.splitlines() if line.startswith("speculation:"))
    assert "draft tokens accepted" in line and "mean accepted length" in line
    assert "steps with speculation off" in line
    too_many = CliRunner().invoke(app, [*args, "--speculative-ngram", "4"])
    assert too_many.exit_code == 2
    assert error_line(too_many).startswith("error: speculative.num_speculative_tokens = 4 exceeds")


def test_nb_serve_drafts_as_its_config_file_says_without_flags(runtime, tmp_path, monkeypatch):
    """``[speculative] num_speculative_tokens = 2`` in the file given to ``nb serve --config``: the
    served engine's decode rows carry 2 drafts (3 tokens), none more; a flag overrides the file."""
    from typer.testing import CliRunner

    from neuron_buckets.cli import app
    from neuron_buckets.server import api_server

    config = tmp_path / "serve.toml"
    config.write_text("[speculative]\nnum_speculative_tokens = 2\nauto_off = false\n")
    engines: list[LLMEngine] = []
    served = lambda directory, *args: engines.append(LLMEngine.open(directory, speculative=args[5]))  # noqa: E731
    monkeypatch.setattr(api_server, "run_server", served)
    for extra in ([], ["--speculative-ngram", "1"]):
        result = CliRunner().invoke(app, ["serve", str(runtime.directory), "--config", str(config), *extra])
        assert result.exit_code == 0, result.output
    widths = []
    for engine in engines:
        plans = recording(engine)
        run(engine, [PROMPTS[0]], greedy_params(20))
        widths.append({s.num_samples for plan in plans for s in plan if s.num_samples > 1})
    assert widths == [{3}, {2}]
    assert engines[0].gate is None  # auto_off = false came from the file too


def test_metrics_expose_vllms_spec_decode_counters(runtime):
    from prometheus_client.parser import text_string_to_metric_families

    from neuron_buckets.server.metrics import ServerMetrics

    engine = LLMEngine(runtime, speculative=SPEC)
    run(engine, PROMPTS, greedy_params(20, 20, 20))
    metrics = ServerMetrics("tiny", lambda: engine.stats, spec_stats=lambda: engine.spec_stats)
    text = metrics.exposition().decode()
    samples = {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}
    stats = engine.spec_stats
    expected = {"drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
                "accepted_tokens": stats.num_accepted_tokens}  # fmt: skip
    for name, value in expected.items():
        assert samples[f"vllm:spec_decode_num_{name}_total"] == ({"model_name": "tiny"}, value)
    assert stats.num_accepted_tokens > 0
    assert samples["nb:spec_decode_steps_off_total"] == ({"model_name": "tiny"}, stats.num_steps_off)


class RejectedDrafter:
    """Drafts the target always rejects: one past the token the greedy run produced next."""

    def __init__(self, runs: dict[int, list[int]], vocab: int) -> None:
        self.runs, self.vocab = runs, vocab  # request id -> prompt + greedy tokens

    def draft(self, requests, rooms):
        return [[(self.runs[r.request_id][len(r.token_ids)] + 1) % self.vocab] * k
                for r, k in zip(requests, rooms, strict=True)]  # fmt: skip

    def follow(self, chunks):
        """Prompt lookup's: nothing to keep."""


def test_drafts_that_never_pay_turn_speculation_off_and_it_probes_again(runtime):
    params = greedy_params(40, 40, 40)
    plain = [o.token_ids for o in run(LLMEngine(runtime), PROMPTS, params)]
    engine = LLMEngine(runtime, speculative=replace(SPEC, auto_off_window=4, auto_off_probe_interval=6))
    runs = {i: p + t for i, (p, t) in enumerate(zip(PROMPTS, plain, strict=True))}
    engine.gate.drafter = RejectedDrafter(runs, runtime.limits.vocab_size)
    plans = recording(engine)
    assert_same_tokens([o.token_ids for o in run(engine, PROMPTS, params)], plain, total=3 * 40)
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == 0
    def has_room(s) -> bool:  # a decode row that may draft: two or more tokens still to come
        generated = s.context_len + 1 - len(PROMPTS[s.request_id])
        return generated >= 1 and generated < params[s.request_id].max_tokens - 1

    drafted = [any(s.num_samples > 1 for s in p) for p in plans if any(map(has_room, p))]
    assert drafted[:14] == [True] * 4 + [False] * 6 + [True] * 4  # a window, off, a probe's window
    assert stats.num_steps_off == drafted.count(False) >= 12


class MarkovRuntime:
    """A runtime double whose logits at a position depend only on that position's token, so the
    exact distribution of every generated token is known: ``e_last @ P^t`` for the t-th."""

    block_size, num_blocks, max_model_len = 4, 8192, 64
    owner: object | None = None  # the engine over it

    def __init__(self, probs: torch.Tensor, k: int) -> None:
        self.log_p = probs.log()
        self.manifest = SimpleNamespace(text=None)
        # no token buckets: its steps are filled to the budget, never cut at a bucket
        self.buckets = SimpleNamespace(token_budget=512, max_rows=64, decode_seq=1 + k, prefill=(),
                                       mix_decode=True)
        self.limits = StepLimits(self.block_size, self.num_blocks, self.max_model_len, len(probs))

    def claim(self, owner: object) -> None:
        self.owner = owner

    def check_generates(self) -> None:
        """It has a head: it generates."""

    def run_plan(self, plan: StepPlan) -> torch.Tensor:
        last = [t for s in plan for t in list(s.token_ids)[len(s.token_ids) - s.num_samples :]]
        return self.log_p[torch.tensor(last, dtype=torch.int64)]


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of ``counts`` to ``probs`` (as tests/test_sampler.py)."""
    expected = probs.double() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    dof = torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_tokens_with_drafts_follow_the_targets_distribution(k):
    """2000 seeded requests of 4 tokens over a Markov chain that mostly cycles 0 -> 1 -> 2 -> 0,
    so prompt lookup drafts the cycle and the target accepts part of it: each generated token's
    marginal, and the joint of the 2nd and 3rd, fit the chain's exact distribution."""
    vocab, new = 5, 4
    logits = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(3), (torch.arange(3) + 1) % 3] += 2.0
    probs = logits.softmax(-1)
    runtime = MarkovRuntime(probs, k)
    pool = BlockPool(runtime.num_blocks, runtime.block_size)  # the double has no manifest to salt
    engine = LLMEngine(runtime, pool=pool, speculative=SpeculativeConfig(num_speculative_tokens=k))
    params = [SamplingParams(max_tokens=new, temperature=1.0, seed=i) for i in range(2000)]
    tokens = torch.tensor([o.token_ids for o in generate(engine, [[0, 1, 2, 0, 1, 2, 0, 1]] * 2000, params)])
    marginal = torch.eye(vocab)[1]
    for t in range(new):
        marginal = marginal @ probs
        assert p_value(torch.bincount(tokens[:, t], minlength=vocab), marginal) > 0.001, t
    joint = (torch.eye(vocab)[1] @ probs @ probs)[:, None] * probs  # P(2nd = a, 3rd = b)
    pairs = torch.bincount(tokens[:, 1] * vocab + tokens[:, 2], minlength=vocab * vocab)
    assert p_value(pairs, joint.reshape(-1)) > 0.001
    stats = engine.spec_stats
    assert (stats.num_draft_tokens > stats.num_accepted_tokens > 0) == (k > 0)

"""N-gram speculation on the real model, where it should pay: greedy chat replies that summarise
or continue a passage of real text (``bench/bench_quality.py``'s prompts) are the same tokens with
prompt-lookup drafts as without, and the target accepts some of the drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
from filelock import FileLock

from bench.bench_quality import SPEC_NEW, compile_artifact, greedy_alone, spec_prompts
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.engine.llm_engine import LLMEngine
from tests.steps_compared import assert_same_tokens

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real-model")]

K = 3


def test_greedy_text_with_ngram_drafts_is_the_text_without_and_some_drafts_are_accepted(
    real_gguf: Path, graph_cache_dir: Path, tmp_path: Path,
) -> None:
    graph_cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(graph_cache_dir) + ".lock"):
        artifact = compile_artifact(real_gguf, "float32", tmp_path / "art", graph_cache_dir, K)
    prompts = spec_prompts(real_gguf)
    plain = greedy_alone(LLMEngine.open(artifact), prompts, SPEC_NEW)
    engine = LLMEngine.open(artifact, speculative=SpeculativeConfig(num_speculative_tokens=K, auto_off=False))
    drafted = greedy_alone(engine, prompts, SPEC_NEW)
    assert [o.text for o in drafted] == [o.text for o in plain] and all(o.text for o in plain)
    total = sum(len(o.token_ids) for o in plain)
    assert_same_tokens([o.token_ids for o in drafted], [o.token_ids for o in plain], total=total)
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and 0 < stats.acceptance_rate <= 1, stats

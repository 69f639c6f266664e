"""Perplexity of the real model on real text (``bench/bench_quality.py``'s measure, on a short
slice of its text): nb's float32 is transformers' float32 within 1e-4 relative, and nb's bfloat16
and each compressed-tensors scheme of the same model lie within 2% of nb's float32 (FP8 does not:
an expected failure)."""

from __future__ import annotations

from pathlib import Path

import pytest
from filelock import FileLock

from bench.bench_quality import (
    LABELS,
    SCHEMES,
    compile_artifact,
    nb_logprobs,
    perplexity,
    quantized_checkpoint,
    text_windows,
    transformers_logprobs,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real-model")]

TOKENS = 256  # one window: 255 scored tokens, two prefill chunks


@pytest.fixture(scope="module")
def windows(real_gguf: Path) -> list[list[int]]:
    return text_windows(real_gguf, TOKENS)


def nb_perplexity(model: Path, dtype: str, out: Path, cache: Path, windows: list[list[int]]) -> float:
    """nb's perplexity of ``windows`` on ``model`` compiled in ``dtype`` (the graph cache shared)."""
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        artifact = compile_artifact(model, dtype, out, cache)
    scored = nb_logprobs(artifact, windows)
    assert len(scored) == TOKENS - 1
    return perplexity(scored)


@pytest.fixture(scope="module")
def float32(real_gguf: Path, windows, graph_cache_dir: Path, tmp_path_factory) -> float:
    out = tmp_path_factory.mktemp("ppl") / "f32"
    return nb_perplexity(real_gguf, "float32", out, graph_cache_dir, windows)


def test_float32_perplexity_is_transformers_within_1e_4(real_gguf: Path, windows, float32: float) -> None:
    theirs = perplexity(transformers_logprobs(real_gguf, windows))
    assert 1.0 < theirs < 100.0  # real text on a real model, not noise
    assert float32 == pytest.approx(theirs, rel=1e-4)


FP8_OFF = pytest.mark.xfail(reason="data-free FP8 per-channel weights (3 mantissa bits) over this Q4_1 "
                                   "model miss the 2% bound (bench_quality.py's FP8 row)", strict=True)


@pytest.mark.parametrize("name", ["bfloat16", *(pytest.param(LABELS[s.name], marks=FP8_OFF)
                                                if s.weights == "float8_e4m3fn" else LABELS[s.name]
                                                for s in SCHEMES)])
def test_bfloat16_and_each_quantized_scheme_are_within_2_percent_of_float32(
    name: str, real_gguf: Path, windows, float32: float, graph_cache_dir: Path, tmp_path_factory,
) -> None:
    tmp = tmp_path_factory.mktemp("ppl")
    if name == "bfloat16":
        model, dtype = real_gguf, "bfloat16"
    else:
        scheme = next(s for s in SCHEMES if LABELS[s.name] == name)
        models = tmp_path_factory.getbasetemp() / "models"
        model, dtype = quantized_checkpoint(real_gguf, models, scheme), "float32"
    ours = nb_perplexity(model, dtype, tmp / "art", graph_cache_dir, windows)
    assert ours != float32  # it ran another model, not the float32 one again
    assert ours == pytest.approx(float32, rel=0.02)

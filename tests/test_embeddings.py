"""Embedding artifacts: ``model.task = "embed"`` compiles prefill buckets ending in a final-norm
piece, and ``/v1/embeddings`` returns transformers' pooled ``last_hidden_state`` through the
official ``openai`` client, single and batched, last-token and mean pooling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from neuron_buckets.artifact.manifest import read_manifest
from neuron_buckets.cli import app
from neuron_buckets.config import ConfigError, enumerate_grid, parse_config
from neuron_buckets.engine.embedder import Embedder
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.engine.pooler import Pooler
from neuron_buckets.runtime.bucket_runtime import ArtifactError
from tests.conftest import (
    EMBED_CONFIG,
    TEXT_EAGER,
    as_embedding,
    error_line,
    tiny_tokenizer,
    wait_for_line,
    write_config,
)
from tests.test_serve import MODEL, client, post, serving

# Inputs of 1 to 45 tokens: more than max_num_seqs (2) per call, and one longer than the largest
# bucket (32 tokens), which runs in two waves over the cache.
INPUTS = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((5, 1, 17, 45, 30, 9))]


def expected(model_dir: Path, inputs: list[list[int]], pooling: str) -> torch.Tensor:
    """transformers' pooled, L2-normalized final hidden states (after the final norm)."""
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        states = [model(torch.tensor([ids])).last_hidden_state[0] for ids in inputs]
    pooled = torch.stack([h[-1] if pooling == "last" else h.mean(0) for h in states])
    return F.normalize(pooled, dim=-1)


def test_an_embedding_config_has_prefill_buckets_only_and_checks_its_keys():
    raw = {"model": {"task": "embed", "pooling": "mean"}, "buckets": {"max_num_batched_tokens": 32,
                                                                    "num_batched_tokens_buckets": [16, 32]}}
    config = parse_config(raw)
    assert [b.kind for b in enumerate_grid(config)] == ["prefill", "prefill"]
    assert config.model.normalize and config.model.pooling == "mean"
    bad = [
        ({"task": "classify"}, "model.task must be one of"),
        ({"task": "embed", "pooling": "cls"}, "model.pooling must be one of"),
        ({"task": "embed", "normalize": 1}, "model.normalize must be true or false"),
    ]
    for model, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_config({"model": model})
    with pytest.raises(ConfigError, match="tensor_parallel_size = 1"):
        parse_config({"model": {"task": "embed"}, "parallel": {"tensor_parallel_size": 2}})


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooler_takes_each_inputs_last_token_or_mean_and_normalizes(pooling, normalize):
    hidden = [torch.randn(n, 8, generator=torch.Generator().manual_seed(n)) for n in (3, 1, 6)]
    want = torch.stack([h[-1] if pooling == "last" else h.mean(0) for h in hidden])
    got = Pooler(pooling, normalize)(hidden)
    assert torch.allclose(got, F.normalize(want, dim=-1) if normalize else want, atol=1e-6)
    assert torch.allclose(got.norm(dim=-1), torch.ones(3)) == normalize


@pytest.mark.slow
def test_manifest_and_dry_run_say_it_is_an_embedding_artifact_and_nb_verify_passes_it(
    embedding_dir, tmp_path, hf_model_dir
):
    manifest = read_manifest(embedding_dir)
    assert manifest.embedding is not None and manifest.embedding.pooling == "last"
    assert {b.kind for b in manifest.buckets} == {"prefill"}
    assert all("norm" in b.pieces and "head" not in b.pieces for b in manifest.buckets)
    # one norm (dynamic shapes: one for every token count), one embed, a layer and fresh layer per bucket
    assert sorted(p.role for p in manifest.pieces.values()) == ["embed", *["layer"] * 4, "norm"]
    verified = CliRunner().invoke(app, ["verify", str(embedding_dir)])
    assert verified.exit_code == 0, verified.output
    listed = CliRunner().invoke(app, ["ls", str(embedding_dir)])
    assert listed.exit_code == 0 and "embedding artifact: prefill buckets only" in listed.output
    config = write_config(tmp_path, hf_model_dir, EMBED_CONFIG)
    result = CliRunner().invoke(app, ["compile", str(config), "--out", str(tmp_path / "o"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "embedding artifact: prefill buckets only" in result.output and "pooling last" in result.output


@pytest.mark.slow
def test_a_generation_runtime_has_no_hidden_states_and_an_embedding_one_does_not_generate(
    compiled_dir, embedding_dir
):
    with pytest.raises(ArtifactError, match="compiled for generation"):
        Embedder.open(compiled_dir)
    with pytest.raises(ArtifactError, match="embedding artifact"):
        LLMEngine.open(embedding_dir)


@pytest.mark.slow
def test_embeddings_through_the_openai_client_equal_transformers_pooled_hidden_states(
    embedding_dir, hf_model_dir
):
    """Last-token pooling (the artifact's) in-process; base64 (the client's default) and float."""
    embedder = Embedder.open(embedding_dir)
    want = expected(hf_model_dir, INPUTS, "last")
    with serving(embedder) as base:
        c = client(base)
        batched = c.embeddings.create(model=MODEL, input=INPUTS)
        single = c.embeddings.create(model=MODEL, input=INPUTS[3], encoding_format="float")
        status, refused = post(f"{base}/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    got = torch.tensor([d.embedding for d in batched.data])
    assert [d.index for d in batched.data] == list(range(len(INPUTS)))
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    assert torch.allclose(torch.tensor(single.data[0].embedding), want[3], atol=1e-4, rtol=0)
    assert batched.usage.prompt_tokens == batched.usage.total_tokens == sum(map(len, INPUTS))
    assert status == 400 and "compiled for embeddings" in refused["error"]["message"]


@pytest.mark.slow
def test_nb_serve_pooling_mean_equals_transformers_mean_of_hidden_states(embedding_dir, hf_model_dir):
    cmd = [sys.executable, "-m", "neuron_buckets.cli", "serve", str(embedding_dir), "--port", "0",
           "--served-model-name", MODEL, "--pooling", "mean"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        m, _ = wait_for_line(proc, r"serving 'tiny' at (http://127\.0\.0\.1:\d+)")
        c = client(m.group(1))
        batched = c.embeddings.create(model=MODEL, input=INPUTS)
        single = c.embeddings.create(model=MODEL, input=INPUTS[0])
        with pytest.raises(openai.BadRequestError, match="dimensions=8 is not supported"):
            c.embeddings.create(model=MODEL, input=INPUTS[0], dimensions=8)
    finally:
        proc.kill()
        proc.wait(60)
    want = expected(hf_model_dir, INPUTS, "mean")
    assert torch.allclose(torch.tensor([d.embedding for d in batched.data]), want, atol=1e-4, rtol=0)
    assert torch.allclose(torch.tensor(single.data[0].embedding), want[0], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_text_inputs_are_tokenized_as_transformers_does(text_model, tmp_path):
    """A string and a list of strings, through the artifact's tokenizer (eager pieces)."""
    config = write_config(tmp_path, text_model[0], as_embedding(TEXT_EAGER))
    args = ["compile", str(config), "--out", str(tmp_path / "art"), "--cache-dir", str(tmp_path / "c")]
    assert (result := CliRunner().invoke(app, args)).exit_code == 0, result.output
    texts = ["hello world", "the quick brown fox jumps over the lazy dog"]
    tok = tiny_tokenizer()
    want = expected(text_model[0], [tok.encode(t) for t in texts], "last")
    with serving(Embedder.open(tmp_path / "art")) as base:
        c = client(base)
        one = c.embeddings.create(model=MODEL, input=texts[1])
        both = c.embeddings.create(model=MODEL, input=texts)
    assert torch.allclose(torch.tensor(one.data[0].embedding), want[1], atol=1e-4, rtol=0)
    assert torch.allclose(torch.tensor([d.embedding for d in both.data]), want, atol=1e-4, rtol=0)
    assert both.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)


@pytest.mark.slow
def test_a_generation_server_refuses_embeddings_naming_why(compiled_dir):
    with serving(LLMEngine.open(compiled_dir)) as base:
        status, body = post(f"{base}/v1/embeddings", {"input": [1, 2, 3]})
    assert status == 400
    message = body["error"]["message"]
    assert "compiled for generation" in message and 'task = "embed"' in message


def test_nb_serve_refuses_a_runtime_file_for_an_embedding_artifact(embedding_dir, tmp_path):
    """A runtime file only sets decode drafting, which an embedding artifact never runs: even one
    that leaves drafting off is refused in one line rather than read by nothing."""
    file = tmp_path / "run.toml"
    file.write_text("[speculative]\nauto_off = false\n")
    result = CliRunner().invoke(app, ["serve", str(embedding_dir), "--port", "0", "--config", str(file)])
    assert error_line(result) == "error: an embedding artifact does not decode: drop the speculative options"

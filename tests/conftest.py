"""Shared fixtures: a small random Llama in transformers format, one compiled artifact of it, and
a small BPE tokenizer.

Compiling costs seconds per graph, so the suite compiles one tiny grid once per session; xdist
workers share the graph cache (under a file lock), so the second worker only links graphs.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from typer.testing import CliRunner

from neuron_buckets.core.step_plan import Segment, StepPlan
from tests.steps_compared import recording

TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.2,
    tie_word_embeddings=False,
)

# A random model's top two logits lie within a tenth of its largest |logit| at almost every step,
# so checks within a half-precision tolerance (or W8A8's) would decide almost no greedy step. Tied
# embeddings at a small scale make each step's token stand out (mostly it repeats the last one, the
# layers' part small): the models of those checks, so that they decide at least 90% of their steps.
PEAKED = dict(tie_word_embeddings=True, initializer_range=0.02)

# prefill 16/32 tokens (packing up to 2 requests), decode batches 1/2 at ctx 128: four buckets run by
# six pieces (the shared dynamic embed and head, a layer each), enough to mix buckets, pack, chunk
# and split.
TINY_CONFIG = """
[model]
path = "{model}"

[cache]
block_size = 8
num_blocks = 64
max_model_len = 128

[buckets]
max_num_seqs = 2
max_num_batched_tokens = 32
num_seqs_buckets = [1, 2]
num_batched_tokens_buckets = [16, 32]

[compile]
backend = "inductor"
jobs = 2
fresh_layers = true
"""


# Each supported architecture as a transformers class pair and what its tiny config sets beyond
# TINY_LLAMA: Qwen3 an explicit head_dim unlike hidden / heads, Mistral a window that the tests'
# contexts outgrow, Llama with attention_bias its q/k/v/o biases.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12}),
}


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random transformers model of ``arch`` (a key of ARCHITECTURES), float32, in eval mode.

    transformers starts biases at 0 and the q/k norms at 1, which would hide a bias or a norm
    that nb forgot; they are drawn at random here too.
    """
    import transformers

    config_class, model_class, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**TINY_LLAMA, **extra, **overrides})
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.3)
    return model


def save_tiny_model(
    directory: Path, arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> Path:
    """``tiny_hf_model`` saved with save_pretrained (safetensors) in ``dtype``."""
    tiny_hf_model(arch, seed, **overrides).to(dtype).save_pretrained(directory, safe_serialization=True)
    return directory


def save_tiny_llama(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random transformers LlamaForCausalLM saved with save_pretrained (safetensors)."""
    return save_tiny_model(directory, "llama", seed, **overrides)


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_tokenizer():
    """A byte-level BPE tokenizer (any bytes round-trip) trained on a few sentences, with a BOS
    added to every prompt and a chat template: a transformers tokenizer, not yet saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, initial_alphabet=alphabet)
    corpus = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo wörld 日本語"]
    tok.train_from_iterator(corpus * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


@pytest.fixture(autouse=True)
def steps_compared(record_property) -> Iterator[None]:
    """Each equality check's count of compared steps, as a property of the test that ran it."""
    with recording(record_property):
        yield


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def graph_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One graph cache for the whole run, shared by xdist workers."""
    return tmp_path_factory.getbasetemp().parent / "nb-graph-cache"


def write_config(directory: Path, model_dir: Path, text: str = TINY_CONFIG) -> Path:
    path = directory / "nb.toml"
    path.write_text(textwrap.dedent(text).format(model=model_dir.as_posix()))
    return path


@pytest.fixture(scope="session")
def tiny_config_file(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("config"), hf_model_dir)


@pytest.fixture(scope="session")
def compiled_dir(
    tiny_config_file: Path, graph_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny model compiled with inductor (four buckets, six pieces), once per test session."""
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    out = tmp_path_factory.mktemp("artifact")
    graph_cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(graph_cache_dir) + ".lock"):
        report = Compiler(load_config(tiny_config_file), out, graph_cache_dir).run(jobs=2)
    assert not report.failed, [o.error for o in report.failed]
    return out


# The tiny model as an embedding artifact: TINY_CONFIG's cache and prefill buckets, so its embed and
# layer pieces are the generation artifact's (taken from the shared graph cache), and only the
# final-norm piece is compiled.
def as_embedding(config: str) -> str:
    """A config text for ``task = "embed"``: an embedding artifact has no decode batch sizes."""
    return config.replace('path = "{model}"', 'path = "{model}"\ntask = "embed"').replace(
        "num_seqs_buckets = [1, 2]\n", "")


EMBED_CONFIG = as_embedding(TINY_CONFIG)


@pytest.fixture(scope="session")
def embedding_dir(
    hf_model_dir: Path, graph_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny model compiled with inductor for embeddings (two prefill buckets), once per session."""
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    tmp = tmp_path_factory.mktemp("embedding")
    config = write_config(tmp, hf_model_dir, EMBED_CONFIG)
    graph_cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(graph_cache_dir) + ".lock"):
        report = Compiler(load_config(config), tmp / "art", graph_cache_dir).run(jobs=2)
    assert not report.failed, [o.error for o in report.failed]
    return tmp / "art"


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF, as ``make real-model`` (run by ``make test``) leaves it."""
    from tests.real_model import gguf_path

    if not (path := gguf_path()).is_file():
        pytest.skip(f"the real model is not fetched: {path} is absent (make real-model)")
    return path


def error_line(result) -> str:
    """The one ``error:`` line of a refused ``nb`` command (exit 2, nothing else said)."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def wait_for_line(proc: subprocess.Popen, pattern: str) -> tuple[re.Match, list[str]]:
    """Read a started ``nb serve``'s stderr up to the line matching ``pattern`` (the one saying where
    it listens), and the lines so far; the test fails if the server exits before it."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if m := re.search(pattern, line):
            return m, lines
    pytest.fail(f"nb serve exited with {proc.wait()} before listening: {''.join(lines[-5:])}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert proc.poll() is None, f"server exited with status {proc.returncode}"
            assert time.monotonic() < deadline, f"nothing listens on 127.0.0.1:{port}"
            time.sleep(0.2)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server on 127.0.0.1, as s3fs tests itself: one per xdist worker."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_listening(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def aws_env(endpoint: str, home: Path) -> dict[str, str]:
    """What boto and s3fs read: the moto endpoint, dummy keys, and nothing of this machine's
    (no ~/.aws files, no instance metadata lookup, which would leave 127.0.0.1)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-credentials"),
        "AWS_CONFIG_FILE": str(home / "no-config"),
    }


@pytest.fixture
def s3_bucket(s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the moto server, with this process's AWS variables pointing at it."""
    import boto3

    for name, value in aws_env(s3_endpoint, tmp_path).items():
        monkeypatch.setenv(name, value)
    name = f"nb-{tmp_path.name.lower().replace('_', '-')[-40:].strip('-')}-{free_port()}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


# The text model of test_text.py and test_serve.py: a tiny Llama with a byte-level BPE tokenizer.
TEXT_PROMPT = "hello world"
TEXT_MAX_NEW = 12
TEXT_EAGER = TINY_CONFIG.replace('"inductor"', '"eager"')


def first_new(tokens: list[int], start: int = 2) -> int:
    """The first position from ``start`` whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], int]:
    """(model directory, transformers' greedy tokens for TEXT_PROMPT without a stop, the step whose
    token was made the end-of-sequence id)."""
    import transformers

    directory = tmp_path_factory.mktemp("text-llama")
    tok = tiny_tokenizer()
    tok.save_pretrained(directory)
    save_tiny_llama(directory, vocab_size=len(tok), bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    model.generation_config.eos_token_id = None  # the greedy run to pick an end-of-sequence id from
    ids = torch.tensor([tok.encode(TEXT_PROMPT)])
    with torch.no_grad():
        mask = torch.ones_like(ids)
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=TEXT_MAX_NEW)
    greedy = out[0, ids.shape[1] :].tolist()
    k = first_new(greedy, start=3)
    generation = directory / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": [greedy[k]]}))
    return directory, greedy, k


@pytest.fixture(scope="module")
def text_artifact(text_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("text-artifact")
    config = write_config(tmp, text_model[0], TEXT_EAGER)
    from neuron_buckets.cli import app

    args = ["compile", str(config), "--out", str(tmp / "art"), "--cache-dir", str(tmp / "c")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return tmp / "art"


def segment(token_ids, start: int, block_ids, num_samples: int = 1) -> Segment:
    """A segment to pad by hand: one request's ``token_ids`` at positions ``start``, ... over
    ``block_ids``, its last ``num_samples`` tokens sampled."""
    return Segment(0, token_ids, start, block_ids, num_samples)


def prefill_plan(chunks: Iterable[tuple]) -> StepPlan:
    """A step plan of prompt chunks, ``(token_ids, start, block_ids)`` each, each sampling its last
    token: what a scheduler writes for requests that prefill."""
    return tuple(Segment(i, ids, start, blocks, 1) for i, (ids, start, blocks) in enumerate(chunks))


def decode_plan(rows: Iterable[tuple]) -> StepPlan:
    """A step plan of decode rows, ``(token_ids, start, block_ids)`` each, every token sampled (the
    last generated token and its drafts): what a scheduler writes for requests that decode."""
    return tuple(Segment(i, ids, start, blocks, len(ids)) for i, (ids, start, blocks) in enumerate(rows))


def transformers_greedy(model_dir: Path, lengths: tuple[int, ...] = (5, 13), max_new: int = 8):
    """Seeded random prompts of ``lengths`` and transformers' greedy continuation of each (no
    end-of-sequence id): the reference the backends' whole-generation tests hold their pieces to."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, pad_token_id=0, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
    return prompts, want


def random_layer(config, gen: torch.Generator):
    """A layer of ``config`` with random weights; quantized projections as the checkpoint stores
    them (random int8 or float8 values) with random positive scales."""
    from dataclasses import fields

    from neuron_buckets.model.quant.quantized_weight import QuantizedWeight
    from neuron_buckets.model.weights import example_layer

    def rand(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen) * 0.1 + (1.0 if t.dim() == 1 else 0.0)

    def filled(w):
        if w is None:
            return None
        if not isinstance(w, QuantizedWeight):
            return rand(w)
        values = torch.randn(w.data.shape, generator=gen) * 60
        data = values.round().clamp(-127, 127).to(torch.int8) if w.scheme.weights == "int8" else \
            values.to(torch.float8_e4m3fn)
        inputs = None if w.input_scale is None else torch.tensor([0.01])  # |x| up to 4.48 unclamped
        return QuantizedWeight(data, torch.rand(w.scale.shape, generator=gen) * 1e-3 + 1e-4, w.scheme, inputs)

    layer = example_layer(config, torch.float32)
    return type(layer)(**{f.name: filled(getattr(layer, f.name)) for f in fields(layer)})

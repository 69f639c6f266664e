"""Quantized checkpoints (compressed-tensors): read, compiled, served, and checked.

Each supported scheme's checkpoint is made here from a random tiny model with
compressed-tensors' own compressors (``model/checkpoint_quantizer.py``); nothing is downloaded.
Everything runs in float32, so that the reference's arithmetic is the kernels' up to rounding:
nb's eager float model over the dequantized weights (the eager backend over a float checkpoint of
them); for W8A8, whose activations are quantized per token too, the eager backend over the
quantized checkpoint (dequantized weights times the quantized activations, in float32). Greedy
tokens over a NaN-poisoned cache equal the reference's up to the first near-tie (top two logits
within twice the tolerance), and the logits along its path lie within ``TOLERANCE`` times the
largest |logit|. Against transformers' own loading of the same checkpoint (its compressed-tensors
integration, which decompresses the weights) the logits lie within ``HF_TOLERANCE``. At least 90% of
each check's steps come before its first near-tie (``tests/steps_compared.py``): the model is a
peaked one (``PEAKED``), on which W8A8's tenth of the largest |logit| still decides the tokens.
W8A8 also runs as benchmarked (bench/bench_quantized.py): a bfloat16 checkpoint compiled in
bfloat16, against the float32 reference within bfloat16's tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from neuron_buckets.artifact.manifest import read_manifest
from neuron_buckets.kernels.linear_choice import KERNEL_INT8, linear_choice
from neuron_buckets.model.checkpoint import checkpoint_tensors, load_model, load_weights, read_config
from neuron_buckets.model.checkpoint_quantizer import quantize_checkpoint
from neuron_buckets.model.quant.compressed_tensors_format import scheme_of
from neuron_buckets.model.quant.quant_scheme import QuantScheme
from neuron_buckets.model.quant.quantized_weight import QuantizedWeight
from neuron_buckets.model.weights import LayerWeights, example_layer
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from tests.conftest import (
    PEAKED,
    TINY_CONFIG,
    decode_plan,
    error_line,
    prefill_plan,
    save_tiny_model,
    write_config,
)
from tests.steps_compared import assert_follows
from tests.test_architectures import TOLERANCE as ARCH_TOLERANCE
from tests.test_architectures import prompts
from tests.test_engine import greedy

SCHEMES = {
    s.name: s
    for s in (
        QuantScheme("int8", "channel"),
        QuantScheme("int8", "channel", "int8_token"),
        QuantScheme("float8_e4m3fn", "tensor"),
        QuantScheme("float8_e4m3fn", "channel"),
        QuantScheme("float8_e4m3fn", "tensor", "float8_tensor"),
    )
}
TOLERANCE = 1e-4  # of the largest |logit|
# transformers quantizes W8A8's activations as compressed-tensors does, each token's scale its
# amax / 127.5; nb as vLLM does, amax / 127: other int8 values, which this random model amplifies.
HF_TOLERANCE = {"w8a8-int8-channel": 0.1}  # of the largest |logit|; the others: TOLERANCE
MAX_NEW = 8
PROMPT_LENS = (5, 40, 11)
CONFIG = (
    TINY_CONFIG.replace("num_seqs_buckets = [1, 2]", "num_seqs_buckets = [4]")
    .replace("max_num_seqs = 2", "max_num_seqs = 4")
    .replace("num_batched_tokens_buckets = [16, 32]", "num_batched_tokens_buckets = [32]")
    .replace("max_model_len = 128", 'max_model_len = 128\ndtype = "float32"')
    .replace("fresh_layers = true", "fresh_layers = false")
)


def ct_config(preset: str, **changes) -> dict:
    """A compressed-tensors quantization_config of one of its presets (targets Linear, lm_head
    ignored), with ``changes`` to its weights' arguments."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    for key, value in changes.items():
        setattr(scheme.weights, key, value)
    return QuantizationConfig(
        config_groups={"group_0": scheme},
        quantization_status="compressed",
        ignore=["lm_head"],
        format="pack-quantized",
    ).model_dump(mode="json")


def test_presets_read_as_their_schemes():
    w8a16 = ct_config("W8A16", strategy="channel", group_size=None)
    assert scheme_of(w8a16) == QuantScheme("int8", "channel")
    assert scheme_of({**ct_config("W8A8"), "format": "int-quantized"}) == SCHEMES["w8a8-int8-channel"]
    assert scheme_of({**ct_config("FP8"), "format": "float-quantized"}) == SCHEMES["w8a8-fp8-tensor"]


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (lambda: ct_config("W4A16"), "weights int4 group(128)"),
        (lambda: ct_config("W8A16"), "weights int8 group(128)"),
        (lambda: ct_config("W8A16", strategy="channel", group_size=None, symmetric=False), "asymmetric"),
        (
            lambda: {**ct_config("FP8_DYNAMIC"), "format": "float-quantized"},
            "activations float8 token dynamic",
        ),
        (
            lambda: {
                **ct_config("W8A16", strategy="channel", group_size=None),
                "ignore": ["lm_head", "re:.*0.mlp.*"],
            },
            "ignore entries ['re:.*0.mlp.*']",
        ),
        (
            lambda: {**ct_config("W8A16", strategy="channel", group_size=None), "ignore": []},
            "quantizes lm_head",
        ),
        (lambda: {"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        (lambda: {**ct_config("FP8_BLOCK"), "format": "float-quantized"}, "weights float8 block"),
    ],
)
def test_an_unsupported_scheme_is_refused_by_name(config, named: str):
    with pytest.raises(ValueError, match="not supported") as e:
        scheme_of(config())
    assert named in str(e.value)


def test_an_unsupported_checkpoint_fails_in_one_line_before_anything_compiles(tmp_path: Path):
    from typer.testing import CliRunner

    from neuron_buckets.cli import app

    model = save_tiny_model(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": ct_config("W4A16")}))
    out = tmp_path / "artifact"
    result = CliRunner().invoke(
        app, ["compile", str(write_config(tmp_path, model, CONFIG)), "--out", str(out)]
    )
    assert result.exit_code == 2
    assert "weights int4 group(128)" in error_line(result)
    assert not (out / "graphs").exists() and not (out / "weights.safetensors").exists()


def test_a_quantized_layer_flattens_to_data_and_scale_and_back():
    config = read_config_of(QuantScheme("int8", "channel", "int8_token"))
    layer = example_layer(config, torch.bfloat16)
    flat = layer.tensors()
    assert [t.dtype for t in flat[1:3]] == [torch.int8, torch.float32]  # qkv's data, then its scale
    rebuilt = LayerWeights.of(config, flat)
    assert isinstance(rebuilt.down, QuantizedWeight) and rebuilt.down.scheme == config.quantization
    assert all(a is b for a, b in zip(rebuilt.tensors(), flat, strict=True))


def test_narrow_takes_the_channels_scales_only_along_the_outputs():
    w = QuantizedWeight(
        torch.arange(12, dtype=torch.int8).reshape(4, 3), torch.arange(4.0), SCHEMES["w8a16-int8-channel"]
    )
    rows, cols = w.narrow(0, 1, 2), w.narrow(1, 1, 2)
    assert rows.scale.tolist() == [1.0, 2.0] and rows.data.tolist() == [[3, 4, 5], [6, 7, 8]]
    assert cols.scale.tolist() == [0.0, 1.0, 2.0, 3.0] and cols.data.shape == (4, 2)
    torch.testing.assert_close(rows.dequantize(torch.float32), w.dequantize(torch.float32)[1:3])


def test_fused_parts_share_the_largest_input_scale_and_split_keeps_it():
    """q, k and v read one input: as vLLM fuses them, one input scale, the largest of theirs."""
    scheme = SCHEMES["w8a8-fp8-tensor"]
    data = torch.ones(2, 3).to(torch.float8_e4m3fn)
    parts = [QuantizedWeight(data, torch.full((2,), s), scheme, torch.tensor([s])) for s in (0.1, 0.3, 0.2)]
    fused = QuantizedWeight.fuse(parts)
    assert fused.input_scale.tolist() == [pytest.approx(0.3)] and len(fused.tensors()) == 3
    assert all(p.input_scale is fused.input_scale for p in fused.split([2, 2, 2]))


def read_config_of(scheme: QuantScheme):
    from neuron_buckets.model.checkpoint import DEFAULT_CONFIG

    return type(DEFAULT_CONFIG)(**{**vars(DEFAULT_CONFIG), "quantization": scheme})


@pytest.fixture(scope="module")
def float_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Peaked: W8A8 against transformers is within a tenth of the largest |logit| only."""
    return save_tiny_model(tmp_path_factory.mktemp("float") / "model", **PEAKED)


def dequantized_checkpoint(quantized: Path, out: Path) -> Path:
    """The float checkpoint of a quantized one's dequantized weights: the reference model."""
    from safetensors.torch import save_file

    model = load_model(quantized)
    config = type(model.config)(**{**vars(model.config), "quantization": None})
    tensors = {
        k: v.dequantize(torch.float32) if isinstance(v, QuantizedWeight) else v
        for k, v in dense_fields(model).items()
    }
    out.mkdir(parents=True)
    dense = load_weights(config, tensors)
    save_file(
        {k: v.contiguous() for k, v in checkpoint_tensors(config, dense).items()},
        str(out / "model.safetensors"),
    )
    (out / "config.json").write_text(json.dumps(config.to_hf()))
    return out


def dense_fields(model) -> dict:
    """The model's tensors by checkpoint name, each quantized projection still whole."""
    from neuron_buckets.model.checkpoint_names import LAYER_PARTS
    from neuron_buckets.model.weights import part_shapes

    out = {"model.embed_tokens.weight": model.weights.embed, "model.norm.weight": model.weights.norm}
    if model.weights.lm_head is not None:
        out["lm_head.weight"] = model.weights.lm_head
    for i, layer in enumerate(model.weights.layers):
        for field, parts in part_shapes(model.config).items():
            names = [f"model.layers.{i}.{n}" for n in LAYER_PARTS[field]]
            out.update(zip(names, getattr(layer, field).split([p[0] for p in parts]), strict=True))
    return out


def compile_artifact(
    model: Path, root: Path, backend: str, cache: Path, tensor_parallel_size: int = 1, dtype: str = "float32"
) -> Path:
    from neuron_buckets.compile.compiler import Compiler
    from neuron_buckets.config import load_config

    root.mkdir(parents=True, exist_ok=True)
    text = (
        CONFIG.replace('"inductor"', f'"{backend}"').replace('"float32"', f'"{dtype}"')
        + f"\n[parallel]\ntensor_parallel_size = {tensor_parallel_size}\n"
    )
    config = load_config(write_config(root, model, text))
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        report = Compiler(config, root / "artifact", cache).run(jobs=2)
    assert not report.failed, [o.error for o in report.failed]
    return root / "artifact"


def poisoned(directory: Path) -> BucketRuntime:
    runtime = BucketRuntime.open(directory)
    runtime.k_cache.fill_(float("nan"))
    runtime.v_cache.fill_(float("nan"))
    return runtime


def along(runtime: BucketRuntime, batch: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
    """(prompts, steps, vocab) float32 logits of each step with ``tokens`` fed back: prefill, then
    decode."""
    blocks = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(batch))]  # 64 positions each
    steps = [runtime.run_plan(prefill_plan((p, 0, b) for p, b in zip(batch, blocks, strict=True)))]
    for i in range(MAX_NEW - 1):
        rows = decode_plan(([t[i]], len(p) + i, b) for p, t, b in zip(batch, tokens, blocks, strict=True))
        steps.append(runtime.run_plan(rows))
    return torch.stack(steps, dim=1).float()


@pytest.fixture(
    scope="module", params=[pytest.param(n, marks=pytest.mark.xdist_group(f"quant-{n}")) for n in SCHEMES]
)
def scheme_dirs(
    request, float_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path]:
    """A scheme's quantized checkpoint and the eager artifact of its reference."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    quantized = quantize_checkpoint(float_model, root / "quantized", SCHEMES[name])
    dense = (
        quantized
        if SCHEMES[name].activations != "none"
        else dequantized_checkpoint(quantized, root / "dense")
    )
    return name, quantized, compile_artifact(dense, root / "ref", "eager", root / "cache")


def check_against_reference(artifact: Path, reference: Path, tolerance: float = TOLERANCE) -> None:
    batch = prompts(PROMPT_LENS, seed=1)
    want = greedy(poisoned(reference), batch, MAX_NEW)
    got = greedy(poisoned(artifact), batch, MAX_NEW)
    logits = along(poisoned(reference), batch, want)
    atol = tolerance * float(logits.abs().max())
    assert_follows(want, logits, atol, got, along=along(poisoned(artifact), batch, want))


def test_the_eager_backend_follows_the_reference(scheme_dirs, tmp_path: Path):
    """The eager pieces over the quantized weights (each scheme's math without its kernels)."""
    name, quantized, reference = scheme_dirs
    check_against_reference(compile_artifact(quantized, tmp_path, "eager", tmp_path / "cache"), reference)


@pytest.mark.slow
def test_compiled_quantized_pieces_follow_the_reference_and_transformers(
    scheme_dirs, tmp_path: Path, graph_cache_dir: Path
):
    """The inductor pieces (each scheme's kernels through AOTInductor) against the eager float
    reference, then against transformers' loading of the same checkpoint along its greedy path."""
    import transformers

    name, quantized, reference = scheme_dirs
    artifact = compile_artifact(quantized, tmp_path, "inductor", graph_cache_dir)
    runtime = BucketRuntime.open(artifact)
    qkv = runtime.weights.layers[0].qkv
    assert isinstance(qkv, QuantizedWeight)
    # W8A8 runs nb's INT8 kernel where the CPU has AVX512-VNNI: its library ships, its weights are packed
    in_kernel = qkv.scheme.activations == "int8_token" and linear_choice().int8_w8a8 == KERNEL_INT8
    assert ("int8_linear_cpu" in runtime.manifest.libraries) == qkv.vnni == in_kernel
    check_against_reference(artifact, reference)

    hf = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32).eval()
    batch = prompts(PROMPT_LENS, seed=2)
    wants, hf_logits = [], []
    for p in batch:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                pad_token_id=0,
                eos_token_id=None,
                return_dict_in_generate=True,
                output_logits=True,
            )
        wants.append(out.sequences[0, len(p) :].tolist())
        hf_logits.append(torch.cat(out.logits).float())
    got = greedy(poisoned(artifact), batch, MAX_NEW)
    atol = HF_TOLERANCE.get(name, TOLERANCE) * float(torch.stack(hf_logits).abs().max())
    assert_follows(wants, hf_logits, atol, got, along=along(poisoned(artifact), batch, wants))


@pytest.mark.slow
@pytest.mark.xdist_group("quant-w8a8-int8-channel")
def test_w8a8_in_bfloat16_follows_its_float32_reference(tmp_path: Path, graph_cache_dir: Path):
    """The benched setup (bench/bench_quantized.py): W8A8 over a checkpoint stored in bfloat16,
    compiled with inductor in bfloat16 (nb's INT8 kernel where the CPU has VNNI), against the eager
    float32 reference over the same checkpoint, within bfloat16's tolerance against transformers."""
    model = save_tiny_model(tmp_path / "float", dtype=torch.bfloat16, **PEAKED)
    quantized = quantize_checkpoint(model, tmp_path / "quantized", SCHEMES["w8a8-int8-channel"])
    reference = compile_artifact(quantized, tmp_path / "ref", "eager", tmp_path / "cache")
    artifact = compile_artifact(quantized, tmp_path / "bf16", "inductor", graph_cache_dir, dtype="bfloat16")
    manifest = read_manifest(artifact)
    assert manifest.model.dtype == "bfloat16"
    assert ("int8_linear_cpu" in manifest.libraries) == (linear_choice().int8_w8a8 == KERNEL_INT8)
    check_against_reference(artifact, reference, ARCH_TOLERANCE["bfloat16"])


LAYERED = dict(intermediate_size=512, num_hidden_layers=4, tie_word_embeddings=True)


@pytest.mark.parametrize("scheme", ["w8a16-int8-channel", "w8a16-fp8-tensor"])
def test_artifact_weights_are_at_most_055x_the_bfloat16_artifacts(scheme: str, tmp_path: Path):
    """On a model whose bytes are mostly its decoder projections (the embedding and the head stay
    bfloat16, so a model with a large vocabulary saves less)."""
    model = save_tiny_model(tmp_path / "float", dtype=torch.bfloat16, **LAYERED)
    quantized = quantize_checkpoint(model, tmp_path / "quantized", SCHEMES[scheme])
    sizes = {}
    for name, directory in (("bf16", model), ("quantized", quantized)):
        artifact = compile_artifact(directory, tmp_path / name, "eager", tmp_path / "cache")
        sizes[name] = (artifact / "weights.safetensors").stat().st_size
        assert read_config(directory).quantization == (None if name == "bf16" else SCHEMES[scheme])
    assert sizes["quantized"] <= 0.55 * sizes["bf16"], sizes


def test_the_memory_estimate_counts_the_quantized_bytes(float_model: Path, tmp_path: Path):
    from neuron_buckets.runtime.memory import weights_bytes

    quantized = quantize_checkpoint(float_model, tmp_path / "q", SCHEMES["w8a16-int8-channel"])
    model = load_model(quantized, torch.bfloat16)
    held = sum(t.nbytes for t in model.weights.tensors())
    assert weights_bytes(model.config, "bfloat16") == held
    dense = type(model.config)(**{**vars(model.config), "quantization": None})
    assert held < 0.7 * weights_bytes(dense, "bfloat16")

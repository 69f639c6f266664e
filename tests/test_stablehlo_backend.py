"""Neuron's torch-mlir route on this CPU: every piece lowered to StableHLO, compiled by IREE for the
CPU, and run against the eager model over NaN-poisoned caches.

The grids are the tiny two-layer model's: in float32 all four buckets (prefill of 16 and 32
tokens packing two requests, decode of one and two rows), with and without two speculative
positions; in bfloat16 and float16 one prefill and one decode bucket of two rows, with and without
speculation (the pieces are the same code at other shapes; each IREE compile takes seconds).
Artifacts are built by ``nb compile``'s compiler once per module and share one graph cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from neuron_buckets.config import Config, load_config
from tests.conftest import TINY_CONFIG, transformers_greedy, write_config
from tests.steps_compared import assert_same_tokens

INSTALL = "pip install 'neuron-buckets[stablehlo]'"
pytest.importorskip("torch_mlir", reason=f"needs torch-mlir ({INSTALL})")
pytest.importorskip("iree.runtime", reason=f"needs iree-base-runtime ({INSTALL})")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("stablehlo")]

SPECULATIVE = "\nspeculation_length = 2"
FULL = TINY_CONFIG.replace('"inductor"', '"stablehlo"').replace("fresh_layers = true", "fresh_layers = false")
SMALL = FULL.replace("num_seqs_buckets = [1, 2]", "num_seqs_buckets = [2]").replace(
    "num_batched_tokens_buckets = [16, 32]", "num_batched_tokens_buckets = [16]"
).replace("max_num_batched_tokens = 32", "max_num_batched_tokens = 16")
# (dtype, grid text, speculation) -> the bucket names it must hold
GRIDS = {
    ("float32", "full", SPECULATIVE):
        ["decode_b1_s3_c128", "decode_b2_s3_c128", "prefill_s16", "prefill_s32"],
    ("float32", "full", ""): ["decode_b1_c128", "decode_b2_c128", "prefill_s16", "prefill_s32"],
    **{(dtype, "small", spec): ["decode_b2_s3_c128" if spec else "decode_b2_c128", "prefill_s16"]
       for dtype in ("bfloat16", "float16") for spec in (SPECULATIVE, "")},
}


def grid_config(root: Path, model_dir: Path, dtype: str, grid: str, speculation: str) -> Config:
    text = {"full": FULL, "small": SMALL}[grid].replace(
        "max_model_len = 128", f'max_model_len = 128\ndtype = "{dtype}"'
    ).replace("[compile]", f"{speculation.strip()}\n\n[compile]")
    return load_config(write_config(root, model_dir, text))


@pytest.fixture(scope="module")
def artifacts(hf_model_dir, graph_cache_dir, tmp_path_factory):
    """(dtype, grid, speculation) -> (artifact directory, the compile report), built once per module."""
    from neuron_buckets.compile.compiler import Compiler

    made: dict[tuple[str, str, str], tuple] = {}

    def get(dtype: str, grid: str, speculation: str) -> tuple:
        if (dtype, grid, speculation) not in made:
            root = tmp_path_factory.mktemp(f"stablehlo-{dtype}-{grid}")
            graph_cache_dir.mkdir(parents=True, exist_ok=True)
            with FileLock(str(graph_cache_dir) + ".lock"):
                config = grid_config(root, hf_model_dir, dtype, grid, speculation)
                report = Compiler(config, root / "art", graph_cache_dir).run()
            assert not report.failed, [o.error for o in report.failed]
            made[dtype, grid, speculation] = (root / "art", report, config)
        return made[dtype, grid, speculation]

    return get


def graph_records(directory: Path) -> dict[str, dict]:
    from neuron_buckets.artifact.manifest import read_manifest

    pieces = read_manifest(directory).pieces.values()
    return {r.name: json.loads((directory / r.file).read_text()) for r in pieces}


def dims(tensor_type: str) -> list[int]:
    """The shape of an MLIR tensor type as printed: ``tensor<16x128xf32>`` -> [16, 128]."""
    return [int(d) for d in re.fullmatch(r"tensor<((?:\d+x)*)[a-zA-Z0-9]+>", tensor_type)[1].split("x")[:-1]]


def test_every_piece_is_stablehlo_with_every_input_an_argument(artifacts):
    """Each piece's StableHLO takes every input (weights and caches included) as a function
    argument of the input's shape, in order: nothing is folded into a constant. The layer returns
    its output and both cache slices, of the caches' type; the record says how neuronx-cc would
    compile it, and the manifest keys torch-mlir and its decompositions."""
    from neuron_buckets.artifact.manifest import read_manifest

    directory, _, _ = artifacts("float32", "full", SPECULATIVE)
    records = graph_records(directory)
    assert len(records) == 12  # embed, layer and head of each token count: 3, 6 (decode), 16, 32
    for name, r in records.items():
        s = r["summary"]
        assert len(s["arguments"]) == len(r["input_shapes"]) == len(s["input_shapes"]), name
        for arg, shape in zip(s["arguments"], r["input_shapes"], strict=True):
            assert dims(arg) == shape, (name, arg, shape)
        if r["piece"] == "LayerPiece":
            k_cache = s["arguments"][7]
            assert s["results"][1:] == [k_cache, k_cache] and s["arguments"][8] == k_cache, name
            assert len(s["arguments"]) == 9 + 6  # the step and caches, then two norms, qkv, o, gate_up, down
        cmd = r["neuronx_cc"]
        assert cmd[:2] == ["neuronx-cc", "compile"] and cmd[2].endswith(".mlirbc")
        assert cmd[-2:] == ["--output", cmd[2].replace(".mlirbc", ".neff")], name
        assert cmd[cmd.index("--target") + 1] == "trn1", name
    assert sorted({r["piece"] for r in records.values()}) == ["EmbedPiece", "HeadPiece", "LayerPiece"]
    versions = read_manifest(directory).backend.versions
    assert versions["torch-mlir"] != "not installed" and len(versions["torch-mlir-decompositions"]) == 16


@pytest.mark.parametrize(("dtype", "grid", "speculation"), list(GRIDS), ids=[
    f"{d}-{g}-{'speculative' if s else 'default'}" for d, g, s in GRIDS
])
def test_iree_runs_every_bucket_as_eager_over_nan_poisoned_caches(artifacts, dtype, grid, speculation):
    """``nb verify --stablehlo``'s check: random padded steps of every bucket, each piece's
    StableHLO run by IREE, over caches NaN outside the step's blocks: logits and both caches
    within ``nb verify``'s tolerance of the eager model's, and NaN exactly where the eager
    model's are."""
    from neuron_buckets.runtime.verify import TOLERANCE, verify_graphs

    directory, _, _ = artifacts(dtype, grid, speculation)
    checks = verify_graphs(directory, trials=2, poisoned=True)
    assert sorted(c.name for c in checks) == GRIDS[dtype, grid, speculation]  # 2 trials per bucket
    for c in checks:
        assert c.ok, (c.name, c.detail)
        assert 0 < c.max_diff <= TOLERANCE[dtype], c.name  # it compared numbers, and they were close


def test_poisoning_fills_every_block_a_step_does_not_name():
    from neuron_buckets.core.bucket import Bucket
    from neuron_buckets.runtime.verify import poison, random_step

    gen = torch.Generator().manual_seed(0)
    bucket = Bucket("decode", 2, 3, 64)
    step = random_step(bucket, 8, 32, 256, gen, 2)
    cache = torch.zeros(2, 32, 8, 2, 4)
    poison(cache, step)
    named = set(step.block_table[: step.num_rows].flatten().tolist()) - {-1}
    assert len(named) >= 1
    for block in range(32):
        assert cache[:, block].isnan().all() == (block not in named), block


def test_a_second_compile_reuses_every_piece_with_no_new_lowering(artifacts, graph_cache_dir, tmp_path):
    """The StableHLO is stored under the piece's content key: compiling the same grid again into a
    new directory lowers nothing and writes the same bytes."""
    from neuron_buckets.compile.compiler import Compiler

    first, report, config = artifacts("float32", "full", SPECULATIVE)
    with FileLock(str(graph_cache_dir) + ".lock"):
        again = Compiler(config, tmp_path / "again", graph_cache_dir).run()
    assert not again.failed and again.compiled == []
    assert len(again.outcomes) == 12 and all(o.cached for o in again.outcomes)
    assert graph_records(tmp_path / "again") == graph_records(first)


def test_nb_verify_stablehlo_checks_the_artifact_and_refuses_another_backend(
    artifacts, hf_model_dir, tmp_path
):
    from typer.testing import CliRunner

    from neuron_buckets.cli import app

    directory, _, _ = artifacts("float32", "full", SPECULATIVE)
    result = CliRunner().invoke(app, ["verify", "--stablehlo", "--trials", "1", str(directory)])
    assert result.exit_code == 0, result.output
    assert result.output.count(" ok ") == 4, result.output
    eager = write_config(tmp_path, hf_model_dir, FULL.replace('"stablehlo"', '"eager"'))
    assert CliRunner().invoke(app, ["compile", str(eager), "--out", str(tmp_path / "e"),
                                    "--cache-dir", str(tmp_path / "c")]).exit_code == 0
    refused = CliRunner().invoke(app, ["verify", "--stablehlo", str(tmp_path / "e")])
    assert refused.exit_code == 2
    assert "needs an artifact of backend stablehlo, this one's is eager" in " ".join(refused.output.split())


def test_greedy_generation_through_iree_pieces_equals_transformers(artifacts, hf_model_dir):
    from neuron_buckets.runtime.bucket_runtime import BucketRuntime
    from tests.test_engine import greedy

    directory, _, _ = artifacts("float32", "full", SPECULATIVE)
    runtime = BucketRuntime.open(directory)
    runtime.k_cache.fill_(float("nan"))
    runtime.v_cache.fill_(float("nan"))
    prompts, want = transformers_greedy(hf_model_dir)
    assert_same_tokens(greedy(runtime, prompts, 8), want, total=2 * 8)


MLIR_TYPES = {torch.int8: "i8", torch.float8_e4m3fn: "f8E4M3FN", torch.float32: "f32"}


@pytest.mark.parametrize("name", ["w8a16-int8-channel", "w8a16-fp8-tensor", "w8a16-fp8-channel"])
def test_a_quantized_layer_takes_its_stored_weights_and_scales_as_arguments_and_runs_as_eager(name):
    """The W8A16 layer piece lowered with random int8 or float8 weights as the checkpoint stores
    them: each projection's weight an argument of its stored type and its scales float32
    arguments; run by IREE over a NaN-poisoned cache, it writes and returns what the eager layer
    (torch's CPU int8 kernel, float8 widened) does, within float32's ``nb verify`` tolerance."""
    from dataclasses import replace

    from neuron_buckets.backends.stablehlo_lowering import FunctionalLayer, IreeModule, lower
    from neuron_buckets.kernels import dispatch
    from neuron_buckets.model.checkpoint import DEFAULT_CONFIG
    from neuron_buckets.model.pieces import PieceShape, build_piece, example_inputs
    from neuron_buckets.model.quant.quant_scheme import QuantScheme
    from neuron_buckets.runtime.verify import TOLERANCE, relative_diff
    from tests.conftest import random_layer

    stored, strategy = name.split("-")[1:]
    scheme = QuantScheme("int8" if stored == "int8" else "float8_e4m3fn", strategy, "none")
    config, gen = replace(DEFAULT_CONFIG, quantization=scheme), torch.Generator().manual_seed(3)
    shape = PieceShape("layer", 16, rows=1, ctx=128, packed=True)
    example = example_inputs(shape, config, 8, 64, torch.float32)
    *step, k_cache, v_cache, _ = example
    weights = random_layer(config, gen).tensors()
    h, cos, sin = (torch.randn(t.shape, generator=gen) for t in step[:3])
    table = torch.full_like(step[4], -1)
    table[0, :2] = torch.tensor([5, 9])  # 16 fresh tokens into blocks 5 and 9
    slots = torch.cat([torch.arange(40, 48), torch.arange(72, 80)])
    poisoned = torch.full_like(k_cache, float("nan"))
    args = (h, cos, sin, slots, table, torch.tensor([0]), step[6], poisoned, poisoned.clone(), *weights)

    lowering = lower(build_piece("layer", config), (*step, k_cache, v_cache, weights))
    got_types = [a.rsplit("x", 1)[-1].rstrip(">") for a in lowering.summary["arguments"][-len(weights):]]
    assert got_types == [MLIR_TYPES[w.dtype] for w in weights]
    assert MLIR_TYPES[weights[1].dtype] == ("i8" if stored == "int8" else "f8E4M3FN")  # qkv as stored
    got = IreeModule(lowering.bytecode)(*args)
    with torch.no_grad(), dispatch.use(dispatch.GOLDEN):
        want = FunctionalLayer(build_piece("layer", config))(*args)
    assert len(got) == len(want) == 3 and not got[0].isnan().any()
    assert (~want[1].isnan()).sum() == 16 * config.num_kv_heads * config.head_dim  # 16 tokens written
    for mine, theirs in zip(got, want, strict=True):
        assert relative_diff(mine, theirs) <= TOLERANCE["float32"]


def test_nb_compile_for_neuron_without_the_sdk_writes_the_stablehlo_then_says_neffs_need_it(
    artifacts, hf_model_dir, graph_cache_dir, tmp_path
):
    """No Neuron SDK here: ``nb compile --backend neuron`` lowers every piece to StableHLO under the
    same keys as ``--backend stablehlo`` (so all of them come from the graph cache), records the
    neuronx-cc command lines, then ends with one error line: the NEFFs need the SDK."""
    from typer.testing import CliRunner

    from neuron_buckets.artifact.manifest import read_manifest
    from neuron_buckets.backends import get_backend
    from neuron_buckets.cli import app

    if get_backend("neuron").available()[0]:
        pytest.skip("the Neuron SDK is installed here; this checks the route without it")
    first, _, _ = artifacts("float32", "full", SPECULATIVE)
    grid_config(tmp_path, hf_model_dir, "float32", "full", SPECULATIVE)  # writes nb.toml there
    args = ["compile", str(tmp_path / "nb.toml"), "--backend", "neuron", "--out", str(tmp_path / "art"),
            "--cache-dir", str(graph_cache_dir)]
    with FileLock(str(graph_cache_dir) + ".lock"):
        result = CliRunner().invoke(app, args)
    said = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "compiled 0, reused 12, failed 0" in said
    assert said.endswith(f"nb verify --stablehlo {tmp_path / 'art'} runs them on this CPU)")
    assert "error: NEFFs need the Neuron SDK (neuronx-cc), absent here" in said
    assert read_manifest(tmp_path / "art").backend.name == "stablehlo"
    assert graph_records(tmp_path / "art") == graph_records(first)


def test_a_tensor_parallel_layer_is_refused_in_one_line_naming_the_collectives(hf_model_dir):
    """What the TP=2 layer meets on this route: torch-mlir has no StableHLO lowering of torch's
    functional collectives, and the lowering says so in one line instead of torch-mlir's dump."""
    from neuron_buckets.backends.stablehlo_lowering import lower
    from neuron_buckets.model.checkpoint import read_config
    from neuron_buckets.model.pieces import PieceShape, build_piece, example_inputs
    from neuron_buckets.model.tp.tensor_parallel import TensorParallel

    config, tp = read_config(hf_model_dir), TensorParallel(2)
    example = example_inputs(PieceShape("layer", 16, rows=2, ctx=128, packed=True), tp.local(config), 8, 64,
                             torch.float32)
    with tp.tracing(), pytest.raises(ValueError) as refused:
        lower(build_piece("layer", config, tp), example)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("LayerPiece at tensor_parallel_size 2: torch-mlir ")
    assert "no StableHLO lowering of torch's functional collectives" in message

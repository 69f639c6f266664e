"""Neuron's torch-mlir route on this CPU: every piece lowered to StableHLO, compiled by IREE for the
CPU, and run against the eager model over NaN-poisoned caches.

The grids are the tiny two-layer model's: in float32 all four buckets (prefill of 16 and 32
tokens packing two requests, decode of one and two rows), with and without two speculative
positions; in bfloat16 and float16 one prefill and one decode bucket of two rows, with and without
speculation (the pieces are the same code at other shapes; each IREE compile takes seconds).
Artifacts are built by ``nb compile``'s compiler once per module and share one graph cache.
At TP=2 the pieces lower with StableHLO collectives (checked by parsing the module with MLIR's
Python bindings), which IREE compiles for the CPU but cannot run there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
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
TP2 = "\n[parallel]\ntensor_parallel_size = 2\n"
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

GRID_IDS = [f"{d}-{g}-{'speculative' if s else 'default'}" for d, g, s in GRIDS]
MLIR_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def grid_config(root: Path, model_dir: Path, dtype: str, grid: str, speculation: str) -> Config:
    text = {"full": FULL, "small": SMALL, "tp2": SMALL + TP2}[grid].replace(
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


@pytest.mark.parametrize(("dtype", "grid", "speculation"), list(GRIDS), ids=GRID_IDS)
def test_every_piece_is_stablehlo_with_every_input_an_argument(artifacts, dtype, grid, speculation):
    """Each piece's StableHLO, in each dtype, takes every input (weights and caches included) as a
    function argument of the input's shape, in order: nothing is folded into a constant. The layer
    returns its output and both cache slices, of the caches' type and dtype; the record says how
    neuronx-cc would compile it, and the manifest keys torch-mlir and its decompositions."""
    from neuron_buckets.artifact.manifest import read_manifest

    directory, _, _ = artifacts(dtype, grid, speculation)
    records = graph_records(directory)
    # embed, layer and head of each bucket's token count (the full speculative grid: 3, 6, 16, 32)
    assert len(records) == 3 * len(GRIDS[dtype, grid, speculation])
    for name, r in records.items():
        s = r["summary"]
        assert len(s["arguments"]) == len(r["input_shapes"]) == len(s["input_shapes"]), name
        for arg, shape in zip(s["arguments"], r["input_shapes"], strict=True):
            assert dims(arg) == shape, (name, arg, shape)
        if r["piece"] == "LayerPiece":
            k_cache = s["arguments"][7]
            assert s["results"][1:] == [k_cache, k_cache] and s["arguments"][8] == k_cache, name
            assert k_cache.endswith(f"x{MLIR_DTYPES[dtype]}>"), (name, k_cache)
            assert len(s["arguments"]) == 9 + 6  # the step and caches, then two norms, qkv, o, gate_up, down
        cmd = r["neuronx_cc"]
        assert cmd[:2] == ["neuronx-cc", "compile"] and cmd[2].endswith(".mlirbc")
        assert cmd[-2:] == ["--output", cmd[2].replace(".mlirbc", ".neff")], name
        assert cmd[cmd.index("--target") + 1] == "trn1", name
    assert sorted({r["piece"] for r in records.values()}) == ["EmbedPiece", "HeadPiece", "LayerPiece"]
    versions = read_manifest(directory).backend.versions
    assert versions["torch-mlir"] != "not installed" and len(versions["torch-mlir-decompositions"]) == 16


@pytest.mark.parametrize(("dtype", "grid", "speculation"), list(GRIDS), ids=GRID_IDS)
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


def scheme_of(name: str):
    """The quantization a test name says: ``w8a16-int8-channel`` (weights int8 per channel,
    activations as they are), ``w8a8-fp8-tensor`` (float8 weights and activations per tensor)."""
    from neuron_buckets.model.quant.quant_scheme import QuantScheme

    kind, stored, strategy = name.split("-")
    activations = {"w8a8-int8": "int8_token", "w8a8-fp8": "float8_tensor"}.get(f"{kind}-{stored}", "none")
    return QuantScheme("int8" if stored == "int8" else "float8_e4m3fn", strategy, activations)


@pytest.mark.parametrize("name", ["w8a16-int8-channel", "w8a8-int8-channel", "w8a16-fp8-tensor",
                                  "w8a16-fp8-channel", "w8a8-fp8-tensor"])
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
    from neuron_buckets.runtime.verify import TOLERANCE, relative_diff
    from tests.conftest import random_layer

    config, gen = replace(DEFAULT_CONFIG, quantization=scheme_of(name)), torch.Generator().manual_seed(3)
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
    assert MLIR_TYPES[weights[1].dtype] == ("i8" if "int8" in name else "f8E4M3FN")  # qkv as stored
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


def collectives_of(bytecode: bytes) -> tuple[dict[str, int], list[tuple[str, list, list[str]]]]:
    """The module's replica and partition counts, and each collective's op, replica groups and the
    ops of its reduction region (none for a gather): the bytecode parsed by MLIR's Python bindings."""
    from torch_mlir import ir
    from torch_mlir._mlir_libs import _stablehlo

    context = ir.Context()
    _stablehlo.register_dialect(context)
    found: list[tuple[str, list, list[str]]] = []

    def visit(op) -> object:
        if op.name in ("stablehlo.all_reduce", "stablehlo.all_gather"):
            groups = np.array(ir.DenseIntElementsAttr(op.attributes["replica_groups"])).tolist()
            region = [o.name for r in op.regions for b in r.blocks for o in b.operations]
            found.append((op.name, groups, region))
        return ir.WalkResult.ADVANCE

    with context:
        module = ir.Module.parse(bytecode)
        module.operation.walk(visit)
        attributes = module.operation.attributes
        counts = {k: ir.IntegerAttr(attributes[k]).value
                  for k in ("mhlo.num_replicas", "mhlo.num_partitions") if k in attributes}
    return counts, found


REDUCE = ("stablehlo.all_reduce", [[0, 1]], ["stablehlo.add", "stablehlo.return"])
GATHER = ("stablehlo.all_gather", [[0, 1]], [])
# piece (and quantization) -> its collectives at TP=2: the embedding's vocabulary rows summed, the
# attention's o and the MLP's down projection summed, the head's logits gathered
TP_PIECES = {"embed": [REDUCE], "layer": [REDUCE, REDUCE], "head": [GATHER],
             "layer-w8a16-int8-channel": [REDUCE, REDUCE], "layer-w8a16-fp8-tensor": [REDUCE, REDUCE]}


def tp2_lowering(name: str, dtype: torch.dtype = torch.float32):
    """The TP=2 piece ``name`` of the default model lowered, at 16 tokens."""
    from dataclasses import replace

    from neuron_buckets.backends.stablehlo_lowering import lower
    from neuron_buckets.model.checkpoint import DEFAULT_CONFIG
    from neuron_buckets.model.pieces import PieceShape, build_piece, example_inputs
    from neuron_buckets.model.tp.tensor_parallel import TensorParallel

    role, _, quantized = name.partition("-")
    config, tp = DEFAULT_CONFIG, TensorParallel(2)
    if quantized:
        config = replace(config, quantization=scheme_of(quantized))
    shape = PieceShape(role, 16, rows=2, ctx=128, packed=True) if role == "layer" else PieceShape(role, 16)
    example = example_inputs(shape, tp.local(config), 8, 64, dtype)
    with tp.tracing():
        return lower(build_piece(role, config, tp), example)


@pytest.mark.parametrize("name", list(TP_PIECES))
def test_a_tensor_parallel_piece_lowers_with_stablehlo_collectives_over_both_replicas(name):
    """At TP=2 each piece's all-reduces and all-gather are StableHLO collectives with one replica
    group of both ranks, [[0, 1]], the all-reduce summing (its region adds), in a module of two
    replicas and one partition; the summary counts them too."""
    lowering = tp2_lowering(name)
    counts, found = collectives_of(lowering.bytecode)
    assert counts == {"mhlo.num_replicas": 2, "mhlo.num_partitions": 1}
    assert found == TP_PIECES[name]
    ops = lowering.summary["ops"]
    assert (ops.get("all_reduce", 0), ops.get("all_gather", 0)) == (
        TP_PIECES[name].count(REDUCE), TP_PIECES[name].count(GATHER))


def test_a_single_rank_piece_has_no_collectives_and_no_replica_count():
    """The same importer at TP=1: the module is the single-rank one, with no collective to count."""
    from neuron_buckets.backends.stablehlo_lowering import lower
    from neuron_buckets.model.checkpoint import DEFAULT_CONFIG
    from neuron_buckets.model.pieces import PieceShape, build_piece, example_inputs

    example = example_inputs(PieceShape("head", 16), DEFAULT_CONFIG, 8, 64, torch.float32)
    lowering = lower(build_piece("head", DEFAULT_CONFIG), example)
    assert collectives_of(lowering.bytecode) == ({}, [])
    assert not {"all_reduce", "all_gather"} & set(lowering.summary["ops"])


def test_nb_compile_at_tp2_stores_each_piece_under_its_content_key_with_its_collectives(
    artifacts, graph_cache_dir, tmp_path
):
    """``nb compile --backend stablehlo`` of a TP=2 config: every piece is stored under its own
    content key (the degree in the key, so none is TP=1's), each with its collectives over [[0, 1]];
    compiling again lowers nothing and writes the same bytes."""
    from neuron_buckets.artifact.manifest import read_manifest
    from neuron_buckets.backends.stablehlo import StableHloBackend, stablehlo_of
    from neuron_buckets.compile.compiler import Compiler

    directory, _, config = artifacts("float32", "tp2", "")
    single, _, _ = artifacts("float32", "full", "")  # its prefill_s16 and decode_b2 pieces at TP=1
    pieces = read_manifest(directory).pieces.values()
    assert len(pieces) == 6  # embed, layer and head of 2 (decode) and 16 tokens
    assert not {r.file for r in pieces} & {r.file for r in read_manifest(single).pieces.values()}
    for r in pieces:
        counts, found = collectives_of(stablehlo_of(directory / r.file))
        assert counts == {"mhlo.num_replicas": 2, "mhlo.num_partitions": 1}, r.name
        assert found == TP_PIECES[r.role], r.name
        assert json.loads((directory / r.file).read_text())["tensor_parallel_size"] == 2
        with pytest.raises(ValueError, match=r"a tensor-parallel piece \(degree 2\); IREE's CPU drivers"):
            StableHloBackend().load(directory / r.file, {}, "cpu")  # one line, before IREE's failure
    with FileLock(str(graph_cache_dir) + ".lock"):
        again = Compiler(config, tmp_path / "again", graph_cache_dir).run()
    assert not again.failed and again.compiled == [] and all(o.cached for o in again.outcomes)
    assert graph_records(tmp_path / "again") == graph_records(directory)


def test_iree_compiles_the_tp2_piece_for_the_cpu_but_runs_no_collective_there():
    """IREE lowers the StableHLO collectives for its llvm-cpu target, but its CPU drivers (local-task,
    local-sync) create no collective channel: the call fails where the first collective needs one,
    so TP=2 is not run against TP=1 here."""
    from neuron_buckets.backends.stablehlo_lowering import IreeModule

    lowering = tp2_lowering("head")
    module = IreeModule(lowering.bytecode)  # compiled, loaded
    args = [torch.zeros(dims(a), dtype=torch.float32) for a in lowering.summary["arguments"]]
    args[1] = torch.tensor([0, 3, 7, 15])  # the last token of each of four rows
    with pytest.raises(NotImplementedError) as refused:
        module(*args)
    said = str(refused.value)
    assert "local_task/task_device.c" in said
    assert ("UNIMPLEMENTED; collectives not implemented; while invoking native function "
            "hal.channel.create") in said


def test_the_nki_kernels_torch_glue_lowers_to_stablehlo_and_runs_on_iree_as_eager():
    """What of the NKI path runs here, on this route too: the torch glue around the attention
    kernel's call, lowered to StableHLO and run by IREE, equal to eager bit for bit."""
    from neuron_buckets.backends.stablehlo_lowering import IreeModule, lower
    from tests.kernel_glue import KernelGlue, glue_args

    args = glue_args()
    want = KernelGlue()(*args)
    lowering = lower(KernelGlue(), args)
    assert lowering.summary["results"] == [
        "tensor<2x2x6x16xf32>", "tensor<2x2x3x16xf32>", "tensor<2x2x3x16xf32>", "tensor<2x128x1xi32>",
        "tensor<2x2x6x128xui8>", "tensor<2x2x6x3xui8>",
    ]  # fmt: skip
    got = IreeModule(lowering.bytecode)(*args)
    assert len(got) == len(want) == 6
    for mine, theirs in zip(got, want, strict=True):
        assert torch.equal(mine, theirs)

"""The Neuron path as far as torch-xla runs it: every piece of a two-layer Neuron grid lowered, then
executed on XLA's CPU device against the eager model and transformers.

Runs only where torch-xla 2.9 imports (``make test-xla`` builds that virtualenv; the main one has
none). The grid is the tiny two-layer model's: prefill buckets of 16 and 32 tokens for one or two
packed requests, decode buckets of one and two rows of 1 + 2 speculative positions, in every
cache dtype. ``nb compile --backend xla`` lowers each piece as the Neuron backend traces it (the
stacked-cache layer, the layer index an input) with the goldens in place of the NKI kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from neuron_buckets.config import DTYPES, Config, load_config
from neuron_buckets.core.padding import pad_decode, pad_prefill
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from tests.conftest import TINY_CONFIG, random_layer, segment, transformers_greedy, write_config
from tests.steps_compared import assert_same_tokens

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla", reason="needs torch-xla 2.9: make test-xla runs these")

XLA_CONFIG = TINY_CONFIG.replace('"inductor"', '"xla"').replace(
    "num_batched_tokens_buckets = [16, 32]", "num_batched_tokens_buckets = [16, 32]\nspeculation_length = 2"
).replace("max_model_len = 128", 'max_model_len = 128\ndtype = "DTYPE"')
ATOL = 2e-5  # float32, times the largest |logit| (the README's tolerance for float32)


def xla_config(root: Path, model_dir: Path, backend: str, dtype: str) -> Config:
    text = XLA_CONFIG.replace("DTYPE", dtype).replace('"xla"', f'"{backend}"')
    return load_config(write_config(root, model_dir, text))


@pytest.fixture(scope="module")
def artifacts(hf_model_dir, graph_cache_dir, tmp_path_factory):
    """(backend, dtype) -> the tiny model's artifact, compiled by ``nb compile``'s compiler once
    per module."""
    from neuron_buckets.compile.compiler import Compiler

    made: dict[tuple[str, str], Path] = {}

    def get(backend: str, dtype: str) -> Path:
        if (backend, dtype) not in made:
            root = tmp_path_factory.mktemp(f"{backend}-{dtype}")
            graph_cache_dir.mkdir(parents=True, exist_ok=True)
            with FileLock(str(graph_cache_dir) + ".lock"):
                config = xla_config(root, hf_model_dir, backend, dtype)
                report = Compiler(config, root / "art", graph_cache_dir).run()
            assert not report.failed, [o.error for o in report.failed]
            made[backend, dtype] = root / "art"
        return made[backend, dtype]

    return get


def grid_graphs(config: Config, out: Path) -> dict[str, dict]:
    """Every piece of ``config``'s grid compiled by the xla backend in this process, by piece name:
    what ``nb compile``'s workers run for each, without a worker's start-up per dtype."""
    from neuron_buckets.backends import get_backend
    from neuron_buckets.config import enumerate_grid
    from neuron_buckets.model.model_source import model_config_of
    from neuron_buckets.model.pieces import PIECES, bucket_pieces, example_inputs

    backend, model = get_backend("xla"), model_config_of(config.model.path)
    c = config.cache
    decode_seq = 1 + config.buckets.speculation_length  # a packed head returns a decode row's logits
    pieces = (bucket_pieces(b, backend.dynamic_shapes, decode_seq) for b in enumerate_grid(config))
    shapes = {s for p in pieces for s in p.values()}
    for s in shapes:
        example = example_inputs(s, model, c.block_size, c.num_blocks, getattr(torch, c.dtype))
        backend.compile(PIECES[s.role](model), example, out / f"{s.name}.json", {}, None)
    return {s.name: json.loads((out / f"{s.name}.json").read_text()) for s in shapes}


def walks_to(instructions: dict[str, dict], start: str, target: str) -> bool:
    """Whether instruction ``start`` depends on instruction ``target`` in the entry computation."""
    seen, todo = set(), [start]
    while todo:
        i = todo.pop()
        if i == target:
            return True
        if i not in seen:
            seen.add(i)
            todo.extend(instructions[i].get("operandIds", []))
    return False


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_piece_lowers_to_one_static_graph_with_aliased_cache(dtype, hf_model_dir, tmp_path):
    from neuron_buckets.backends.xla_lowering import entry_computation
    from neuron_buckets.config import enumerate_grid

    config = xla_config(tmp_path, hf_model_dir, "xla", dtype)
    names = [b.name for b in enumerate_grid(config)]  # prefill buckets pack two requests
    assert names == ["prefill_s16", "prefill_s32", "decode_b1_s3_c128", "decode_b2_s3_c128"]
    graphs = grid_graphs(config, tmp_path)
    assert len(graphs) == 12  # embed, layer and head of each token count: 3, 6 (decode), 16, 32
    roles = []
    for name, graph in graphs.items():
        s = graph["summary"]
        assert (s["graphs"], s["host_fallbacks"], s["static"]) == (1, [], True), name
        assert -1 not in s["inputs"], f"{name}: an input the graph ignores"
        for shape, param in zip(s["input_shapes"], s["inputs"], strict=True):
            assert s["parameters"][param].endswith(f"[{','.join(map(str, shape))}]"), name
        roles.append(graph["piece"])
        if graph["piece"] != "LayerPiece":
            assert s["aliases"] == {}
            continue
        k, v = s["aliases"]["1"], s["aliases"]["2"]
        assert s["outputs"][1] == s["parameters"][k] == s["parameters"][v] != s["outputs"][0]
        declared = {(e["outputShapeIndex"][0], e["parameterNumber"], e["kind"])
                    for e in graph["hlo"]["inputOutputAlias"]["entries"]}
        assert declared == {("1", str(k), "MUST_ALIAS"), ("2", str(v), "MUST_ALIAS")}
        entry = entry_computation(graph["hlo"])
        by_id = {i["id"]: i for i in entry["instructions"]}
        params = {i.get("parameterNumber", "0"): i["id"] for i in by_id.values()
                  if i["opcode"] == "parameter"}
        root = by_id[entry["rootId"]]
        assert root["opcode"] == "tuple"
        # each cache output is the scatter of its own cache parameter, not of the other's
        for out, param, other in ((1, k, v), (2, v, k)):
            assert walks_to(by_id, root["operandIds"][out], params[str(param)])
            assert not walks_to(by_id, root["operandIds"][out], params[str(other)])
    assert sorted(set(roles)) == ["EmbedPiece", "HeadPiece", "LayerPiece"]


@pytest.fixture
def runtimes(artifacts) -> tuple[Path, Path]:
    return artifacts("xla", "float32"), artifacts("eager", "float32")


def test_nb_compile_writes_every_piece_as_lowered(runtimes, hf_model_dir, tmp_path):
    from neuron_buckets.artifact.manifest import read_manifest

    directory = runtimes[0]
    want = grid_graphs(xla_config(tmp_path, hf_model_dir, "xla", "float32"), tmp_path)
    pieces = read_manifest(directory).pieces.values()
    got = {r.name: json.loads((directory / r.file).read_text()) for r in pieces}
    assert {n: g["summary"] for n, g in got.items()} == {n: g["summary"] for n, g in want.items()}


def poisoned(directory: Path) -> BucketRuntime:
    runtime = BucketRuntime.open(directory)
    runtime.k_cache.fill_(float("nan"))
    runtime.v_cache.fill_(float("nan"))
    return runtime


def test_every_bucket_on_xla_cpu_agrees_with_eager_over_a_nan_cache(runtimes):
    """Prefill (one request; two packed, the first continuing its cached prompt), then decode rows
    of 1 + 2 speculative positions: logits and every cache byte as the eager model's; NaN stays
    where nothing was written, and nothing unwritten reaches a logit."""
    from torch_xla.debug import metrics

    xla, eager = (poisoned(d) for d in runtimes)
    gen = torch.Generator().manual_seed(0)
    prompt = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (20, 9)]
    blocks = [[1, 2, 3, 4, 5], [9, 10, 11]]
    steps = []
    for b in sorted(xla.records, key=lambda b: (b.kind == "decode", b.seq, b.batch)):
        if b.kind == "prefill" and b.seq == 16:  # one request
            chunk = [segment(prompt[0][:8], 0, blocks[0])]
            steps.append((b, pad_prefill(chunk, b, 8, xla.buckets.samples(b))))
        elif b.kind == "prefill":  # two requests packed; the first continues its cached start
            chunks = [segment(prompt[0][8:20], 8, blocks[0]), segment(prompt[1], 0, blocks[1])]
            steps.append((b, pad_prefill(chunks, b, 8, xla.buckets.samples(b))))
        else:  # 1 + 2 speculative positions per row
            rows = [segment([5, 6, 7], 20, blocks[0]), segment([8, 9, 1], 9, blocks[1])][: b.batch]
            steps.append((b, pad_decode(rows, b, 8)))
    names = ["prefill_s16", "prefill_s32", "decode_b1_s3_c128", "decode_b2_s3_c128"]
    assert [b.name for b, _ in steps] == names
    metrics.clear_all()
    for bucket, step in steps:
        want = eager.run(bucket, step)
        got = xla.run(bucket, step)
        assert not got.isnan().any(), bucket.name
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL * float(want.abs().max()), msg=bucket.name)
        for mine, theirs in ((xla.k_cache, eager.k_cache), (xla.v_cache, eager.v_cache)):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5, equal_nan=True, msg=bucket.name)
    assert xla.k_cache.isnan().any() and not xla.k_cache[:, blocks[1]].isnan().all()
    # one XLA compile per piece graph: both layers run one layer graph, no shape changed between calls
    pieces = {key for b, _ in steps for key in xla.record(b).pieces.values()}
    assert metrics.counter_value("UncachedCompile") == len(pieces)


def test_greedy_generation_through_xla_pieces_equals_transformers(runtimes, hf_model_dir):
    from tests.test_engine import greedy

    prompts, want = transformers_greedy(hf_model_dir)
    assert_same_tokens(greedy(poisoned(runtimes[0]), prompts, 8), want, total=2 * 8)


def test_the_nki_kernels_torch_glue_lowers_to_one_static_graph_and_runs_as_on_cpu():
    """What of the NKI path runs here: its torch glue, lowered and executed on XLA:CPU. The kernels
    themselves need the nki package (absent: see the README's Neuron section)."""
    from neuron_buckets.backends.neuron import TraceSpec
    from neuron_buckets.backends.xla import XlaGraph
    from neuron_buckets.backends.xla_lowering import lower
    from tests.kernel_glue import KernelGlue, glue_args

    args = glue_args()
    want = KernelGlue()(*args)
    lowering = lower(TraceSpec(KernelGlue(), args, {}))
    assert lowering.problems == []
    assert lowering.summary["outputs"] == [
        "f32[2,2,6,16]", "f32[2,2,3,16]", "f32[2,2,3,16]", "s32[2,128,1]", "u8[2,2,6,128]", "u8[2,2,6,3]",
    ]  # fmt: skip
    for got, expected in zip(XlaGraph(KernelGlue())(*args), want, strict=True):
        assert torch.equal(got, expected)


def test_a_tensor_parallel_layer_lowers_to_one_graph_with_its_two_all_reduces(hf_model_dir, tmp_path):
    """At TP=2 the layer piece (one rank's heads and MLP features) stays one static graph, no host
    fallback, with the all-reduces after o and down as XLA collectives over every replica."""
    from neuron_buckets.backends import get_backend
    from neuron_buckets.backends.xla_lowering import entry_computation
    from neuron_buckets.model.checkpoint import read_config
    from neuron_buckets.model.pieces import PieceShape, build_piece, example_inputs
    from neuron_buckets.model.tp.tensor_parallel import TensorParallel

    config, tp = read_config(hf_model_dir), TensorParallel(2)
    shape = PieceShape("layer", 16, rows=2, ctx=128, packed=True)
    example = example_inputs(shape, tp.local(config), 8, 64, torch.float32)
    with tp.tracing():
        get_backend("xla").compile(build_piece("layer", config, tp), example, tmp_path / "l.json", {}, None)
    graph = json.loads((tmp_path / "l.json").read_text())
    s = graph["summary"]
    assert (s["graphs"], s["host_fallbacks"], s["static"]) == (1, [], True)
    assert graph["tensor_parallel_size"] == 2 and s["ops"]["all-reduce"] == 2
    reduces = [i for i in entry_computation(graph["hlo"])["instructions"] if i["opcode"] == "all-reduce"]
    assert all(not i.get("replicaGroups") for i in reduces)  # every rank takes part
    assert f"f32[16,{config.hidden_size}]" in s["outputs"]  # the whole hidden state, summed


QUANTIZED = ["w8a16-int8-channel", "w8a8-int8-channel", "w8a16-fp8-tensor", "w8a16-fp8-channel",
             "w8a8-fp8-tensor"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_quantized_layer_lowers_to_one_graph_taking_its_stored_weights_and_scales_and_runs_as_on_cpu(name):
    """Each quantized scheme's layer piece, traced as a compile worker traces it for the Neuron
    backend (its example layer: float8 widened, as a CPU runtime holds it): one static graph, no
    host fallback (torch's int8 CPU kernels are replaced by convert, dot and multiply), each
    projection's weight in its stored int8 or float8 and its float32 scales as parameters of the
    graph (nothing folded into a constant); and on XLA:CPU, with random weights, the eager layer's
    output."""
    from dataclasses import replace

    from neuron_buckets.backends.neuron import trace_spec
    from neuron_buckets.backends.xla import XlaGraph
    from neuron_buckets.backends.xla_lowering import lower
    from neuron_buckets.kernels import dispatch
    from neuron_buckets.model.checkpoint import DEFAULT_CONFIG
    from neuron_buckets.model.pieces import PieceShape, build_piece, example_inputs
    from neuron_buckets.model.quant.quant_scheme import QuantScheme

    stored, strategy = name.split("-")[1:]
    activations = {"w8a8-int8": "int8_token", "w8a8-fp8": "float8_tensor"}.get(name.rsplit("-", 1)[0], "none")
    scheme = QuantScheme("int8" if stored == "int8" else "float8_e4m3fn", strategy, activations)
    config, gen = replace(DEFAULT_CONFIG, quantization=scheme), torch.Generator().manual_seed(3)
    shape = PieceShape("layer", 16, rows=1, ctx=128, packed=True)
    example = example_inputs(shape, config, 8, 64, torch.float32)
    lowering = lower(trace_spec(build_piece("layer", config), example))
    s = lowering.summary
    assert lowering.problems == [] and s["graphs"] == 1 and s["host_fallbacks"] == []
    layer = random_layer(config, gen)  # as the checkpoint stores it
    hlo_types = {torch.int8: "s8", torch.float8_e4m3fn: "f8e4m3fn", torch.float32: "f32"}
    params = s["inputs"][-len(layer.tensors()):]  # norms, then each projection's data and scales
    assert [s["parameters"][p].split("[")[0] for p in params] == [hlo_types[t.dtype] for t in layer.tensors()]
    assert hlo_types[layer.qkv.data.dtype] == ("s8" if stored == "int8" else "f8e4m3fn")
    assert -1 not in s["inputs"]  # every weight and scale is read from its parameter
    assert s["ops"]["dot"] >= 4  # each projection one dot

    *step, k_cache, v_cache, _ = example
    h, cos, sin = (torch.randn(t.shape, generator=gen) for t in step[:3])
    inputs = (h, cos, sin, *step[3:], k_cache, v_cache, layer.tensors())
    spec = trace_spec(build_piece("layer", config), inputs)
    with torch.no_grad(), dispatch.use(dispatch.GOLDEN):
        want = spec.module(*spec.inputs)[0]
    got = XlaGraph(trace_spec(build_piece("layer", config), example).module)(*spec.inputs)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL * float(want.abs().max()))

"""BucketRuntime over the session artifact (prefill 16/32 packing up to 2 requests, decode batch 1/2,
blocks of 8, 64 blocks), whose buckets run six pieces: a shared embed and head, a layer each.

Logits are checked against transformers' own forward of the same checkpoint. Every test that
damages the artifact works on a copy, so the session artifact stays intact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_buckets.artifact.manifest import ManifestError, read_manifest
from neuron_buckets.core.bucket import Bucket, NoBucketFits
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.runtime.bucket_runtime import ArtifactError, BucketRuntime
from neuron_buckets.utils.files import sha256_file
from tests.conftest import decode_plan, prefill_plan

pytestmark = pytest.mark.slow  # every test needs the compiled session artifact


@pytest.fixture(scope="module")
def hf_model(hf_model_dir: Path):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(hf_model_dir).eval()


def hf_last_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks(first: int, n_tokens: int, block_size: int = 8) -> list[int]:
    return list(range(first, first + -(-n_tokens // block_size)))


@pytest.fixture
def artifact_copy(compiled_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(compiled_dir, tmp_path / "artifact"))


def piece_keys(runtime: BucketRuntime, bucket: Bucket, layer: str = "layer") -> list[str]:
    pieces = runtime.records[bucket].pieces
    return [pieces[role] for role in ("embed", layer, "head")]


def test_open_loads_no_graph_first_use_loads_its_pieces_preload_loads_all(compiled_dir):
    runtime = BucketRuntime.open(compiled_dir)
    assert runtime.loaded == []

    runtime.run_plan(prefill_plan([(tokens(10, 0), 0, [1, 2])]))
    prefill_16 = piece_keys(runtime, Bucket("prefill", 2, 16, 128), "fresh_layer")
    assert runtime.loaded == prefill_16  # embed, the bucket's layer over no context (nothing cached), head

    runtime.run_plan(prefill_plan([(tokens(4, 1), 10, [1, 2])]))  # a continuing chunk reads a context
    with_context = piece_keys(runtime, Bucket("prefill", 2, 16, 128))[1]
    assert runtime.loaded == [*prefill_16, with_context]

    runtime.run_plan(decode_plan([([7], 14, [1, 2])]))  # another bucket: only its layer piece is new
    decode_1 = piece_keys(runtime, Bucket("decode", 1, 1, 128))
    assert (decode_1[0], decode_1[2]) == (prefill_16[0], prefill_16[2])  # the shared embed and head
    assert runtime.loaded == [*prefill_16, with_context, decode_1[1]]

    warm = BucketRuntime.open(compiled_dir, preload=True)
    assert sorted(warm.loaded) == sorted(warm.manifest.pieces) and len(warm.loaded) == 8
    names = sorted(warm.manifest.pieces[k].name for k in warm.loaded)
    assert names == sorted(
        ["embed", "head", "layer_t16_b2_c128_packed", "layer_t32_b2_c128_packed", "layer_t16_b2_c0_packed",
         "layer_t32_b2_c0_packed", "layer_t1_b1_c128", "layer_t2_b2_c128"]
    )


def test_stats_count_calls_real_and_padded_tokens_per_bucket(compiled_dir):
    runtime = BucketRuntime.open(compiled_dir)
    assert set(runtime.stats) == {"prefill_s16", "prefill_s32", "decode_b1_c128", "decode_b2_c128"}

    # 10 + 20 tokens pack into one call of the 32-token bucket; 10 alone take the 16-token one
    runtime.run_plan(prefill_plan([(tokens(10, 0), 0, [1, 2]), (tokens(20, 1), 0, [3, 4, 5])]))
    runtime.run_plan(prefill_plan([(tokens(10, 2), 0, [6, 7])]))
    runtime.run_plan(decode_plan([([7], 10, [1, 2])]))

    def counters(label: str) -> tuple[int, int, int]:
        s = runtime.stats[label]
        return s.calls, s.real_tokens, s.padded_tokens

    assert counters("prefill_s32") == (1, 30, 32)  # padded = every position computed
    assert counters("prefill_s16") == (1, 10, 16)
    assert counters("decode_b1_c128") == (1, 1, 1)
    assert runtime.stats["prefill_s32"].padding_ratio == 2 / 30
    assert runtime.stats["prefill_s16"].padding_ratio == 6 / 10
    assert counters("decode_b2_c128") == (0, 0, 0)


def test_prefill_of_chunks_runs_the_plan_of_their_segments(compiled_dir):
    """``runtime.prefill`` with ``PrefillChunk``s, the public convenience, is the plan of one segment
    per chunk sampling its last token, through the same ``run_plan``."""
    from neuron_buckets import PrefillChunk

    a, b = tokens(10, 0), tokens(20, 1)
    chunks = [PrefillChunk(a, 0, [1, 2]), PrefillChunk(b, 0, [3, 4, 5])]
    got = BucketRuntime.open(compiled_dir).prefill(chunks)
    want = BucketRuntime.open(compiled_dir).run_plan(prefill_plan([(a, 0, [1, 2]), (b, 0, [3, 4, 5])]))
    assert got.shape == (2, 256)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_chunked_prefill_matches_transformers(compiled_dir, hf_model):
    """45 tokens > the 32-token bucket: a 32-token chunk, then 13 attending to the cached 32."""
    runtime = BucketRuntime.open(compiled_dir)
    long, short = tokens(45, 2), tokens(20, 3)

    logits = runtime.run_plan(prefill_plan([(long, 0, blocks(1, 45)), (short, 0, blocks(10, 20))]))

    want = torch.stack([hf_last_logits(hf_model, long), hf_last_logits(hf_model, short)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert runtime.stats["prefill_s32"].calls == 2 and runtime.stats["prefill_s16"].calls == 1


def test_packed_prefill_matches_transformers_and_keeps_requests_apart(compiled_dir, hf_model):
    """A continuing chunk and fresh prompts in one packed call: each request attends to its own
    tokens and cache only, so every logit row is what transformers gives that prompt alone."""
    runtime = BucketRuntime.open(compiled_dir)
    long, a, b = tokens(40, 4), tokens(7, 5), tokens(9, 6)
    first = runtime.run_plan(prefill_plan([(long[:24], 0, blocks(1, 40))]))  # 24 of 40 cached
    torch.testing.assert_close(first[0], hf_last_logits(hf_model, long[:24]), rtol=1e-4, atol=1e-4)
    assert runtime.stats["prefill_s32"].calls == 1

    logits = runtime.run_plan(prefill_plan([
        (long[24:], 24, blocks(1, 40)),  # 16 more, attending to the cached 24
        (a, 0, blocks(10, 7)),
        (b, 0, blocks(11, 9)),
    ]))  # fmt: skip
    want = torch.stack([hf_last_logits(hf_model, p) for p in (long, a, b)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # 16 + 7 fill one 32-token call (two requests, the bucket's most); 9 more need another call
    assert runtime.stats["prefill_s32"].calls == 2 and runtime.stats["prefill_s16"].calls == 1
    assert runtime.stats["prefill_s32"].real_tokens == 24 + 16 + 7


def test_decode_of_three_rows_splits_over_batch_2_graphs_and_matches_transformers(compiled_dir, hf_model):
    runtime = BucketRuntime.open(compiled_dir)
    prompts = [tokens(n, seed) for seed, n in enumerate((5, 17, 30))]
    tables = [blocks(1 + 8 * i, len(p) + 1) for i, p in enumerate(prompts)]
    runtime.run_plan(prefill_plan([(p, 0, t) for p, t in zip(prompts, tables, strict=True)]))

    nxt = [11, 22, 33]
    rows = [([n], len(p), t) for p, n, t in zip(prompts, nxt, tables, strict=True)]
    logits = runtime.run_plan(decode_plan(rows))

    assert logits.shape == (3, 256)
    want = torch.stack([hf_last_logits(hf_model, p + [n]) for p, n in zip(prompts, nxt, strict=True)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert runtime.stats["decode_b2_c128"].calls == 1 and runtime.stats["decode_b1_c128"].calls == 1


def test_a_plan_of_continuing_chunks_decode_rows_and_a_fresh_prompt_matches_transformers(
    compiled_dir, hf_model
):
    """Every segment carries its own context: three prompts continue from their cached prefixes
    (one without sampling), two requests decode and two prompts are fresh, in one plan. Packed
    calls hold two segments here, each over its own context, and a one-token prompt runs as a
    decode row of no context; every logit is what transformers gives that sequence alone."""
    runtime = BucketRuntime.open(compiled_dir)
    seqs = [tokens(n, 10 + i) for i, n in enumerate((20, 12, 30, 9, 17, 6, 1))]
    tables = [blocks(1 + 5 * i, len(s)) for i, s in enumerate(seqs)]
    cached = [8, 5, 16, 8, 16]  # requests 3 and 4: all but their last token
    runtime.run_plan(prefill_plan([(s[:n], 0, t) for s, n, t in zip(seqs, cached, tables, strict=False)]))
    before = {name: vars(s).copy() for name, s in runtime.stats.items()}

    plan = (
        Segment(0, seqs[0][8:], 8, tables[0], 1),
        Segment(1, seqs[1][5:], 5, tables[1], 1),
        Segment(2, seqs[2][16:24], 16, tables[2], 0),  # cut: writes its K/V, returns nothing
        Segment(3, seqs[3][8:], 8, tables[3], 1),  # decode rows
        Segment(4, seqs[4][16:], 16, tables[4], 1),
        Segment(5, seqs[5], 0, tables[5], 1),
        Segment(6, seqs[6], 0, tables[6], 1),
    )
    logits = runtime.run_plan(plan)

    want = torch.stack([hf_last_logits(hf_model, seqs[i]) for i in (0, 1, 3, 4, 5, 6)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    calls = {name: s.calls - before[name]["calls"] for name, s in runtime.stats.items()}
    # chunks two to a call (19 and 14 tokens); the packed calls are full, so the three decode
    # rows take the decode graphs: 2 + 1
    assert calls == {"prefill_s16": 1, "prefill_s32": 1, "decode_b1_c128": 1, "decode_b2_c128": 1}
    rest = runtime.run_plan((Segment(2, seqs[2][24:], 24, tables[2], 1),))  # reads what the cut chunk wrote
    torch.testing.assert_close(rest[0], hf_last_logits(hf_model, seqs[2]), rtol=1e-4, atol=1e-4)


def test_a_continuing_chunk_and_a_decode_row_run_in_one_compiled_call(compiled_dir, hf_model):
    """Mixed steps: the decode row rides in the chunk's packed call, each over its own context,
    over a cache poisoned with NaN wherever nothing was written; logits are transformers'."""
    runtime = BucketRuntime.open(compiled_dir)
    runtime.k_cache.fill_(float("nan"))
    runtime.v_cache.fill_(float("nan"))
    seqs = [tokens(18, 40), tokens(11, 41)]
    tables = [blocks(3, 18), blocks(9, 11)]
    runtime.run_plan(prefill_plan([(seqs[0][:6], 0, tables[0]), (seqs[1][:10], 0, tables[1])]))
    before = {name: s.calls for name, s in runtime.stats.items()}
    plan = (Segment(0, seqs[0][6:], 6, tables[0], 1), Segment(1, seqs[1][10:], 10, tables[1], 1))
    logits = runtime.run_plan(plan)
    want = torch.stack([hf_last_logits(hf_model, s) for s in seqs])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    calls = {name: s.calls - before[name] for name, s in runtime.stats.items() if s.calls > before[name]}
    assert calls == {"prefill_s16": 1}  # 12 chunk tokens + the decode row, one weight pass


def _delete(path: Path) -> None:
    path.unlink()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_delete, "graph of piece layer_t16_b2_c0_packed is missing"),
        (_truncate, "graph .* of piece layer_t16_b2_c0_packed does not match its sha256"),
        (_flip_a_byte, "graph .* of piece layer_t16_b2_c0_packed does not match its sha256"),
    ],
    ids=["missing", "truncated", "tampered"],
)
def test_a_damaged_graph_fails_at_its_first_use_and_only_there(artifact_copy, damage, message):
    manifest = read_manifest(artifact_copy)
    rec = next(p for p in manifest.pieces.values() if p.name == "layer_t16_b2_c0_packed")
    damage(artifact_copy / rec.file)

    runtime = BucketRuntime.open(artifact_copy)  # lazy: opening does not read the graph
    before = runtime.k_cache.clone()
    with pytest.raises(ArtifactError, match=message):
        runtime.run_plan(prefill_plan([(tokens(10, 0), 0, [1, 2])]))
    assert torch.equal(runtime.k_cache, before)
    runtime.run_plan(prefill_plan([(tokens(20, 0), 0, [1, 2, 3])]))  # the other buckets still serve
    runtime.run_plan(decode_plan([([7], 20, [1, 2, 3])]))


def test_a_damaged_shared_piece_fails_every_bucket_that_runs_it(artifact_copy):
    manifest = read_manifest(artifact_copy)
    rec = next(p for p in manifest.pieces.values() if p.name == "head")
    _flip_a_byte(artifact_copy / rec.file)

    runtime = BucketRuntime.open(artifact_copy)
    before = runtime.k_cache.clone()
    for step in (
        lambda: runtime.run_plan(prefill_plan([(tokens(10, 0), 0, [1, 2])])),
        lambda: runtime.run_plan(prefill_plan([(tokens(20, 0), 0, [1, 2, 3])])),
        lambda: runtime.run_plan(decode_plan([([7], 10, [1, 2])])),
    ):
        with pytest.raises(ArtifactError, match=r"graph .* of piece head does not match its sha256"):
            step()
    assert torch.equal(runtime.k_cache, before)  # every graph of a call loads before it runs


def test_weights_that_do_not_match_the_manifest_fail_at_open(artifact_copy):
    path = artifact_copy / "weights.safetensors"
    weights = load_file(path)
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, path)
    with pytest.raises(ArtifactError, match="weights.safetensors does not match the manifest's sha256"):
        BucketRuntime.open(artifact_copy)
    path.unlink()
    with pytest.raises(ArtifactError, match="weights file .*weights.safetensors is missing"):
        BucketRuntime.open(artifact_copy)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda m: m.update(schema_version=m["schema_version"] + 1),
            r"schema_version \d+ is newer than this toolchain supports .*upgrade neuron-buckets",
        ),
        (
            lambda m: m.update(schema_version=1),
            r"schema_version 1 was written by an older neuron-buckets .*run nb compile again",
        ),
        (
            lambda m: m["backend"]["versions"].update(torch="0.0.1"),
            r"compiled for other versions \(torch: built with 0.0.1, running .*\); recompile",
        ),
        (
            lambda m: m["backend"]["versions"].update(cpu_isa="NOT_THIS_CPU"),
            r"compiled for other versions \(cpu_isa: built with NOT_THIS_CPU, running .*\); recompile",
        ),
    ],
    ids=["newer-schema", "schema-v1", "other-torch", "other-cpu-isa"],
)
def test_a_manifest_this_runtime_cannot_serve_fails_at_open(artifact_copy, edit, message):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=message):
        BucketRuntime.open(artifact_copy)


def test_a_float32_cpu_artifact_carries_the_attention_kernel_that_its_graphs_call(compiled_dir):
    """Every layer graph, decode and packed prefill, attends through the C++ kernel
    (``kernels/block_kv_cpu.py``), which the artifact carries, hashed like its graphs."""
    from neuron_buckets.backends.inductor import _calls_op
    from neuron_buckets.kernels import block_kv_cpu

    manifest = read_manifest(compiled_dir)
    library = manifest.libraries["block_kv_cpu"]
    assert library.file == "kernels/block_kv_cpu.so"
    assert sha256_file(compiled_dir / library.file) == library.sha256
    for record in BucketRuntime.open(compiled_dir).records.values():
        graph = compiled_dir / manifest.pieces[record.pieces["layer"]].file
        assert _calls_op(graph, block_kv_cpu.OP), record.bucket.name


def test_a_cpu_artifacts_graphs_run_through_nbs_call_that_frees_the_gil_and_compute_what_torchs_does(
    compiled_dir, monkeypatch
):
    """The artifact carries ``kernels/package_call_cpu.so``; with it, every graph call is the op
    ``nb::package_run`` (a dispatcher op, which releases the GIL while it runs), and its logits are
    those of torch's own binding of the same graphs, bit for bit."""
    from dataclasses import replace

    from neuron_buckets.kernels import package_call_cpu

    library = read_manifest(compiled_dir).libraries["package_call_cpu"]
    assert sha256_file(compiled_dir / library.file) == library.sha256
    plan = (Segment(0, [3, 1, 4, 1, 5], 0, [1], 1),)
    with torch.profiler.profile() as prof:
        ours = BucketRuntime.open(compiled_dir).run_plan(plan)
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get(package_call_cpu.OP, 0) >= 2, calls  # the layer piece and the head, at least
    unregistered = replace(package_call_cpu.LIBRARY, dispatch_key="CPU")  # no kernel there: torch's binding
    monkeypatch.setattr(package_call_cpu, "LIBRARY", unregistered)
    assert torch.equal(BucketRuntime.open(compiled_dir).run_plan(plan), ours)


DECODER = """
import sys
from neuron_buckets.core.step_plan import Segment
from neuron_buckets.kernels import block_kv_cpu
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
assert not block_kv_cpu.LIBRARY.registered()
logits = BucketRuntime.open(sys.argv[1]).run_plan((Segment(0, [7], 9, [1, 2], 1),))
print(block_kv_cpu.LIBRARY.registered(), logits.isfinite().all().item())
"""


def test_a_host_without_a_compiler_decodes_with_the_artifacts_kernel_library(compiled_dir, tmp_path):
    """A fresh process with no C++ compiler and no kernel build of its own registers the artifact's
    copy of the library and decodes through it."""
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", DECODER, str(compiled_dir)], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["True", "True"]
    assert not any(tmp_path.iterdir())  # nothing was built


def test_open_does_not_probe_the_build_compiler(compiled_dir, monkeypatch):
    """Serving needs no C++ compiler; probing one costs seconds of imports at start-up."""
    from neuron_buckets.backends import inductor

    def refuse() -> str:
        raise AssertionError("the runtime asked for the C++ compiler's version")

    step = prefill_plan([(tokens(10, 0), 0, [1, 2])])
    expected = BucketRuntime.open(compiled_dir).run_plan(step)
    monkeypatch.setattr(inductor, "_cxx_version", refuse)
    torch.testing.assert_close(BucketRuntime.open(compiled_dir).run_plan(step), expected, rtol=0, atol=0)


def test_another_cxx_compiler_on_the_serving_host_is_fine(artifact_copy):
    """Loading a .pt2 needs no compiler: only the framework version must match the build."""
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    step = prefill_plan([(tokens(10, 0), 0, [1, 2])])
    expected = BucketRuntime.open(artifact_copy).run_plan(step)
    manifest["backend"]["versions"]["compiler"] = "clang++ 99.0"
    path.write_text(json.dumps(manifest))
    torch.testing.assert_close(BucketRuntime.open(artifact_copy).run_plan(step), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("step", "error", "message"),
    [
        (
            lambda rt: rt.run_plan(prefill_plan([([1] * 129, 0, list(range(1, 18)))])),
            NoBucketFits,
            "reaching 129 tokens exceeds max_model_len 128",
        ),
        # one good request beside a bad one: nothing of the good one is written either
        (
            lambda rt: rt.run_plan(prefill_plan([([1] * 12, 0, [40, 41]), ([2] * 9, 0, [42, 64])])),
            ValueError,
            r"block ids must lie in \[1, 64\), got \[42, 64\]",
        ),
        (
            lambda rt: rt.run_plan(prefill_plan([([1] * 4, 0, [0])])),
            ValueError,
            r"block ids must lie in \[1, 64\)",
        ),
        (
            lambda rt: rt.run_plan(decode_plan([([3], 10, [1, 2]), ([4], 10, [-3, 5])])),
            ValueError,
            r"block ids must lie in \[1, 64\), got \[-3, 5\]",
        ),
        (lambda rt: rt.run_plan(decode_plan([([3], 20, [1, 2])])), ValueError, "blocks for only 16"),
        # two requests sharing a block: a later call of the step would overwrite the earlier one's K/V
        (
            lambda rt: rt.run_plan(prefill_plan([([1] * 40, 0, [7, 8, 9, 10, 11]), ([2] * 3, 0, [9])])),
            ValueError,
            "block 9 is written twice",
        ),
        (lambda rt: rt.run_plan(()), ValueError, "at least one request"),
        (lambda rt: rt.run_plan(prefill_plan([([], 0, [1])])), ValueError, "request 0 has no tokens"),
    ],
    ids=[
        "too-long",
        "block-past-the-pool",
        "null-block",
        "negative-block",
        "too-few-blocks",
        "shared-block",
        "no-request",
        "empty-request",
    ],
)
def test_impossible_requests_are_refused_with_the_cache_untouched(compiled_dir, step, error, message):
    runtime = BucketRuntime.open(compiled_dir)
    runtime.run_plan(prefill_plan([(tokens(10, 0), 0, [1, 2])]))  # some real K/V to protect
    k, v = runtime.k_cache.clone(), runtime.v_cache.clone()
    with pytest.raises(error, match=message):
        step(runtime)
    assert torch.equal(runtime.k_cache, k) and torch.equal(runtime.v_cache, v)


OPENER = """
import os, sys, time
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
runtime = BucketRuntime.open(sys.argv[1])
deadline = time.monotonic() + 30  # a passing thread's OpenMP workers end just after it does
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.05)
print(before, threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc")
def test_open_leaves_the_opening_thread_no_openmp_workers(compiled_dir):
    """Weights are cast, packed and the cache zeroed on a passing thread: an OpenMP pool left on the
    opener would make the thread that steps sleep and wake at every parallel loop (1.7x slower)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", OPENER, str(compiled_dir)], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    before, after = map(int, out)
    assert after == before

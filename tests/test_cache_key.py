"""Cache keys change when and only when the compiled graph would: each test flips one input.

Keys are computed by ``Compiler`` exactly as ``nb compile`` does (nothing is compiled here), so a
test that passes means the real pipeline reuses or rebuilds the right graphs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from neuron_buckets.backends.eager import EagerBackend
from neuron_buckets.backends.inductor import InductorBackend
from neuron_buckets.compile import cache_key
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.config import Config, load_config
from neuron_buckets.core.bucket import Bucket
from tests.conftest import TINY_CONFIG, save_tiny_llama, write_config


@pytest.fixture
def config(hf_model_dir: Path, tmp_path: Path) -> Config:
    return load_config(write_config(tmp_path, hf_model_dir))


@pytest.fixture
def keys_of(tmp_path: Path):
    """Config -> {bucket: key}, through the compiler (which builds the model, compiles nothing)."""
    return lambda config: Compiler(config, tmp_path / "out", tmp_path / "cache").keys


def with_compile(config: Config, **changes) -> Config:
    return replace(config, compile=replace(config.compile, **changes))


def with_cache(config: Config, **changes) -> Config:
    return replace(config, cache=replace(config.cache, **changes))


def assert_all_changed(before: dict[Bucket, str], after: dict[Bucket, str]) -> None:
    assert before.keys() == after.keys()
    same = [b.name for b in before if before[b] == after[b]]
    assert not same, f"keys did not change for {same}"


def test_keys_are_distinct_hex_sha256(config, keys_of):
    keys = keys_of(config)
    assert len(set(keys.values())) == len(keys) == 4
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys.values())


def test_same_inputs_give_the_same_keys_in_a_fresh_process(config, keys_of, tmp_path):
    """The cache outlives the process: hash seeds, dict order or object ids must not leak in."""
    code = (
        "import json, sys; from pathlib import Path\n"
        "from neuron_buckets.compile.compiler import Compiler\n"
        "from neuron_buckets.config import load_config\n"
        "c = Compiler(load_config(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))\n"
        "print(json.dumps({b.name: k for b, k in c.keys.items()}))\n"
    )
    args = [str(tmp_path / "nb.toml"), str(tmp_path / "o2"), str(tmp_path / "c2")]
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    assert json.loads(run.stdout) == {b.name: k for b, k in keys_of(config).items()}


def test_new_weights_of_the_same_model_reuse_every_graph(config, keys_of, tmp_path):
    other = save_tiny_llama(tmp_path / "retrained", seed=1)
    weights = "model.safetensors"
    assert (other / weights).read_bytes() != (config.model.path / weights).read_bytes()
    assert keys_of(replace(config, model=replace(config.model, path=other))) == keys_of(config)


def test_moving_the_checkpoint_keeps_the_keys(config, keys_of, tmp_path):
    moved = Path(shutil.copytree(config.model.path, tmp_path / "elsewhere" / "model"))
    assert keys_of(replace(config, model=replace(config.model, path=moved))) == keys_of(config)


def test_a_different_model_config_changes_every_key(config, keys_of, tmp_path):
    other = save_tiny_llama(tmp_path / "other-eps", rms_norm_eps=1e-5)
    assert_all_changed(keys_of(config), keys_of(replace(config, model=replace(config.model, path=other))))


def test_adding_a_bucket_keeps_the_other_keys(config, keys_of, hf_model_dir, tmp_path):
    grown = TINY_CONFIG.replace("tokens_buckets = [16, 32]", "tokens_buckets = [16, 24, 32]")
    assert grown != TINY_CONFIG
    before = keys_of(config)
    (tmp_path / "grown").mkdir()
    after = keys_of(load_config(write_config(tmp_path / "grown", hf_model_dir, grown)))
    assert set(after) - set(before) == {Bucket("prefill", 1, 24, 128)}
    assert {b: after[b] for b in before} == before


def test_bucket_shape_is_in_the_key(config, keys_of):
    """Same (batch, seq, ctx) but another kind, or another ctx, is another graph."""
    ctx_buckets = replace(config.buckets, decode_context_length_buckets=(64, 128))
    keys = keys_of(replace(config, buckets=ctx_buckets))
    assert keys[Bucket("decode", 1, 1, 64)] != keys[Bucket("decode", 1, 1, 128)]
    assert len(set(keys.values())) == len(keys)


def test_max_model_len_alone_changes_no_graph(config, keys_of):
    """Only buckets whose ctx moves with max_model_len are rebuilt (ctx bounds the graph)."""
    short = replace(config, buckets=replace(config.buckets, decode_context_length_buckets=(64, 128)))
    long = replace(
        with_cache(short, max_model_len=256),
        buckets=replace(short.buckets, decode_context_length_buckets=(64, 256)),
    )
    before, after = keys_of(short), keys_of(long)
    kept = {b for b in before if b.ctx == 64}
    assert kept and all(after[b] == before[b] for b in kept)
    assert set(after) - set(before) == {b for b in after if b.ctx == 256}


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "bfloat16"},
        {"block_size": 16},  # the cache tensors are graph inputs: their shape is in the graph
        {"num_blocks": 32},
    ],
    ids=lambda c: next(iter(c)),
)
def test_cache_dtype_and_geometry_change_every_key(config, keys_of, change):
    assert_all_changed(keys_of(config), keys_of(with_cache(config, **change)))


@pytest.mark.parametrize(
    "change",
    [
        {"backend": "eager"},
        {"device": "cuda"},
        {"flags": {"compile_threads": 1}},
    ],
    ids=lambda c: next(iter(c)),
)
def test_backend_device_and_flags_change_every_key(config, keys_of, change):
    assert_all_changed(keys_of(config), keys_of(with_compile(config, **change)))


def test_jobs_do_not_change_the_keys(config, keys_of):
    assert keys_of(with_compile(config, jobs=1)) == keys_of(config)


@pytest.mark.parametrize("component", ["torch", "compiler"])
def test_torch_and_compiler_versions_change_every_key(config, keys_of, monkeypatch, component):
    before = keys_of(config)
    real = InductorBackend.versions
    monkeypatch.setattr(InductorBackend, "versions", lambda self: {**real(self), component: "99.0"})
    assert_all_changed(before, keys_of(config))


def test_eager_torch_version_changes_every_key(config, keys_of, monkeypatch):
    eager = with_compile(config, backend="eager")
    before = keys_of(eager)
    monkeypatch.setattr(EagerBackend, "versions", lambda self: {"torch": "99.0", "compiler": "none"})
    assert_all_changed(before, keys_of(eager))


def copy_sources(tmp_path: Path, monkeypatch) -> list[Path]:
    """Point the key at byte-identical copies of the model sources, to edit without touching git."""
    copies = []
    for src in cache_key.graph_sources():
        (tmp_path / src.parent.name).mkdir(exist_ok=True)
        copies.append(Path(shutil.copy(src, tmp_path / src.parent.name / src.name)))
    monkeypatch.setattr(cache_key, "package_sources", lambda: copies)
    return copies


def test_editing_the_model_source_changes_every_key(config, keys_of, tmp_path, monkeypatch):
    before = keys_of(config)
    copies = copy_sources(tmp_path, monkeypatch)
    assert keys_of(config) == before, "an identical copy must hash the same"
    model_py = next(p for p in copies if p.name == "llama.py")
    text = model_py.read_text()
    edited = text.replace("rms_norm_eps: float = 1e-6", "rms_norm_eps: float = 1e-5")
    assert edited != text
    model_py.write_text(edited)
    assert_all_changed(before, keys_of(config))


@pytest.mark.parametrize("name", ["padding.py", "worker.py"])
def test_editing_the_code_that_builds_example_inputs_changes_every_key(
    config, keys_of, tmp_path, monkeypatch, name
):
    before = keys_of(config)
    source = next(p for p in copy_sources(tmp_path, monkeypatch) if p.name == name)
    source.write_text(source.read_text() + "\n# traced differently\n")
    assert_all_changed(before, keys_of(config))


def test_the_backend_module_source_is_part_of_the_digest(tmp_path):
    backend_py = tmp_path / "inductor.py"
    backend_py.write_text("FLAGS = 1\n")
    before = cache_key.source_digest(extra=(backend_py,))
    backend_py.write_text("FLAGS = 2\n")
    assert cache_key.source_digest(extra=(backend_py,)) != before


def test_editing_a_kernel_source_changes_every_key(config, keys_of, tmp_path, monkeypatch):
    before = keys_of(config)
    golden = next(p for p in copy_sources(tmp_path, monkeypatch) if p.name == "block_kv_torch.py")
    assert keys_of(config) == before, "an identical copy must hash the same"
    golden.write_text(golden.read_text() + "\n# a changed kernel\n")
    assert_all_changed(before, keys_of(config))

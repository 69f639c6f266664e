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
import tomllib
from dataclasses import fields, replace
from pathlib import Path

import pytest

from neuron_buckets.backends.eager import EagerBackend
from neuron_buckets.backends.inductor import InductorBackend
from neuron_buckets.compile import cache_key
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.config import CacheConfig, CompileConfig, Config, load_config, parse_config
from neuron_buckets.core.bucket import Bucket
from neuron_buckets.model.pieces import PieceShape
from tests.conftest import TINY_CONFIG, save_tiny_llama, save_tiny_model, write_config


@pytest.fixture
def config(hf_model_dir: Path, tmp_path: Path) -> Config:
    return load_config(write_config(tmp_path, hf_model_dir))


@pytest.fixture
def compiler_of(tmp_path: Path):
    """Config -> the compiler nb compile would run (it reads the model config, compiles nothing)."""
    return lambda config: Compiler(config, tmp_path / "out", tmp_path / "cache")


@pytest.fixture
def keys_of(compiler_of):
    """Config -> {piece shape: key}, through the compiler."""
    return lambda config: compiler_of(config).plan.keys


def with_compile(config: Config, **changes) -> Config:
    return replace(config, compile=replace(config.compile, **changes))


def with_cache(config: Config, **changes) -> Config:
    return replace(config, cache=replace(config.cache, **changes))


def assert_all_changed(before: dict[PieceShape, str], after: dict[PieceShape, str]) -> None:
    assert before.keys() == after.keys()
    same = [b.name for b in before if before[b] == after[b]]
    assert not same, f"keys did not change for {same}"


def test_keys_are_distinct_hex_sha256(config, keys_of):
    keys = keys_of(config)
    # four buckets: one shared dynamic embed and head, a layer piece per bucket shape, and the
    # packed buckets' fresh layers
    assert sorted(s.name for s in keys) == sorted(
        ["embed", "head", "layer_t16_b2_c128_packed", "layer_t32_b2_c128_packed", "layer_t16_b2_c0_packed",
         "layer_t32_b2_c0_packed", "layer_t1_b1_c128", "layer_t2_b2_c128"]
    )
    assert len(set(keys.values())) == len(keys) == 8
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys.values())


def test_every_field_of_a_piece_shape_is_in_the_key():
    """Role, tokens, rows, ctx, samples and layout each decide a graph; nothing else of a bucket does."""
    common = dict(model_config={"a": 1}, cache={"block_size": 8}, backend={"name": "x"}, sources="s")
    base = PieceShape("layer", 16, rows=1, ctx=128)
    others = [
        PieceShape("head", 16, rows=1, ctx=128),
        PieceShape("layer", 32, rows=1, ctx=128),
        PieceShape("layer", 16, rows=2, ctx=128),
        PieceShape("layer", 16, rows=1, ctx=64),
        PieceShape("layer", 16, rows=1, ctx=128, samples=2),
        PieceShape("layer", 16, rows=1, ctx=128, packed=True),
    ]
    keys = [cache_key.graph_key(piece=s, **common) for s in [base, *others]]
    assert len(set(keys)) == len(keys)
    assert cache_key.graph_key(piece=PieceShape("layer", 16, rows=1, ctx=128), **common) == keys[0]


def test_same_inputs_give_the_same_keys_in_a_fresh_process(config, keys_of, tmp_path):
    """The cache outlives the process: hash seeds, dict order or object ids must not leak in."""
    code = (
        "import json, sys; from pathlib import Path\n"
        "from neuron_buckets.compile.compiler import Compiler\n"
        "from neuron_buckets.config import load_config\n"
        "c = Compiler(load_config(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))\n"
        "print(json.dumps({b.name: k for b, k in c.plan.keys.items()}))\n"
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


@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama-bias", {}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 16}),  # hidden / heads, as Llama's: only the q/k norms differ
    ("mistral", {}),
])
def test_each_architecture_switch_changes_every_key(config, keys_of, tmp_path, arch, overrides):
    """Biases, q/k norms and the window change the graphs, so the keys; the shapes stay Llama's."""
    other = save_tiny_model(tmp_path / "other", arch, **overrides)
    assert_all_changed(keys_of(config), keys_of(replace(config, model=replace(config.model, path=other))))


def test_each_sliding_window_has_its_own_keys(config, keys_of, tmp_path):
    def keys(window: int) -> dict[PieceShape, str]:
        model = save_tiny_model(tmp_path / f"w{window}", "mistral", sliding_window=window)
        return keys_of(replace(config, model=replace(config.model, path=model)))

    assert_all_changed(keys(12), keys(13))


def test_adding_a_bucket_keeps_the_other_keys(config, keys_of, compiler_of, hf_model_dir, tmp_path):
    grown = TINY_CONFIG.replace("tokens_buckets = [16, 32]", "tokens_buckets = [16, 24, 32]")
    assert grown != TINY_CONFIG
    before = keys_of(config)
    (tmp_path / "grown").mkdir()
    after = keys_of(load_config(write_config(tmp_path / "grown", hf_model_dir, grown)))
    new = {PieceShape("layer", 24, rows=2, ctx=ctx, packed=True) for ctx in (0, 128)}
    assert set(after) - set(before) == new  # one new layer piece and its fresh layer
    assert {s: after[s] for s in before} == before
    (tmp_path / "grown2").mkdir()
    grown_compiler = compiler_of(load_config(write_config(tmp_path / "grown2", hf_model_dir, grown)))
    pieces = grown_compiler.plan.bucket_pieces[Bucket("prefill", 2, 24, 128)]
    assert (pieces["embed"], pieces["head"]) == (PieceShape("embed", 0), PieceShape("head", 0))  # shared


def test_bucket_shape_is_in_the_key(config, compiler_of):
    """Same (batch, seq) but another ctx is another layer graph; the dynamic embed and head stay one."""
    ctx_buckets = replace(config.buckets, decode_context_length_buckets=(64, 128))
    compiler = compiler_of(replace(config, buckets=ctx_buckets))
    keys, pieces = compiler.plan.keys, compiler.plan.bucket_pieces
    short, long = pieces[Bucket("decode", 1, 1, 64)], pieces[Bucket("decode", 1, 1, 128)]
    assert (short["layer"], long["layer"]) == (PieceShape("layer", 1, 1, 64), PieceShape("layer", 1, 1, 128))
    assert keys[short["layer"]] != keys[long["layer"]]
    assert short["embed"] == long["embed"] and short["head"] == long["head"]
    # embed, head, 6 layers and the two packed buckets' fresh layers
    assert len(set(keys.values())) == len(keys) == len(compiler.plan.shapes) == 10


def test_max_model_len_alone_changes_no_graph(config, keys_of):
    """Only buckets whose ctx moves with max_model_len are rebuilt (ctx bounds the graph)."""
    short = replace(config, buckets=replace(config.buckets, decode_context_length_buckets=(64, 128)))
    long = replace(
        short,
        cache=replace(short.cache, max_model_len=256),
        buckets=replace(short.buckets, decode_context_length_buckets=(64, 256)),
    )
    before, after = keys_of(short), keys_of(long)
    kept = {s for s in before if s.ctx != 128}  # the ctx-64 layers and the shared embed and head
    assert {s.role for s in kept} == {"embed", "layer", "head"}
    assert all(after[s] == before[s] for s in kept)
    assert set(after) - set(before) == {s for s in after if s.ctx == 256}


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


# A value other than the tiny config's for every setting of the sections a key could depend on.
OTHER_VALUE = {
    "cache": {
        "block_size": 16, "num_blocks": 32, "max_model_len": 256, "dtype": "bfloat16",
        "enable_prefix_caching": False,
    },
    "compile": {
        "backend": "eager", "jobs": 1, "device": "cuda", "flags": {"compile_threads": 1},
        "executor": "ray", "task_cpus": 4, "retries": 0, "fresh_layers": False,
    },
}  # fmt: skip
SETTINGS = [(s, f) for s in (CacheConfig, CompileConfig) for f in fields(s)]


@pytest.mark.parametrize(("section", "setting"), SETTINGS, ids=[f"{s.SECTION}.{f.name}" for s, f in SETTINGS])
def test_each_setting_changes_the_keys_exactly_as_its_field_declares(
    hf_model_dir, tmp_path, keys_of, section, setting
):
    """``graph=True`` beside a field: every key changes with it; ``graph=False``: no key of a piece
    that both grids hold does (a new max_model_len brings pieces of its own ctx, nothing else)."""
    raw = tomllib.loads(TINY_CONFIG.format(model=hf_model_dir))
    before = keys_of(parse_config(raw))
    raw.setdefault(section.SECTION, {})[setting.name] = OTHER_VALUE[section.SECTION][setting.name]
    after = keys_of(parse_config(raw))
    if setting.metadata["graph"]:
        assert_all_changed(before, after)
    else:
        assert {s: after[s] for s in before if s in after} == {s: before[s] for s in after if s in before}
        assert set(before) & set(after), "the two grids share no piece: nothing was compared"


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
    model_py = next(p for p in copies if p.name == "model_config.py")
    text = model_py.read_text()
    edited = text.replace("rms_norm_eps: float = 1e-6", "rms_norm_eps: float = 1e-5")
    assert edited != text
    model_py.write_text(edited)
    assert_all_changed(before, keys_of(config))


@pytest.mark.parametrize("name", ["padding.py", "pieces.py", "worker.py"])
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


# What shapes a compiled graph, written out here rather than read from cache_key: the model, the
# graph contract (core), the kernels, the compile worker and the backend's own module.
GRAPH_SHAPING = ("model/", "core/", "kernels/", "compile/worker.py", "backends/inductor.py")


@pytest.fixture
def package_copy(tmp_path, monkeypatch) -> Path:
    """A byte-identical copy of the whole package, the kernels in their place as a built package
    holds them, that the key reads instead of the real one, to edit any file without touching git."""
    real = cache_key.backend_source_digest(InductorBackend())
    skip = shutil.ignore_patterns("__pycache__")
    copy = Path(shutil.copytree(cache_key.PACKAGE_ROOT, tmp_path / "neuron_buckets", ignore=skip))
    shutil.rmtree(copy / "kernels")  # a checkout's pointer to the top-level kernels/
    shutil.copytree(cache_key.KERNELS_ROOT, copy / "kernels", ignore=skip)
    monkeypatch.setattr(cache_key, "PACKAGE_ROOT", copy)
    monkeypatch.setattr(cache_key, "KERNELS_ROOT", copy / "kernels")
    assert cache_key.backend_source_digest(InductorBackend()) == real, "an identical copy must hash the same"
    return copy


def edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n# edited\n")


def test_the_source_digest_hashes_exactly_the_code_that_shapes_a_graph(package_copy):
    """Every file of the package edited in turn: only the graph-shaping ones move the digest."""
    backend = InductorBackend()
    before = cache_key.backend_source_digest(backend)
    moved = set()
    for path in package_copy.rglob("*.py"):
        text = path.read_text()
        edit(path)
        if cache_key.backend_source_digest(backend) != before:
            moved.add(path.relative_to(package_copy).as_posix())
        path.write_text(text)
    every = {p.relative_to(package_copy).as_posix() for p in package_copy.rglob("*.py")}
    assert moved == {f for f in every if f.startswith(GRAPH_SHAPING)}
    assert {"utils/errors.py", "engine/scheduler.py", "runtime/bucket_runtime.py"} <= every - moved


def test_editing_engine_server_or_errors_keeps_every_key_and_model_or_kernels_changes_every_key(
    config, keys_of, package_copy
):
    before = keys_of(config)
    for path in [*package_copy.glob("engine/*.py"), *package_copy.glob("server/*.py")]:
        edit(path)
    edit(package_copy / "utils" / "errors.py")
    assert keys_of(config) == before
    for graph_code in ("model/llama.py", "kernels/block_kv_torch.py"):
        path = package_copy / graph_code
        text = path.read_text()
        edit(path)
        assert_all_changed(before, keys_of(config))
        path.write_text(text)

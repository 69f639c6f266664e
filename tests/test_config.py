"""Config loading: the embedded default, strategies, and one clear error per bad key."""

from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from neuron_buckets.artifact.manifest import CacheGeometry
from neuron_buckets.config import (
    BucketConfig,
    CacheConfig,
    CompileConfig,
    Config,
    ConfigError,
    ModelSource,
    SpeculativeConfig,
    load_config,
    parse_config,
)
from neuron_buckets.config.loader import SECTIONS
from neuron_buckets.config.runtime_file import load_runtime_config
from neuron_buckets.runtime.artifact_check import _geometry_problem


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "nb.toml"
    path.write_text(text)
    return path


def test_embedded_default_loads():
    cfg = load_config()
    assert cfg.model.path is None  # the embedded seeded model
    assert (cfg.cache.block_size, cfg.cache.num_blocks, cfg.cache.max_model_len) == (16, 128, 256)
    assert cfg.buckets.num_seqs_buckets == (1, 2, 4)
    assert cfg.buckets.num_batched_tokens_buckets == (32, 64, 128)  # powers_of_two from 32
    assert cfg.buckets.decode_context_length_buckets == (256,)  # max_model_len <= 256: one context
    assert cfg.compile.backend == "inductor"


def test_an_empty_file_gets_the_dataclass_defaults(tmp_path):
    cfg = load_config(write(tmp_path, ""))
    assert (cfg.compile.executor, cfg.compile.task_cpus, cfg.compile.retries) == ("local", 1, 2)
    assert cfg.buckets.num_seqs_buckets == (1, 2, 4)  # powers of two up to max_num_seqs
    assert cfg.buckets.num_batched_tokens_buckets == (16, 32, 64, 128)  # the budget and 3 halvings
    assert cfg.buckets.decode_context_length_buckets == (256,)  # max_model_len 256: just itself


@pytest.mark.parametrize(
    ("cache", "contexts"),
    [
        ("block_size = 16\nmax_model_len = 1024\nnum_blocks = 128", (256, 512, 1024)),
        ("block_size = 16\nmax_model_len = 2048\nnum_blocks = 256", (256, 512, 1024, 2048)),
        ("block_size = 8\nmax_model_len = 128", (128,)),  # at most 256: one context, max_model_len
        ("block_size = 16\nmax_model_len = 256", (256,)),
        ("block_size = 96\nmax_model_len = 1152\nnum_blocks = 32", (288, 576, 1152)),  # from a block multiple
    ],
)
def test_decode_contexts_default_to_powers_of_two_from_256(tmp_path, cache, contexts):
    cfg = load_config(write(tmp_path, f"[cache]\n{cache}\n"))
    assert cfg.buckets.decode_context_length_buckets == contexts
    assert all(c % cfg.cache.block_size == 0 for c in contexts)
    assert contexts[-1] == cfg.cache.max_model_len


def test_strategies_and_explicit_lists(tmp_path):
    cfg = load_config(write(tmp_path, """
[cache]
block_size = 32
max_model_len = 512
[buckets]
max_num_seqs = 8
max_num_batched_tokens = 256
num_seqs_buckets = { strategy = "linear", min = 2, step = 2 }
num_batched_tokens_buckets = { strategy = "powers_of_two", min = 64 }
decode_context_length_buckets = [128, 512]
speculation_length = 3
[compile]
backend = "eager"
flags = { max_autotune = true }
"""))  # fmt: skip
    b = cfg.buckets
    assert b.num_seqs_buckets == (2, 4, 6, 8)
    assert b.num_batched_tokens_buckets == (64, 128, 256)
    assert b.decode_context_length_buckets == (128, 512)
    assert b.speculation_length == 3
    assert cfg.compile.flags == {"max_autotune": True}


def test_relative_model_path_resolves_next_to_the_file(tmp_path):
    cfg = load_config(write(tmp_path, '[model]\npath = "weights/llama"\n'))
    assert cfg.model.path == tmp_path / "weights" / "llama"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # unknown names
        ("[modle]", r"unknown section\(s\) \['modle'\]"),
        ("[cache]\nblocksize = 16", r"\[cache\] unknown key\(s\) \['blocksize'\]; allowed: \['block_size'"),
        ("[buckets]\nnum_seq_buckets = [4]", r"\[buckets\] unknown key\(s\) \['num_seq_buckets'\]"),
        ("[compile]\nbackends = 'eager'", r"\[compile\] unknown key\(s\) \['backends'\]"),
        ("[buckets]\nnum_seqs_buckets = { strategy = 'powers_of_two', mx = 4 }",
         r"buckets.num_seqs_buckets: unknown key\(s\) \['mx'\]"),
        # wrong types
        ("cache = 3", r"\[cache\] must be a table"),
        ("[cache]\nblock_size = '16'", "cache.block_size must be a non-negative integer, got '16'"),
        ("[cache]\nblock_size = 16.0", "cache.block_size must be a non-negative integer, got 16.0"),
        ("[buckets]\nmax_num_seqs = true", "buckets.max_num_seqs must be a non-negative integer, got True"),
        ("[cache]\ndtype = 16", "cache.dtype must be a string, got 16"),
        ("[cache]\nenable_prefix_caching = 1", "cache.enable_prefix_caching must be true or false, got 1"),
        ("[compile]\nfresh_layers = 1", "compile.fresh_layers must be true or false, got 1"),
        ("[model]\npath = 5", "model.path must be a string"),
        ("[compile]\nflags = 5", "compile.flags must be a table"),
        ("[buckets]\nnum_seqs_buckets = 4", "num_seqs_buckets: expected a list of ints or a strategy"),
        ("[buckets]\nnum_seqs_buckets = [1, '4']", "buckets.num_seqs_buckets must be positive integers"),
        ("[buckets]\nnum_seqs_buckets = { strategy = 'linear', min = 'a' }",
         "buckets.num_seqs_buckets.min must be an integer, got 'a'"),
        # impossible values
        ("[cache]\nblock_size = 0", "cache.block_size must be positive, got 0"),
        ("[cache]\nnum_blocks = 1", "num_blocks=1 cannot hold one sequence .* need at least 17"),
        ("[cache]\nnum_blocks = 16", "cache.num_blocks=16 cannot hold one sequence"),
        ("[cache]\nmax_model_len = 100", "cache.max_model_len=100 must be a multiple of cache.block_size=16"),
        ("[cache]\ndtype = 'int8'", "cache.dtype must be one of"),
        ("[compile]\nbackend = 'tpu'", "compile.backend must be one of .* got 'tpu'"),
        ("[compile]\njobs = 0", "compile.jobs must be positive, got 0"),
        ("[compile]\nexecutor = 'dask'", "compile.executor must be one of .* got 'dask'"),
        ("[compile]\ntask_cpus = 0", "compile.task_cpus must be positive, got 0"),
        ("[compile]\nretries = -1", "compile.retries must be a non-negative integer, got -1"),
        ("[buckets]\nmax_num_seqs = 0", "buckets.max_num_seqs must be positive, got 0"),
        ("[buckets]\nspeculation_length = -1", "buckets.speculation_length must be a non-negative integer"),
        ("[buckets]\nspeculation_length = 256", "speculation_length must be below"),
        ("[buckets]\nnum_seqs_buckets = [1, 2]",
         r"buckets.num_seqs_buckets's last entry must equal buckets.max_num_seqs \(4\), got \[1, 2\]"),
        ("[buckets]\nnum_seqs_buckets = [2, 1, 4]", "buckets.num_seqs_buckets must be strictly ascending"),
        ("[buckets]\nnum_seqs_buckets = [0, 4]", "buckets.num_seqs_buckets must be positive integers"),
        ("[buckets]\nnum_batched_tokens_buckets = [64]",
         r"num_batched_tokens_buckets's last entry must equal buckets.max_num_batched_tokens \(128\)"),
        ("[buckets]\nnum_seqs_buckets = { strategy = 'exp' }", "strategy must be 'powers_of_two' or"),
        ("[buckets]\nnum_seqs_buckets = { strategy = 'linear', min = 8 }",
         "buckets.num_seqs_buckets: linear buckets need 0 < min <= max"),
        ("[buckets]\ndecode_context_length_buckets = [40, 256]", "40 is not a multiple of cache.block_size"),
        ("[buckets]\ndecode_context_length_buckets = [128]",
         r"buckets.decode_context_length_buckets's last entry must equal cache.max_model_len \(256\)"),
        ("[speculative]\nmethod = 'draft_model'", "speculative.draft_model: method 'draft_model' needs"),
        ("[speculative]\nmethod = 'eagle'", "speculative.method must be one of .* got 'eagle'"),
        ("[speculative]\nk = 3", "speculative. unknown key"),
        # keys nothing would read: a run's, or one the task has no use for
        ("[speculative]\nauto_off = false", "speculative.auto_off is a run-time setting that nb compile does "
         r"not record: give it to nb generate or nb serve in a runtime file \(--config"),
        ("[model]\ntask = 'embed'\n[buckets]\nspeculation_length = 0",
         'buckets.speculation_length does nothing for model.task = "embed" .*: delete it'),
        ("[model]\ntask = 'embed'\n[cache]\nenable_prefix_caching = false",
         'cache.enable_prefix_caching does nothing for model.task = "embed"'),
        ("[model]\nnormalize = false", 'model.normalize does nothing for model.task = "generate"'),
        # removed keys name the release and say what replaced them
        ("[buckets]\nprefill_batch_buckets = [2]\nnum_batched_tokens_buckets = [128]",
         "prefill_batch_buckets was removed in 0.2: .*packs up to max_num_seqs requests.*delete the key"),
        ("[buckets]\nprefill_batch_buckets = [1]", "buckets.prefill_batch_buckets was removed in 0.2"),
        # not TOML at all
        ("[cache\nblock_size = 16", "not valid TOML"),
    ],
)  # fmt: skip
def test_bad_files_fail_with_one_message_naming_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: ")
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[speculative]\nnum_speculative_tokens = -2", "num_speculative_tokens must be a non-negative"),
        ("[speculative]\nprompt_lookup_min = 5", "prompt_lookup_min and prompt_lookup_max need 1 <= min"),
        ("[speculative]\nprompt_lookup_max = 0", "need 1 <= min <= max, got 1 and 0"),
        ("[speculative]\nk = 3", "speculative. unknown key"),
        ("[speculative]\nmethod = 'eagle'", "speculative.method must be one of .* got 'eagle'"),
        ("[speculative]\nauto_off_window = 0", "speculative.auto_off_window must be positive, got 0"),
        ("[speculative]\nauto_off = 1", "speculative.auto_off must be true or false, got 1"),
        # a compile setting is built into the artifact: nothing at run time would read it
        ("[cache]\nnum_blocks = 64", r"\[cache\] is an nb compile setting, built into the artifact"),
        ("[speculative]\ndraft_model = 'small'", "speculative.draft_model is an nb compile setting"),
        ("[speculative\nk = 3", "not valid TOML"),
    ],
)  # fmt: skip
def test_bad_runtime_files_fail_with_one_message_naming_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as e:
        load_runtime_config(path)
    assert str(e.value).startswith(f"{path}: ")
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)  # a directory
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(bad)


def test_the_dataclass_defaults_are_the_loaders():
    """One set of defaults: a config built in code without arguments is an empty file's."""
    built = Config(ModelSource(), CacheConfig(), BucketConfig(), CompileConfig())
    assert built == parse_config({})
    assert built.buckets.num_batched_tokens_buckets == (16, 32, 64, 128)  # derived, as from a file
    assert BucketConfig(max_num_batched_tokens=100).num_batched_tokens_buckets == (13, 25, 50, 100)
    assert BucketConfig(max_num_batched_tokens=2).num_batched_tokens_buckets == (1, 2)
    assert built.buckets.decode_context_length_buckets == (256,)
    linear = BucketConfig(max_num_seqs=8, num_seqs_buckets={"strategy": "linear", "min": 2, "step": 2})
    assert linear.num_seqs_buckets == (2, 4, 6, 8)  # a strategy table in code, as in a file


def with_buckets(**buckets) -> Config:
    return Config(ModelSource(), CacheConfig(), BucketConfig(**buckets), CompileConfig())


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CacheConfig(num_blocks=1), "cache.num_blocks=1 cannot hold one sequence .* at least 17"),
        (lambda: CacheConfig(block_size="16"), "cache.block_size must be a non-negative integer, got '16'"),
        (lambda: BucketConfig(max_num_seqs=0), "buckets.max_num_seqs must be positive, got 0"),
        (lambda: BucketConfig(num_seqs_buckets=(1, 2)),
         r"num_seqs_buckets's last entry must equal buckets.max_num_seqs \(4\)"),
        (lambda: BucketConfig(num_seqs_buckets={"strategy": "exp"}), "strategy must be 'powers_of_two' or"),
        (lambda: CompileConfig(executor="dask"), "compile.executor must be one of .* got 'dask'"),
        (lambda: CompileConfig(flags=5), "compile.flags must be a table"),
        (lambda: ModelSource(path=5), "model.path must be a string"),
        (lambda: with_buckets(speculation_length=256), "speculation_length must be below"),
        (lambda: with_buckets(decode_context_length_buckets=(40, 256)), "40 is not a multiple of cache"),
    ],
)  # fmt: skip
def test_sections_built_in_code_check_themselves_as_the_file_does(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_every_setting_declares_whether_it_shapes_a_graph():
    for section in SECTIONS.values():
        for f in fields(section):
            assert isinstance(f.metadata.get("graph"), bool), f"{section.SECTION}.{f.name}"


@given(
    block_size=st.sampled_from([1, 8, 16, 96]),
    num_blocks=st.integers(2, 80),
    max_model_len=st.integers(1, 2048),
)
def test_the_config_and_the_artifact_check_apply_one_geometry_rule(block_size, num_blocks, max_model_len):
    """A cache the config refuses is an artifact the runtime refuses, with the same words."""
    try:
        CacheConfig(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len)
        refused = None
    except ConfigError as e:
        refused = str(e)
    shape = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16)
    geometry = CacheGeometry(block_size, num_blocks, 2, 2, 16, "float32", max_model_len)
    assert _geometry_problem(geometry, shape, []) == refused


def test_speculative_section_is_off_by_default_and_reads_vllms_names(tmp_path):
    assert not load_config(write(tmp_path, "")).speculative.enabled
    assert not load_runtime_config(write(tmp_path, "")).enabled
    text = "[speculative]\nnum_speculative_tokens = 3\nprompt_lookup_min = 2\nprompt_lookup_max = 5\n"
    spec = load_runtime_config(write(tmp_path, text))
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 3, 2, 5
    )
    assert spec.enabled
    assert (spec.auto_off, spec.auto_off_window, spec.auto_off_probe_interval) == (True, 16, 128)
    text += "auto_off = false\nauto_off_window = 8\nauto_off_probe_interval = 32\n"
    spec = load_runtime_config(write(tmp_path, text))
    assert (spec.auto_off, spec.auto_off_window, spec.auto_off_probe_interval) == (False, 8, 32)


def test_a_draft_models_relative_path_resolves_against_the_config_file(tmp_path):
    text = "[speculative]\nmethod = 'draft_model'\ndraft_model = 'models/small'\n"
    spec = load_config(write(tmp_path, text)).speculative
    assert spec.uses_draft_model and spec.draft_model == tmp_path / "models" / "small"
    assert SpeculativeConfig(method="draft_model").draft_model is None  # a runtime's: the artifact has it

"""Loading the TOML config into the section dataclasses, every key and value checked.

Every key is known: a typo or an impossible value fails at once with the key's name and what is
allowed, instead of compiling hours of graphs for the wrong shapes.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from neuron_buckets.config.buckets import BucketConfig
from neuron_buckets.config.cache import DTYPES, CacheConfig
from neuron_buckets.config.compile import BACKENDS, EXECUTORS, CompileConfig
from neuron_buckets.config.model import ModelSource
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.core.bucket import linear, powers_of_two, validate_buckets

# Below this, a smaller context saves less attention than another set of decode graphs costs.
MIN_DEFAULT_CONTEXT = 256


class ConfigError(ValueError):
    """A config file that cannot describe a valid build."""


@dataclass(frozen=True)
class Config:
    model: ModelSource
    cache: CacheConfig
    buckets: BucketConfig
    compile: CompileConfig
    speculative: SpeculativeConfig = SpeculativeConfig()


def _sizes(key: str, spec: Any, default_max: int) -> tuple[int, ...]:
    """A bucket list: explicit ints, or {strategy = powers_of_two | linear, min, max, step}."""
    if isinstance(spec, list):
        return tuple(spec)
    if not isinstance(spec, dict):
        raise ConfigError(f"{key}: expected a list of ints or a strategy table, got {spec!r}")
    allowed = {"strategy", "min", "max", "step"}
    if unknown := set(spec) - allowed:
        raise ConfigError(f"{key}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    lo, hi = spec.get("min", 1), spec.get("max", default_max)
    for name, value in (("min", lo), ("max", hi), ("step", spec.get("step", lo))):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{key}.{name} must be an integer, got {value!r}")
    try:
        if spec.get("strategy") == "powers_of_two":
            return tuple(powers_of_two(lo, hi))
        if spec.get("strategy") == "linear":
            return tuple(linear(lo, hi, spec.get("step", lo)))
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from e
    raise ConfigError(f"{key}.strategy must be 'powers_of_two' or 'linear', got {spec.get('strategy')!r}")


def _section(cls: type, name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """Check a section's keys and value types against the dataclass defaults."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{name}] must be a table")
    known = {f.name: f for f in fields(cls)}
    if unknown := set(raw) - set(known):
        raise ConfigError(f"[{name}] unknown key(s) {sorted(unknown)}; allowed: {sorted(known)}")
    defaults = cls()
    for key, value in raw.items():
        want = getattr(defaults, key)
        if isinstance(want, int) and not isinstance(want, bool) and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise ConfigError(f"{name}.{key} must be a non-negative integer, got {value!r}")
        if isinstance(want, str) and not isinstance(value, str):
            raise ConfigError(f"{name}.{key} must be a string, got {value!r}")
    return dict(raw)


def _positive(section: str, obj: object, *names: str) -> None:
    for n in names:
        if getattr(obj, n) <= 0:
            raise ConfigError(f"{section}.{n} must be positive, got {getattr(obj, n)}")


def _build_buckets(raw: dict[str, Any], cache: CacheConfig) -> BucketConfig:
    if "prefill_batch_buckets" in raw:
        raise ConfigError(
            "buckets.prefill_batch_buckets was removed in 0.2: a prefill step now packs up to "
            "max_num_seqs requests end to end in one num_batched_tokens bucket; delete the key"
        )
    d = _section(BucketConfig, "buckets", raw)
    base = BucketConfig(
        max_num_seqs=d.get("max_num_seqs", BucketConfig.max_num_seqs),
        max_num_batched_tokens=d.get("max_num_batched_tokens", BucketConfig.max_num_batched_tokens),
        speculation_length=d.get("speculation_length", 0),
    )
    _positive("buckets", base, "max_num_seqs", "max_num_batched_tokens")
    lists: dict[str, Any] = {}
    limits = {
        "num_seqs_buckets": base.max_num_seqs,
        "num_batched_tokens_buckets": base.max_num_batched_tokens,
        "decode_context_length_buckets": cache.max_model_len,
    }
    for key, last in limits.items():
        if key not in d:
            continue
        sizes = _sizes(f"buckets.{key}", d[key], last)
        try:
            lists[key] = validate_buckets(f"buckets.{key}", sizes, last)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    if "num_seqs_buckets" not in d:
        lists["num_seqs_buckets"] = tuple(powers_of_two(1, base.max_num_seqs))
    if "num_batched_tokens_buckets" not in d:
        lists["num_batched_tokens_buckets"] = (base.max_num_batched_tokens,)
    if "decode_context_length_buckets" not in d:
        lists["decode_context_length_buckets"] = default_contexts(cache)
    for ctx in lists["decode_context_length_buckets"]:
        if ctx % cache.block_size:
            raise ConfigError(
                f"buckets.decode_context_length_buckets: {ctx} is not a multiple of "
                f"cache.block_size={cache.block_size}"
            )
    if base.speculation_length + 1 > cache.max_model_len:
        raise ConfigError("buckets.speculation_length must be below cache.max_model_len")
    return BucketConfig(**{**base.__dict__, **lists})


def default_contexts(cache: CacheConfig) -> tuple[int, ...]:
    """Decode contexts that keep a step's attention near its real context: powers of two from
    ``MIN_DEFAULT_CONTEXT`` (a block multiple) up to ``max_model_len``."""
    lo = -(-MIN_DEFAULT_CONTEXT // cache.block_size) * cache.block_size
    if lo >= cache.max_model_len:
        return (cache.max_model_len,)
    return tuple(c for c in powers_of_two(lo, cache.max_model_len) if c % cache.block_size == 0)


def parse_config(raw: dict[str, Any], base_dir: Path | None = None) -> Config:
    """Validate a parsed TOML document; relative model paths resolve against ``base_dir``."""
    sections = {"model", "cache", "buckets", "compile", "speculative"}
    if unknown := set(raw) - sections:
        raise ConfigError(f"unknown section(s) {sorted(unknown)}; allowed: {sorted(sections)}")
    model_raw = _section(ModelSource, "model", raw.get("model", {}))
    path = model_raw.get("path")
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"model.path must be a string (a directory), got {path!r}")
    if path is not None:
        path = Path(path) if base_dir is None else (base_dir / path)
    cache = CacheConfig(**_section(CacheConfig, "cache", raw.get("cache", {})))
    _positive("cache", cache, "block_size", "num_blocks", "max_model_len")
    if cache.dtype not in DTYPES:
        raise ConfigError(f"cache.dtype must be one of {DTYPES}, got {cache.dtype!r}")
    if cache.num_blocks - 1 < cache.max_model_len // max(cache.block_size, 1):
        # As in vLLM: the pool must hold one sequence of max_model_len beside the null block 0.
        raise ConfigError(
            f"cache.num_blocks={cache.num_blocks} cannot hold one sequence of max_model_len="
            f"{cache.max_model_len}: need at least {cache.max_model_len // cache.block_size + 1} "
            "(block 0 is the reserved null block)"
        )
    if cache.max_model_len % cache.block_size:
        # A bucket's block table has ctx // block_size columns; a partial last block would be cut off.
        raise ConfigError(
            f"cache.max_model_len={cache.max_model_len} must be a multiple of "
            f"cache.block_size={cache.block_size}"
        )
    comp_raw = _section(CompileConfig, "compile", raw.get("compile", {}))
    comp = CompileConfig(**comp_raw)
    if comp.backend not in BACKENDS:
        raise ConfigError(f"compile.backend must be one of {BACKENDS}, got {comp.backend!r}")
    if comp.executor not in EXECUTORS:
        raise ConfigError(f"compile.executor must be one of {EXECUTORS}, got {comp.executor!r}")
    _positive("compile", comp, "jobs", "task_cpus")
    if not isinstance(comp.flags, dict):
        raise ConfigError("compile.flags must be a table")
    try:
        spec_raw = _section(SpeculativeConfig, "speculative", raw.get("speculative", {}))
        speculative = SpeculativeConfig(**spec_raw)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return Config(ModelSource(path), cache, _build_buckets(raw.get("buckets", {}), cache), comp, speculative)


def load_config(path: str | Path | None = None) -> Config:
    """Load a TOML config file, or the embedded default (``manifests/default.toml``) for None."""
    if path is None:
        text = resources.files("neuron_buckets.manifests").joinpath("default.toml").read_text()
        return parse_config(tomllib.loads(text))
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    try:
        return parse_config(raw, path.parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e

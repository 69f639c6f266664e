"""Loading the TOML config: each table becomes the keyword arguments of its section, which checks
its own values (``setting.py``); the loader refuses names no section has, and keys that would do
nothing: a runtime file's keys (``RUN``) and keys the config's ``model.task`` has no use for.

Every key is known: a typo or an impossible value fails at once with the key's name and what is
allowed, instead of compiling hours of graphs for the wrong shapes.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from neuron_buckets.config.buckets import BucketConfig
from neuron_buckets.config.cache import CacheConfig
from neuron_buckets.config.compile import CompileConfig
from neuron_buckets.config.config import Config
from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.lora import LoraConfig
from neuron_buckets.config.model import ModelSource
from neuron_buckets.config.parallel import ParallelConfig
from neuron_buckets.config.setting import COMPILE, TASKS, for_task, read_by
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.utils.package_data import read_package_data

SECTIONS = {
    s.SECTION: s
    for s in (ModelSource, CacheConfig, BucketConfig, CompileConfig, SpeculativeConfig, ParallelConfig,
              LoraConfig)
}
# Why a task has no use for some keys.
IDLE = {
    "embed": "an embedding artifact only prefills: no decode steps, drafts or shared prompt blocks",
    "generate": "pooling settings are an embedding artifact's",
}
# Keys of earlier releases, with what replaced them.
REMOVED = {
    "buckets.prefill_batch_buckets": "was removed in 0.2: a prefill step now packs up to max_num_seqs "
    "requests end to end in one num_batched_tokens bucket; delete the key",
}


def table_arguments(name: str, raw: Any) -> dict[str, Any]:
    """One TOML table as keyword arguments of its section, every key known."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{name}] must be a table")
    for key in raw:
        if (why := REMOVED.get(f"{name}.{key}")) is not None:
            raise ConfigError(f"{name}.{key} {why}")
    known = sorted(f.name for f in fields(SECTIONS[name]))
    if unknown := set(raw) - set(known):
        raise ConfigError(f"[{name}] unknown key(s) {sorted(unknown)}; allowed: {known}")
    return dict(raw)


def _refuse_idle_keys(args: dict[str, dict[str, Any]]) -> None:
    """One line for the first key that nothing would read: a runtime file's key, or a key
    ``model.task`` has no use for."""
    task = args["model"].get("task", "generate")
    for name, given in args.items():
        section = SECTIONS[name]
        if run_only := sorted(set(given) - read_by(section, COMPILE)):
            raise ConfigError(
                f"{name}.{run_only[0]} is a run-time setting that nb compile does not record: give it "
                f"to nb generate or nb serve in a runtime file (--config, a [{name}] table) or by flag"
            )
        if task in TASKS and (idle := sorted(set(given) - for_task(section, task))):
            raise ConfigError(f'{name}.{idle[0]} does nothing for model.task = "{task}" ({IDLE[task]}): '
                              "delete it")


def parse_config(raw: dict[str, Any], base_dir: Path | None = None) -> Config:
    """Build a parsed TOML document's config; relative model paths (the target's and the
    draft's) resolve against ``base_dir``."""
    if unknown := set(raw) - set(SECTIONS):
        raise ConfigError(f"unknown section(s) {sorted(unknown)}; allowed: {sorted(SECTIONS)}")
    args = {name: table_arguments(name, raw.get(name, {})) for name in SECTIONS}
    _refuse_idle_keys(args)
    for section, key in (("model", "path"), ("speculative", "draft_model")):
        path = args[section].get(key)
        if base_dir is not None and isinstance(path, str):
            args[section][key] = base_dir / path
    return Config(**{name: SECTIONS[name](**a) for name, a in args.items()})


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's document, or one line naming the file and what is wrong with it."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e


def load_config(path: str | Path | None = None) -> Config:
    """Load a TOML config file, or the embedded default (``manifests/default.toml``) for None."""
    if path is None:
        text = read_package_data("default.toml")
        return parse_config(tomllib.loads(text))
    path = Path(path)
    raw = read_toml(path)
    try:
        return parse_config(raw, path.parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e

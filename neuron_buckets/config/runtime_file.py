"""A runtime file: the TOML ``nb generate`` and ``nb serve`` take with ``--config``.

It holds the settings a run reads (``RUN`` in ``setting.py``): today the ``[speculative]`` table's
drafting. Everything else of the compile config is built into the artifact, and its manifest
records what a run needs of it (cache geometry, buckets, prefix caching, pooling), so a compile
key here would be read by nothing: it is refused in one line, as a run-time key is in the compile
config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuron_buckets.config.config_error import ConfigError
from neuron_buckets.config.loader import SECTIONS, read_toml, table_arguments
from neuron_buckets.config.setting import RUN, read_by
from neuron_buckets.config.speculative import SpeculativeConfig


def parse_runtime_config(raw: dict[str, Any]) -> SpeculativeConfig:
    """A parsed runtime file's drafting; a table or key no run reads is refused."""
    runs = {name: sorted(keys) for name, section in SECTIONS.items() if (keys := read_by(section, RUN))}
    if compiled := sorted(set(raw) - set(runs)):
        raise ConfigError(
            f"[{compiled[0]}] is an nb compile setting, built into the artifact: a runtime file "
            f"(--config) takes only {', '.join(f'[{n}]' for n in runs)}"
        )
    args = {name: table_arguments(name, raw.get(name, {})) for name in runs}
    for name, given in args.items():
        if compiled := sorted(set(given) - set(runs[name])):
            raise ConfigError(
                f"{name}.{compiled[0]} is an nb compile setting, built into the artifact: a runtime "
                f"file's [{name}] takes {runs[name]}"
            )
    return SpeculativeConfig(**args[SpeculativeConfig.SECTION])


def load_runtime_config(path: str | Path) -> SpeculativeConfig:
    """Read a runtime file; its errors name it."""
    path = Path(path)
    raw = read_toml(path)
    try:
        return parse_runtime_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e

"""``nb plan``'s advice as config: the whole ``[cache]`` and ``[buckets]`` sections it depends on.

A plan that printed only its bucket lists left the rest to the reader: a context bucket beyond
``max_model_len``, a ``num_blocks`` too small for it. These sections are complete instead, so
they replace the same two sections of a config (``manifests/default.toml``, or the CONFIG the
trace was replayed on) as they are, and the plan builds them into a ``Config`` before it prints
them: what it prints loads.

With a CONFIG the plan keeps its limits (``max_model_len``, ``max_num_seqs``,
``max_num_batched_tokens``, the block size and dtype) and changes ``num_blocks`` only where the
replayed load needs more; each value that differs from the base config comes with one line
saying why.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace

from neuron_buckets.config import Config
from neuron_buckets.config.buckets import BucketConfig, default_contexts
from neuron_buckets.config.cache import CacheConfig


@dataclass(frozen=True)
class Limits:
    """What the plan serves: the limits kept or chosen, and the blocks its load holds at once."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    peak_blocks: int  # KV blocks the replayed requests hold at once, block 0 not counted
    why_max_model_len: str  # where max_model_len came from, for the change line


@dataclass(frozen=True)
class PlannedConfig:
    cache: dict[str, object]
    buckets: dict[str, object]
    changes: tuple[str, ...]  # one line per value that differs from the base config, with why
    header: tuple[str, ...]  # comment lines above the sections

    @classmethod
    def of(cls, base: Config, doc: dict, limits: Limits, header: tuple[str, ...]) -> PlannedConfig:
        """The sections for ``nb plan``'s document ``doc`` on top of ``base``; checked by
        building them into a Config, so a plan that cannot load fails here, not in the user's."""
        c, b = base.cache, base.buckets
        geometry = limits.max_model_len // c.block_size + 1  # one sequence beside the null block
        num_blocks = max(c.num_blocks, geometry, limits.peak_blocks + 1)
        prefill = (doc.get("replay") or doc["prefill"])["buckets"]
        decode = doc["decode"]
        context = doc.get("context")
        cache = {
            "block_size": c.block_size,
            "num_blocks": num_blocks,
            "max_model_len": limits.max_model_len,
            "dtype": c.dtype,
            "enable_prefix_caching": c.enable_prefix_caching,
        }
        buckets = {
            "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": limits.max_num_batched_tokens,
            "num_seqs_buckets": decode["buckets"] if decode else None,
            "num_batched_tokens_buckets": list(prefill),
            "decode_context_length_buckets": (
                context["buckets"] if context else [*default_contexts(c.block_size, limits.max_model_len)]
            ),
            "speculation_length": b.speculation_length,
        }
        if base.model.embeds:  # an embedding config has prefill buckets only, and refuses decode keys
            del cache["enable_prefix_caching"]
            for key in ("num_seqs_buckets", "decode_context_length_buckets", "speculation_length"):
                del buckets[key]
        elif buckets["num_seqs_buckets"] is None:  # no arrivals to plan from: the derived default
            derived = BucketConfig(max_num_seqs=limits.max_num_seqs).num_seqs_buckets
            buckets["num_seqs_buckets"] = list(derived or ())
        why = {
            "cache.max_model_len": limits.why_max_model_len,
            "cache.num_blocks": (
                f"the replayed requests hold up to {limits.peak_blocks:,} blocks at once"
                if num_blocks == limits.peak_blocks + 1
                else f"one sequence of max_model_len {limits.max_model_len} needs {geometry:,} blocks"
            ),
            "buckets.max_num_seqs": "--max-num-seqs",
            "buckets.max_num_batched_tokens": "the largest prefill bucket (longer prompts run in chunks)",
        }
        before = {"cache.num_blocks": c.num_blocks, "cache.max_model_len": c.max_model_len,
                  "buckets.max_num_seqs": b.max_num_seqs,
                  "buckets.max_num_batched_tokens": b.max_num_batched_tokens}  # fmt: skip
        after = {f"cache.{k}": v for k, v in cache.items()} | {f"buckets.{k}": v for k, v in buckets.items()}
        changes = tuple(
            f"changes {key} {old} -> {after[key]}: {why[key]}"
            for key, old in before.items()
            if after[key] != old
        )
        planned = cls(cache, buckets, changes, header)
        planned.check(base)
        return planned

    def check(self, base: Config) -> Config:
        """The base config with these sections, through every rule a config file meets."""
        buckets = {k: tuple(v) if isinstance(v, list) else v for k, v in self.buckets.items()}
        return replace(base, cache=CacheConfig(**self.cache), buckets=BucketConfig(**buckets))

    def toml(self) -> str:
        """The header as comments (wrapped to fit 80 columns), then ``[cache]`` and ``[buckets]``
        with every key."""
        lines = [
            wrapped
            for line in (*self.header, *self.changes)
            for wrapped in textwrap.wrap(line, 78, initial_indent="# ", subsequent_indent="#   ")
        ]
        for name, section in (("cache", self.cache), ("buckets", self.buckets)):
            lines.append(f"[{name}]")
            lines += [f"{key} = {_value(v)}" for key, v in section.items()]
        return "\n".join(lines) + "\n"


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)

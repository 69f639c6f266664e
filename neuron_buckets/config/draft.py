"""The draft model's own config: what ``nb compile`` builds into an artifact's ``draft/``.

A draft model (``[speculative] method = "draft_model"``) is compiled by the same pipeline as the
target, from the same config but its own checkpoint: the same cache geometry (block size, block
count, max_model_len, dtype), so the target's block ids index the draft's cache too, and the same
prefill buckets, so the draft prefills every chunk the target does in the same calls. Its decode
rows carry one token: the draft proposes one token per call, k calls per target step.
"""

from __future__ import annotations

from dataclasses import replace

from neuron_buckets.config.config import Config
from neuron_buckets.config.model import ModelSource
from neuron_buckets.config.speculative import SpeculativeConfig

DRAFT = "draft"  # the draft's sub-artifact, a directory inside the target's artifact


def draft_config(config: Config) -> Config | None:
    """The config that compiles ``config``'s draft model, or None without one."""
    spec = config.speculative
    if not spec.uses_draft_model:
        return None
    return replace(
        config,
        model=ModelSource(spec.draft_model),
        buckets=replace(config.buckets, speculation_length=0),
        speculative=SpeculativeConfig(),
    )

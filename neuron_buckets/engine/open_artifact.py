"""What serves an artifact directory, decided once from one reading of its manifest.

A tensor-parallel artifact's rank other than 0 follows rank 0 (``RankFollower``); an embedding
artifact is served by its ``Embedder``; any other by an ``LLMEngine``. The options that do not
fit the artifact's kind are refused in one line before any weight is read.
"""

from __future__ import annotations

from pathlib import Path

from neuron_buckets.artifact.manifest_versions import newest_complete
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.engine.embedder import Embedder
from neuron_buckets.engine.llm_engine import LLMEngine
from neuron_buckets.runtime.rank_worker import RankFollower, follower
from neuron_buckets.utils.errors import UserError

# What a server that cannot do what a route asks says, naming why (400).
NOT_EMBEDDING = ('this artifact was compiled for generation: /v1/embeddings needs an embedding artifact '
                 '(nb compile with [model] task = "embed")')
NOT_GENERATION = ('this artifact was compiled for embeddings ([model] task = "embed"): it has no decode '
                  "graphs or LM head, so it serves /v1/embeddings only")


def open_artifact(
    directory: Path,
    speculative: SpeculativeConfig | None = None,
    preload: bool = False,
    pooling: str | None = None,
) -> LLMEngine | Embedder | RankFollower:
    """The engine, embedder or rank follower that serves ``directory``: drafting as
    ``speculative`` says, every graph loaded now with ``preload``, an embedding artifact pooling
    as ``pooling`` says (else as compiled). A follower has loaded nothing yet: ``run`` it. The
    buckets are those of the newest complete manifest version (``nb replan`` writes them)."""
    _, manifest = newest_complete(directory)
    if (rank := follower(directory, manifest)) is not None:
        return rank
    if manifest.embedding is not None:
        if speculative is not None:  # a runtime file or a flag, which nothing here would read
            raise UserError("an embedding artifact does not decode: drop the speculative options")
        return Embedder.open(directory, pooling=pooling, preload=preload, manifest=manifest)
    if pooling is not None:
        raise UserError(f"--pooling: {NOT_EMBEDDING}")
    return LLMEngine.open(directory, speculative=speculative, preload=preload, manifest=manifest)

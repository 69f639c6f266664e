"""What speculative decoding costs in graphs and compile time, for ``nb inspect``.

Two things cost graphs: the target's decode graphs carry rows of ``1 + speculation_length``
tokens (the verify rows; as many graphs as without speculation, each wider), and a draft model
(``[speculative] method = "draft_model"``) brings its own buckets in the artifact's ``draft/``.
A draft piece with the key of a target piece (a draft of the target's shapes) was linked from the
graph cache, not compiled again, so only the draft's own pieces count as its cost. From a config
alone only the bucket counts are known; from an artifact, the measured seconds and bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from neuron_buckets.artifact.manifest import MANIFEST, Manifest, PieceRecord, read_manifest
from neuron_buckets.config import Config, enumerate_grid
from neuron_buckets.config.draft import DRAFT, draft_config


def _sums(pieces: Iterable[PieceRecord]) -> dict:
    pieces = list(pieces)
    return {"pieces": len(pieces), "compile_seconds": round(sum(p.compile_seconds for p in pieces), 3),
            "bytes": sum(p.bytes for p in pieces)}  # fmt: skip


def _decode_pieces(manifest: Manifest) -> dict[str, PieceRecord]:
    keys = {k for b in manifest.buckets if b.kind == "decode" for k in b.pieces.values()}
    keys -= {k for b in manifest.buckets if b.kind == "prefill" for k in b.pieces.values()}  # shared
    return {k: manifest.pieces[k] for k in keys if k in manifest.pieces}


def measured_speculation(directory: Path) -> dict | None:
    """The artifact's speculation costs, measured; None when it was compiled without any."""
    target = read_manifest(directory)
    k = target.decode.speculation_length
    has_draft = (directory / DRAFT / MANIFEST).is_file()
    if not k and not has_draft:
        return None
    doc = {"speculation_length": k, "target": _sums(target.pieces.values()),
           "verify": _sums(_decode_pieces(target).values()), "draft": None}  # fmt: skip
    if has_draft:
        draft = read_manifest(directory / DRAFT)
        own = [p for key, p in draft.pieces.items() if key not in target.pieces]
        weights = draft.weights.bytes if draft.weights else 0
        doc["draft"] = {"buckets": len(draft.buckets), "shared_pieces": len(draft.pieces) - len(own),
                        **_sums(own), "weights_bytes": weights}  # fmt: skip
    return doc


def planned_speculation(config: Config) -> dict | None:
    """The config's speculation in buckets: the target's verify rows and the draft's buckets."""
    k = config.buckets.speculation_length
    draft = draft_config(config)
    if not k and draft is None:
        return None
    target = enumerate_grid(config)
    return {"speculation_length": k, "target_buckets": len(target),
            "verify_buckets": sum(b.kind == "decode" for b in target),
            "draft_buckets": len(enumerate_grid(draft)) if draft else 0}  # fmt: skip

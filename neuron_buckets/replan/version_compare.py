"""``nb inspect --manifest DIR --versions A,B``: two manifest versions of one artifact on a trace.

Each version's token buckets are scored on the same replayed calls ``nb replan`` scores its
candidates on (``bucket_choice.served_calls``: the trace through the engine's scheduler on the
artifact's limits, cut by the budget alone), so the figures say what a swap from one to the
other changes in prefill padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from neuron_buckets.artifact.manifest_versions import read_version
from neuron_buckets.replan.artifact_config import config_of
from neuron_buckets.replan.bucket_choice import served_calls
from neuron_buckets.runtime.bucket_stats import padding_share
from neuron_buckets.traffic.padding_stats import padding_stats
from neuron_buckets.traffic.traces import Trace


def compare_versions(directory: Path, versions: Sequence[int], trace: Trace) -> dict:
    """Per version: its token buckets and the padding they compute on the trace's calls."""
    manifests = {v: read_version(directory, v) for v in versions}
    limits = {(m.decode, m.cache) for m in manifests.values()}
    if len(limits) > 1:
        raise ValueError(f"{directory}: versions {list(versions)} have other limits or cache geometry; "
                         "only versions nb replan wrote beside one manifest.json compare")
    tokens = served_calls(config_of(manifests[versions[0]]), trace)
    real = int(tokens.sum())
    rows = []
    for v, m in manifests.items():
        buckets = sorted({b.seq for b in m.buckets if b.kind == "prefill"})
        computed = int(padding_stats(tokens, buckets).padded_total)
        rows.append({"version": v, "token_buckets": buckets, "calls": len(tokens), "real_tokens": real,
                     "computed_tokens": computed, "padding_tokens": computed - real,
                     "padding_share": padding_share(real, computed)})
    return {"versions": rows}

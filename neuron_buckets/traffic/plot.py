"""``nb inspect --plot``: where prompts fall against the buckets, and what each bucket wastes.

Uses matplotlib's object API with the Agg canvas, so it needs no display and touches no global
pyplot state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def plot_padding(path: str | Path, prompt_lens: np.ndarray, prefill: dict) -> None:
    """Top: prompt-length histogram with a line per bucket. Bottom: padded minus real tokens per
    bucket (the compute each bucket wastes) from an ``nb inspect`` prefill section."""
    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1)
    buckets = prefill["buckets"]
    top.hist(prompt_lens, bins=min(200, max(10, len(np.unique(prompt_lens)))), color="tab:blue")
    for b in buckets:
        top.axvline(b, color="tab:red", linestyle="--", linewidth=1)
    top.set_xlim(0, max(buckets[-1], int(prompt_lens.max())) * 1.02)
    top.set_xlabel("prompt tokens (dashed: prefill buckets)")
    top.set_ylabel("requests")
    top.set_title(
        f"{prefill['requests']:,} prompts, padding {100 * prefill['padding_ratio']:.1f}% "
        f"({prefill['chunked_requests']:,} chunked)"
    )
    per = prefill["per_bucket"]
    waste = [b["padded_tokens"] - b["real_tokens"] for b in per]
    labels = [str(b["seq"]) for b in per]
    bars = bottom.bar(labels, waste, color="tab:orange")
    ratios = ["-" if b["padding_ratio"] is None else f"{100 * b['padding_ratio']:.0f}%" for b in per]
    bottom.bar_label(bars, labels=ratios, fontsize=8)
    bottom.set_xlabel("bucket (tokens)")
    bottom.set_ylabel("padded tokens wasted")
    fig.savefig(path, dpi=100)

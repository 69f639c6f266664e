"""``nb inspect --plot``: where prompts fall against the buckets, and what each bucket computes.

Meant to be read in seconds: the title names the bucket source, the requests the config refuses
and the padding share; lengths span three decades, so the length axis is logarithmic and every
bucket line carries its size; each bar is a bucket's computed tokens split into real and padding,
labelled with its padding share. Uses matplotlib's object API with the Agg canvas, so it needs
no display and touches no global pyplot state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter


def plot_title(prefill: dict, refused: dict, source: str) -> str:
    """What the figure shows, in two lines: the buckets' source, what they served and refused,
    and the padding share of what they computed."""
    limit = refused["max_model_len"]
    dropped = (
        f"{refused['requests']:,} of {refused['of']:,} refused (longer than max_model_len {limit:,})"
        if refused["requests"]
        else "none refused"
    )
    return (
        f"{source}: {prefill['requests']:,} prompts served, {dropped}\n"
        f"prefill padding share {100 * prefill['padding_share']:.1f}% of computed tokens"
    )


def plot_padding(
    path: str | Path, prompt_lens: np.ndarray, prefill: dict, refused: dict, source: str
) -> None:
    """Top: the served prompts' lengths on a log axis, a labelled line per bucket. Bottom: each
    bucket's computed tokens, real and padding stacked, from an ``nb inspect`` prefill section."""
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1)
    fig.suptitle(plot_title(prefill, refused, source), fontsize=11)
    buckets = prefill["buckets"]
    lo, hi = max(1, int(prompt_lens.min())), max(buckets[-1], int(prompt_lens.max()))
    bins = np.geomspace(lo, hi * 1.05, 80)
    top.hist(prompt_lens, bins=bins, color="tab:blue")
    top.set_xscale("log")
    top.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    for b in buckets:
        top.axvline(b, color="tab:red", linestyle="--", linewidth=1)
        top.annotate(str(b), (b, 1.0), xycoords=("data", "axes fraction"), xytext=(-2, -2),
                     textcoords="offset points", rotation=90, fontsize=8, ha="right", va="top",
                     color="tab:red")  # fmt: skip
    top.set_xlabel("prompt tokens, log scale (dashed red: prefill buckets)")
    top.set_ylabel("requests")
    per = prefill["per_bucket"]
    labels = [str(b["seq"]) for b in per]
    real = np.array([b["real_tokens"] for b in per], dtype=float)
    padding = np.array([b["computed_tokens"] - b["real_tokens"] for b in per], dtype=float)
    bottom.bar(labels, real, color="tab:blue", label="real tokens")
    bars = bottom.bar(labels, padding, bottom=real, color="tab:orange", label="padding tokens")
    shares = ["" if b["padding_share"] is None else f"{100 * b['padding_share']:.0f}% padding" for b in per]
    bottom.bar_label(bars, labels=shares, fontsize=8)
    bottom.set_xlabel("prefill bucket (tokens per graph call)")
    bottom.set_ylabel("computed tokens")
    bottom.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
    bottom.margins(y=0.12)
    bottom.legend(loc="upper left")
    fig.savefig(path, dpi=100)

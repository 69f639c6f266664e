"""``nb inspect`` and ``nb plan``: what a bucket set costs on real traffic, and the best set.

``--json`` prints one document to stdout and nothing else (logs go to stderr), so scripts can pipe
it; without it the same document is shown as rich tables.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from neuron_buckets.cli.console import err, int_list, out
from neuron_buckets.config import Config, enumerate_grid, load_config
from neuron_buckets.core.bucket import powers_of_two, validate_buckets
from neuron_buckets.traffic.compile_cost import ManifestBuckets, load_manifest_buckets
from neuron_buckets.traffic.padding_stats import inspect_trace
from neuron_buckets.traffic.planner import PlanOptions, plan
from neuron_buckets.traffic.report import print_bucket_plan, print_inspect, toml_snippet
from neuron_buckets.traffic.runtime_replay import fit_requests, packed_report, prefix_report, replay_runtime
from neuron_buckets.traffic.speculation_cost import measured_speculation, planned_speculation
from neuron_buckets.traffic.trace_prompts import trace_prompts
from neuron_buckets.traffic.traces import Trace, load_trace

DEFAULT_MAX_NUM_SEQS = 64  # decode slots when neither a config nor a manifest says


TRACE_HELP = (
    "Trace file, CSV or JSONL, with ContextTokens/GeneratedTokens, input_length/output_length or "
    "num_prefill_tokens/num_decode_tokens columns and an optional TIMESTAMP or timestamp"
)
TraceOpt = Annotated[Path, typer.Option("--trace", help=TRACE_HELP)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout")]
ManifestOpt = Annotated[
    Path | None,
    typer.Option("--manifest", help="Artifact directory: its buckets and measured compile costs"),
]
RateOpt = Annotated[
    float, typer.Option("--decode-rate", help="Decode tokens per second per request in the replay")
]
SeqsOpt = Annotated[
    int | None, typer.Option("--max-num-seqs", help="Decode slots in the replay (at most this many)")
]


def _ints(option: str, text: str) -> tuple[int, ...]:
    """'128,256,512' -> (128, 256, 512), a valid bucket list, or a ValueError naming the option."""
    return validate_buckets(option, int_list(option, text))


def _load(trace_path: Path) -> Trace:
    start = time.perf_counter()
    trace = load_trace(trace_path)
    err.print(
        f"loaded {len(trace):,} requests ({trace.source}) from {trace_path} "
        f"in {time.perf_counter() - start:.2f} s",
        highlight=False,
    )
    return trace


def _emit(doc: dict, as_json: bool, render) -> None:
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        render(out, doc)


def inspect(
    trace: TraceOpt,
    config: Annotated[
        Path | None, typer.Argument(help="TOML config whose buckets to inspect; default: embedded")
    ] = None,
    prefill_buckets: Annotated[
        str | None, typer.Option("--prefill-buckets", help="Prefill token buckets, e.g. 128,256,512")
    ] = None,
    num_seqs_buckets: Annotated[
        str | None, typer.Option("--num-seqs-buckets", help="Decode batch buckets, e.g. 1,2,4,8")
    ] = None,
    manifest: ManifestOpt = None,
    max_num_seqs: SeqsOpt = None,
    decode_rate: RateOpt = 30.0,
    as_json: JsonOpt = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of lengths and padding")] = None,
    replay_requests: Annotated[
        int, typer.Option("--replay-requests", min=1, help="Requests of the trace the packed replay runs")
    ] = 1000,
    trace_block_size: Annotated[
        int, typer.Option("--trace-block-size", min=1, help="Tokens per hash_ids block of a Mooncake trace")
    ] = 512,
) -> None:
    """Padding, decode batch sizes and compile cost of a bucket set on a trace; with a config, also
    what the runtime does: the trace replayed through its scheduler and packing (``packed``), and
    for a trace with ``hash_ids`` the prefix cache's hits, evictions and prefill tokens saved.
    What speculation costs in graphs (``speculation``): measured with --manifest, counted in
    buckets with a config."""
    built = load_manifest_buckets(manifest) if manifest else None
    prefill, num_seqs = _bucket_sets(config, built, prefill_buckets, num_seqs_buckets)
    slots = max_num_seqs or num_seqs[-1]  # the grid rule: the last num_seqs bucket
    data = _load(trace)
    doc = inspect_trace(data, prefill, num_seqs, slots, decode_rate, built.cost if built else None)
    if built is None and prefill_buckets is None and num_seqs_buckets is None:
        doc["packed"] = _packed(load_config(config), data, replay_requests, trace_block_size)
    spec = measured_speculation(manifest) if manifest else planned_speculation(load_config(config))
    if spec is not None:
        doc["speculation"] = spec
    if plot is not None:
        from neuron_buckets.traffic.plot import plot_padding  # matplotlib: only when asked

        plot_padding(plot, data.prompt_lens, doc["prefill"])
        err.print(f"wrote {plot}", highlight=False)
    _emit(doc, as_json, print_inspect)


def _packed(config: Config, trace: Trace, limit: int, trace_block_size: int) -> dict:
    """The runtime's calls and padding for the first ``limit`` requests of the trace; with the
    trace's ``hash_ids``, also its prefix-cache hits at the configured cache size."""
    cache = config.cache
    lens, outputs = fit_requests(trace.prompt_lens, trace.output_lens, cache.max_model_len, limit)
    prompts = None
    if trace.hash_ids is not None:
        prompts = trace_prompts(trace.hash_ids[: len(lens)], lens, trace_block_size)
    counters, pool = replay_runtime(
        lens, outputs, enumerate_grid(config), cache.num_blocks, cache.block_size, prompts,
        cache.enable_prefix_caching,
    )
    doc = packed_report(counters, len(lens))
    if prompts is not None:
        doc["prefix_cache"] = prefix_report(pool)
    return doc


def _bucket_sets(
    config: Path | None, built: ManifestBuckets | None, prefill: str | None, num_seqs: str | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prefill and num_seqs buckets from (in order of precedence) the options, the CONFIG, the
    manifest, or the embedded default config; a bare --prefill-buckets gets powers-of-two
    num_seqs buckets up to DEFAULT_MAX_NUM_SEQS."""
    if config is not None or (built is None and prefill is None):
        b = load_config(config).buckets
        base = (b.num_batched_tokens_buckets, b.num_seqs_buckets)
    elif built is not None:
        base = (built.prefill, built.num_seqs)
    else:
        base = ((), tuple(powers_of_two(1, DEFAULT_MAX_NUM_SEQS)))
    chosen_prefill = _ints("--prefill-buckets", prefill) if prefill else base[0]
    if not chosen_prefill:
        raise ValueError("the manifest has no single-row prefill buckets; pass --prefill-buckets")
    return chosen_prefill, _ints("--num-seqs-buckets", num_seqs) if num_seqs else base[1]


def plan_cmd(
    trace: TraceOpt,
    graphs: Annotated[int, typer.Option("--graphs", min=1, help="At most this many prefill graphs")],
    align: Annotated[int, typer.Option("--align", min=1, help="Prefill buckets are multiples of this")] = 64,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option("--max-num-batched-tokens", min=1, help="Largest prefill bucket allowed"),
    ] = None,
    max_num_seqs: SeqsOpt = DEFAULT_MAX_NUM_SEQS,
    decode_graphs: Annotated[
        int | None,
        typer.Option("--decode-graphs", min=1, help="num_seqs buckets; default: as many as powers of two"),
    ] = None,
    decode_rate: RateOpt = 30.0,
    manifest: ManifestOpt = None,
    max_compile_seconds: Annotated[
        float | None,
        typer.Option("--max-compile-seconds", help="Budget for all graphs (needs --manifest)"),
    ] = None,
    holdout_split: Annotated[
        float | None,
        typer.Option("--holdout-split", help="Fit on this first fraction by arrival, report the rest"),
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option("--max-model-len", min=1, help="Largest decode context; default: the longest request"),
    ] = None,
    context_graphs: Annotated[
        int | None,
        typer.Option("--context-graphs", min=1, help="Decode context buckets; default: as the grid"),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Choose the prefill buckets, num_seqs buckets and decode context buckets that minimise
    padding on a trace."""
    opts = PlanOptions(
        graphs=graphs,
        align=align,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        decode_graphs=decode_graphs,
        tokens_per_s=decode_rate,
        max_compile_seconds=max_compile_seconds,
        holdout_split=holdout_split,
        max_model_len=max_model_len,
        context_graphs=context_graphs,
    )
    cost = load_manifest_buckets(manifest).cost if manifest else None
    data = _load(trace)
    start = time.perf_counter()
    doc = plan(data, opts, cost)
    err.print(f"planned in {time.perf_counter() - start:.3f} s", highlight=False)
    doc["toml"] = toml_snippet(doc, trace.name)
    _emit(doc, as_json, print_bucket_plan)


def register(app: typer.Typer) -> None:
    """Add ``inspect`` and ``plan`` to the ``nb`` app."""
    app.command("inspect")(inspect)
    app.command("plan")(plan_cmd)

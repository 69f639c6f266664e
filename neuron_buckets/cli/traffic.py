"""``nb inspect`` and ``nb plan``: what a bucket set costs on real traffic, and the best set.

``--json`` prints one document to stdout and nothing else (logs go to stderr), so scripts can pipe
it; without it the same document is shown as rich tables.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from neuron_buckets.cli.console import err, int_list, out
from neuron_buckets.config import Config, enumerate_grid, load_config
from neuron_buckets.config.buckets import DEFAULT_MAX_NUM_SEQS
from neuron_buckets.core.bucket import powers_of_two, validate_buckets
from neuron_buckets.traffic.compile_cost import ManifestBuckets, load_manifest_buckets, manifest_ranks
from neuron_buckets.traffic.padding_stats import inspect_trace, peak_blocks
from neuron_buckets.traffic.planned_config import Limits, PlannedConfig
from neuron_buckets.traffic.planner import DEFAULT_TOKEN_BUDGET, PlanOptions, plan, plan_replayed
from neuron_buckets.traffic.replay_load import STEP_S, TOKEN_S, ReplayLoad
from neuron_buckets.traffic.report import plan_header, print_bucket_plan, print_inspect
from neuron_buckets.traffic.runtime_replay import (
    Replay,
    fit_requests,
    packed_report,
    prefix_report,
    replay_runtime,
)
from neuron_buckets.traffic.speculation_cost import measured_speculation, planned_speculation
from neuron_buckets.traffic.trace_prompts import trace_prompts
from neuron_buckets.traffic.traces import Trace, load_trace

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
ConcurrencyOpt = Annotated[
    int | None,
    typer.Option("--concurrency", min=1, help="Runtime replay in a closed loop: this many in flight"),
]
ArrivalsOpt = Annotated[
    bool, typer.Option("--arrivals", help="Runtime replay: requests join at the trace's arrival times")
]
StepSecondsOpt = Annotated[
    float, typer.Option("--step-seconds", min=0.0, help="Replayed clock (--arrivals): seconds per step")
]
TokenSecondsOpt = Annotated[
    float, typer.Option("--token-seconds", min=0.0, help="Replayed clock (--arrivals): seconds per token")
]
ReplayRequestsOpt = Annotated[
    int, typer.Option("--replay-requests", min=1, help="Requests of the trace the runtime replay runs")
]
TraceBlockOpt = Annotated[
    int, typer.Option("--trace-block-size", min=1, help="Tokens per hash_ids block of a Mooncake trace")
]
ConfigArg = Annotated[
    Path | None, typer.Argument(help="TOML config whose buckets to inspect; default: embedded")
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
    config: ConfigArg = None,
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
    replay_requests: ReplayRequestsOpt = 1000,
    trace_block_size: TraceBlockOpt = 512,
    concurrency: ConcurrencyOpt = None,
    arrivals: ArrivalsOpt = False,
    step_seconds: StepSecondsOpt = STEP_S,
    token_seconds: TokenSecondsOpt = TOKEN_S,
    versions: Annotated[
        str | None,
        typer.Option("--versions", metavar="A,B",
                     help="With --manifest: compare these manifest versions' token buckets (nb replan)"),
    ] = None,
) -> None:
    """Padding, decode batch sizes and compile cost of a bucket set on a trace.

    With a config, also what its runtime does: the trace replayed through its scheduler and
    packing (all requests at once, or --concurrency, --arrivals), and for a trace with hash_ids
    the prefix cache's hits, evictions and prefill tokens saved; and what speculation costs in
    graphs (measured with --manifest, counted in buckets with a config). Requests longer than
    the config's max_model_len are counted first and left out of every figure. With --manifest
    and --versions, the prefill padding of each manifest version's token buckets instead."""
    if versions is not None:
        if manifest is None:
            raise ValueError("--versions compares manifest versions of an artifact: pass --manifest DIR")
        from neuron_buckets.replan.version_compare import compare_versions

        chosen = int_list("--versions", versions)
        _emit(compare_versions(manifest, chosen, _load(trace)), as_json, print_versions)
        return
    built = load_manifest_buckets(manifest) if manifest else None
    prefill, num_seqs, limit = _bucket_sets(config, built, prefill_buckets, num_seqs_buckets)
    slots = max_num_seqs or num_seqs[-1]  # the grid rule: the last num_seqs bucket
    replays = built is None and prefill_buckets is None and num_seqs_buckets is None
    if not replays and (concurrency is not None or arrivals):
        raise ValueError(
            "--concurrency and --arrivals replay a config's grid: pass a CONFIG, not --manifest or buckets"
        )
    data, refused = _servable(_load(trace), limit)
    load = _replay_load(data, concurrency, arrivals, step_seconds, token_seconds)
    doc = {"refused": refused}  # first: every figure after it leaves these requests out
    doc |= inspect_trace(data, prefill, num_seqs, slots, decode_rate, built.cost if built else None)
    if replays:
        doc["packed"] = _packed(load_config(config), data, replay_requests, trace_block_size, load)[0]
    if manifest:
        doc["ranks"] = manifest_ranks(manifest)
    spec = measured_speculation(manifest) if manifest else planned_speculation(load_config(config))
    if spec is not None:
        doc["speculation"] = spec
    if plot is not None:
        from neuron_buckets.traffic.plot import plot_padding  # matplotlib: only when asked

        plot_padding(plot, data.prompt_lens, doc["prefill"], refused, _source(config, built, prefill_buckets))
        err.print(f"wrote {plot}", highlight=False)
    _emit(doc, as_json, print_inspect)


def print_versions(console: Console, doc: dict) -> None:
    table = Table(title="prefill padding per manifest version")
    for col in ("version", "token buckets", "calls", "real tokens", "computed tokens", "padding share"):
        table.add_column(col)
    for r in doc["versions"]:
        table.add_row(str(r["version"]), ",".join(map(str, r["token_buckets"])), f"{r['calls']:,}",
                      f"{r['real_tokens']:,}", f"{r['computed_tokens']:,}", f"{r['padding_share']:.1%}")
    console.print(table)


def _source(config: Path | None, built: ManifestBuckets | None, prefill: str | None) -> str:
    """Where the inspected buckets came from, for the plot's title."""
    if prefill is not None:
        return "--prefill-buckets"
    if built is not None:
        return "--manifest"
    return config.name if config is not None else "embedded default config"


def _servable(trace: Trace, max_model_len: int | None) -> tuple[Trace, dict]:
    """The requests a server with ``max_model_len`` runs, and the ``refused`` report of the rest
    (requests, of how many, the limit); every figure is then of the requests it runs."""
    kept = trace if max_model_len is None else trace.servable(max_model_len)
    refused = {"requests": len(trace) - len(kept), "of": len(trace), "max_model_len": max_model_len}
    if refused["requests"]:
        err.print(
            f"{refused['requests']:,} of {len(trace):,} requests are longer than cache.max_model_len "
            f"({max_model_len}, prompt + output): a server refuses them; they are left out",
            highlight=False,
        )
    if not len(kept):
        raise ValueError(
            f"no request of the trace fits cache.max_model_len ({max_model_len}): raise it for this trace"
        )
    return kept, refused


def _replay_load(
    trace: Trace, concurrency: int | None, arrivals: bool, step_s: float, token_s: float
) -> ReplayLoad:
    if arrivals and trace.arrivals is None:
        raise ValueError("--arrivals: the trace has no TIMESTAMP or timestamp column")
    return ReplayLoad.of(concurrency, trace.arrivals if arrivals else None, step_s, token_s)


def _packed(
    config: Config, trace: Trace, limit: int, trace_block_size: int, load: ReplayLoad,
    fit_buckets: bool = True,
) -> tuple[dict, Replay]:
    """The runtime's calls and padding for the first ``limit`` requests of the trace, replayed as
    ``load`` says (steps cut at the config's token buckets as the engine cuts them, unless
    ``fit_buckets`` is off); with the trace's ``hash_ids``, also its prefix-cache hits at the
    configured cache size. The report, and the replay (its calls)."""
    cache = config.cache
    lens, outputs = fit_requests(trace.prompt_lens, trace.output_lens, cache.max_model_len, limit)
    if config.model.embeds:  # an embedding request ends with its prefill: it decodes nothing
        outputs = [1] * len(lens)
    prompts = None
    if trace.hash_ids is not None:
        prompts = trace_prompts(trace.hash_ids[: len(lens)], lens, trace_block_size)
    replay = replay_runtime(
        lens, outputs, enumerate_grid(config), cache.num_blocks, cache.block_size, prompts,
        cache.enable_prefix_caching, load, fit_buckets,
    )
    doc = packed_report(replay, len(lens), load)
    if prompts is not None:
        doc["prefix_cache"] = prefix_report(replay.pool)
    return doc, replay


def _bucket_sets(
    config: Path | None, built: ManifestBuckets | None, prefill: str | None, num_seqs: str | None
) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
    """Prefill and num_seqs buckets from (in order of precedence) the options, the CONFIG, the
    manifest, or the embedded default config; a bare --prefill-buckets gets powers-of-two
    num_seqs buckets up to DEFAULT_MAX_NUM_SEQS. Then the max_model_len they serve (None for
    bare options: no limit is known)."""
    limit = None
    if config is not None or (built is None and prefill is None):
        cfg = load_config(config)
        b, limit = cfg.buckets, cfg.cache.max_model_len
        base = (b.num_batched_tokens_buckets, b.num_seqs_buckets)
    elif built is not None:
        base, limit = (built.prefill, built.num_seqs), built.cost.contexts[-1]
    else:
        base = ((), tuple(powers_of_two(1, DEFAULT_MAX_NUM_SEQS)))
    chosen_prefill = _ints("--prefill-buckets", prefill) if prefill else base[0]
    if not chosen_prefill:
        raise ValueError("the manifest has no single-row prefill buckets; pass --prefill-buckets")
    return chosen_prefill, _ints("--num-seqs-buckets", num_seqs) if num_seqs else base[1], limit


def plan_cmd(
    trace: TraceOpt,
    graphs: Annotated[int, typer.Option("--graphs", min=1, help="At most this many prefill graphs")],
    config: Annotated[
        Path | None,
        typer.Argument(help="TOML config to replay the trace on (all at once, or --concurrency, --arrivals)"),
    ] = None,
    align: Annotated[int, typer.Option("--align", min=1, help="Prefill buckets are multiples of this")] = 64,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-num-batched-tokens", min=1,
            help="Largest prefill bucket; longer prompts run in chunks (default: the CONFIG's, else "
            f"{DEFAULT_TOKEN_BUDGET})",
        ),
    ] = None,
    max_num_seqs: SeqsOpt = None,
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
        typer.Option(
            "--max-model-len", min=1,
            help="Longest request (prompt + output) served; default: the config's, else the trace's longest",
        ),
    ] = None,
    context_graphs: Annotated[
        int | None,
        typer.Option("--context-graphs", min=1, help="Decode context buckets; default: as the grid"),
    ] = None,
    concurrency: ConcurrencyOpt = None,
    arrivals: ArrivalsOpt = False,
    step_seconds: StepSecondsOpt = STEP_S,
    token_seconds: TokenSecondsOpt = TOKEN_S,
    replay_requests: ReplayRequestsOpt = 1000,
    trace_block_size: TraceBlockOpt = 512,
    out: Annotated[
        Path | None, typer.Option("--out", help="Also write the [cache] and [buckets] sections to this file")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Choose prefill, num_seqs and decode context buckets that minimise padding on a trace, and
    print the [cache] and [buckets] sections that serve them (also written to --out).

    Each prompt alone gives the offline per-request optimum. With a CONFIG, --concurrency or
    --arrivals the trace is also replayed through that config's runtime, and the token buckets
    minimise the padding of the steps it runs; the plan then keeps the config's limits
    (max_model_len, max_num_seqs, max_num_batched_tokens) and says in one line each value it
    changes, and why. Requests longer than max_model_len are counted and left out."""
    # a replay plans for the config's runtime: its limits, which the plan keeps
    runtime = load_config(config) if config is not None or concurrency is not None or arrivals else None
    base = runtime or load_config(None)
    if runtime is not None and max_model_len is not None:
        raise ValueError(
            f"--max-model-len: the replayed config's cache.max_model_len ({runtime.cache.max_model_len}) "
            "bounds the plan; change it in the config"
        )
    loaded = _load(trace)
    load = _replay_load(loaded, concurrency, arrivals, step_seconds, token_seconds)
    model_len, why_len = _model_len(runtime, max_model_len, loaded, align)
    block = base.cache.block_size
    data, refused = _servable(loaded, model_len)
    slots = max_num_seqs or base.buckets.max_num_seqs
    # always a token budget: a prefill bucket attends over the whole context, so one as long as the
    # longest prompt can need more memory than the host has
    cap = runtime.buckets.max_num_batched_tokens if runtime else DEFAULT_TOKEN_BUDGET
    opts = PlanOptions(
        graphs=graphs,
        align=align,
        max_num_batched_tokens=max_num_batched_tokens or cap,
        max_num_seqs=slots,
        decode_graphs=decode_graphs,
        tokens_per_s=decode_rate,
        max_compile_seconds=max_compile_seconds,
        holdout_split=holdout_split,
        max_model_len=model_len,
        context_graphs=context_graphs,
    )
    cost = load_manifest_buckets(manifest).cost if manifest else None
    start = time.perf_counter()
    chosen = plan(data, opts, cost)
    doc = {"refused": refused} | chosen.to_json()
    if runtime is not None:
        doc["replay"] = _plan_replayed(runtime, data, opts, chosen.buckets, load, replay_requests,
                                       trace_block_size)
    err.print(f"planned in {time.perf_counter() - start:.3f} s", highlight=False)
    budget = runtime.buckets.max_num_batched_tokens if runtime else chosen.buckets[-1]
    limits = Limits(model_len, slots, budget, peak_blocks(data, decode_rate, slots, block), why_len)
    header = plan_header(doc, trace.name, str(config) if config else "manifests/default.toml")
    planned = PlannedConfig.of(base, doc, limits, header)
    doc["config"] = {"cache": planned.cache, "buckets": planned.buckets, "changes": list(planned.changes)}
    doc["toml"] = planned.toml()
    if out is not None:
        out.write_text(doc["toml"])
        err.print(f"wrote {out}", highlight=False)
    _emit(doc, as_json, print_bucket_plan)


def _model_len(runtime: Config | None, option: int | None, trace: Trace, align: int) -> tuple[int, str]:
    """The max_model_len a plan serves, and why: the replayed config's (kept), --max-model-len,
    or the trace's longest request (prompt and output), aligned."""
    if runtime is not None:
        return runtime.cache.max_model_len, "the config's"
    if option is not None:
        return option, "--max-model-len"
    longest = int((trace.prompt_lens + np.maximum(trace.output_lens, 1)).max())
    return -(-longest // align) * align, "the longest request of the trace"


def _plan_replayed(
    config: Config, trace: Trace, opts: PlanOptions, offline: tuple[int, ...], load: ReplayLoad, limit: int,
    block: int,
) -> dict:
    """Replay the trace once on the config's grid, then choose the token buckets on its calls
    (``offline``: the per-request optimum, scored beside them)."""
    report, replay = _packed(config, trace, limit, block, load, fit_buckets=False)  # bucket-blind steps
    b = config.buckets
    tokens = replay.packed_tokens()
    chosen = plan_replayed(
        tokens, opts.graphs, opts.align, b.max_num_batched_tokens, b.num_batched_tokens_buckets, offline
    )
    return chosen | {"load": report["load"], "requests": report["requests"], "max_num_seqs": b.max_num_seqs}


def register(app: typer.Typer) -> None:
    """Add ``inspect`` and ``plan`` to the ``nb`` app."""
    app.command("inspect", short_help="What a bucket set costs on a trace: padding, refusals.")(inspect)
    app.command("plan", short_help="The buckets, and the config, that pad a trace least.")(plan_cmd)

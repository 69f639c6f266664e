"""Human output of ``nb inspect`` and ``nb plan``: rich tables over the same JSON documents that
``--json`` prints, and the comment lines heading the plan's config sections."""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table

from neuron_buckets.runtime.memory import ranks_line


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _num(value: float | None) -> str:
    """A count with thousands separators; replayed decode steps are weighted, so floats round."""
    return "-" if value is None else f"{round(value):,}"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    return table


def _show(console: Console, table: Table) -> None:
    """Print a table whose figures are never cut: every column but the bucket lists and the row
    names is at least as wide as its widest cell, so at 80 columns the headers wrap instead."""
    for col in table.columns:
        if col.header not in ("buckets", ""):
            col.min_width = max((len(str(c)) for c in col.cells), default=0)
    console.print(table)


def _padding_table(title: str, section: dict, graphs: list[dict] | None, kind: str) -> Table:
    """One row per bucket: calls, real and computed work (real and padding), the padding share,
    compile cost when known (of a decode batch size: its graphs at every context)."""
    unit, key, calls = ("tokens", "seq", "calls") if kind == "prefill" else ("rows", "batch", "steps")
    cost: dict[int, dict] = {}
    for g in graphs or ():
        if g["kind"] == kind:
            row = cost.setdefault(g[key], {"seconds": 0.0, "bytes": 0, "measured": True})
            row["seconds"] += g["seconds"]
            row["bytes"] += g["bytes"]
            row["measured"] &= g["measured"]
    columns = [key, calls, f"real {unit}", f"computed {unit}", "padding share"]
    if graphs:
        columns += ["compile s", "bytes"]
    table = _table(title, columns)
    for b in section["per_bucket"]:
        g = cost.get(b[key], {})
        secs = g.get("seconds")
        est = "" if g.get("measured", True) else "~"  # estimated from the measured graphs
        cells = [str(b[key]), _num(b["calls"]), _num(b[f"real_{unit}"]), _num(b[f"computed_{unit}"]),
                 _pct(b["padding_share"])]  # fmt: skip
        if graphs:
            cells += ["-" if secs is None else f"{est}{secs:.1f}", _size(g.get("bytes"))]
        table.add_row(*cells)
    table.add_section()
    total = ["all", _num(sum(b["calls"] for b in section["per_bucket"])), _num(section[f"real_{unit}"]),
             _num(section[f"computed_{unit}"]), _pct(section["padding_share"])]  # fmt: skip
    table.add_row(*total, *([""] * (len(columns) - len(total))))
    return table


def refused_line(refused: dict) -> str | None:
    """The requests the config cannot serve, in words; None when it serves them all."""
    if not refused["requests"]:
        return None
    return (
        f"refused: {refused['requests']:,} of {refused['of']:,} requests are longer than "
        f"cache.max_model_len ({refused['max_model_len']:,}, prompt + output); every figure below "
        "leaves them out"
    )


def print_inspect(console: Console, doc: dict) -> None:
    if line := refused_line(doc["refused"]):
        console.print(line, highlight=False)
    prefill = doc["prefill"]
    _show(console, _padding_table("prefill padding", prefill, doc["graphs"], "prefill"))
    console.print(
        f"{prefill['requests']:,} requests; {prefill['chunked_requests']:,} longer than the "
        f"largest bucket ({prefill['buckets'][-1]}) ran in chunks"
    )
    _print_decode(console, doc["decode"], doc["graphs"])
    if ranks := doc.get("ranks"):
        console.print(ranks_line(ranks), highlight=False)
    if packed := doc.get("packed"):
        title = f"runtime replay: {_load_text(packed['load'], packed['requests'])}, packed steps"
        table = _table(title, ["bucket", "calls", "real tokens", "computed tokens", "padding share"])
        for b in packed["per_bucket"]:
            table.add_row(b["bucket"], _num(b["calls"]), _num(b["real_tokens"]), _num(b["computed_tokens"]),
                          _pct(b["padding_share"]))  # fmt: skip
        _show(console, table)
        console.print(
            f"runtime padding share {_pct(packed['padding_share'])} of computed tokens over "
            f"{packed['steps']:,} steps "
            f"({packed['replayed_seconds']:,.1f} s on the replayed clock), "
            f"{packed['preemptions']:,} preemptions"
        )
        if cache := packed.get("prefix_cache"):
            console.print(
                f"prefix cache: {cache['hits']:,} of {cache['queries']:,} prompt tokens hit "
                f"({_pct(cache['hit_rate'])}), {cache['prefill_tokens_saved']:,} prefill tokens saved, "
                f"{cache['evictions']:,} blocks evicted"
            )
    if doc["graphs"]:
        total = sum(g["seconds"] for g in doc["graphs"])
        size = sum(g["bytes"] for g in doc["graphs"])
        guessed = "" if all(g["measured"] for g in doc["graphs"]) else " (~: estimated from measured graphs)"
        console.print(f"{len(doc['graphs'])} graphs: {total:.1f} s to compile, {_size(size)}{guessed}")
    if spec := doc.get("speculation"):
        _print_speculation(console, spec)


def _print_speculation(console: Console, spec: dict) -> None:
    """One line for the verify rows, one for the draft model."""
    rows = f"decode rows of 1 + {spec['speculation_length']} tokens"
    if "verify" not in spec:  # from a config: buckets only
        console.print(f"speculation: {spec['verify_buckets']} of {spec['target_buckets']} target buckets "
                      f"verify {rows}; the draft model adds {spec['draft_buckets']} buckets")  # fmt: skip
        return
    verify, target = spec["verify"], spec["target"]
    console.print(f"speculation: {verify['pieces']} decode pieces verify {rows}: "
                  f"{verify['compile_seconds']:.1f} of the target's {target['compile_seconds']:.1f} s "
                  f"of compile, {_size(verify['bytes'])}")  # fmt: skip
    if draft := spec["draft"]:
        weights = _size(draft["weights_bytes"])
        console.print(f"draft model: {draft['buckets']} buckets, {draft['pieces']} pieces of its own "
                      f"({draft['compile_seconds']:.1f} s of compile, {_size(draft['bytes'])}) and "
                      f"{draft['shared_pieces']} shared with the target; weights {weights}")  # fmt: skip


def _load_text(load: dict, requests: int) -> str:
    """How the replay's requests reached the engine (``ReplayLoad.to_json``), in words."""
    conc = load["concurrency"]
    how = "all at once" if conc is None else f"concurrency {conc}"
    if load["arrivals"]:
        how = f"at their arrivals ({load['step_seconds']:g} s/step + {load['token_seconds']:g} s/token)"
        how += "" if conc is None else f", at most {conc} in flight"
    return f"{requests:,} requests, {how}"


def _print_decode(console: Console, decode: dict | None, graphs: list[dict] | None) -> None:
    if decode is None:
        console.print("decode: the trace has no arrival times (or no output tokens), no replay")
        return
    title = (
        f"decode padding (replay: {decode['tokens_per_s']:g} tokens/s per request, "
        f"max_num_seqs {decode['max_num_seqs']})"
    )
    _show(console, _padding_table(title, decode, graphs, "decode"))
    batch, steps = (np.array(col) for col in zip(*decode["batch_histogram"], strict=True))
    share = np.cumsum(steps) / steps.sum()
    p50, p90, p99 = (int(batch[np.searchsorted(share, q)]) for q in (0.5, 0.9, 0.99))
    console.print(
        f"decode batch size over steps: mean {np.average(batch, weights=steps):.1f}, "
        f"p50 {p50}, p90 {p90}, p99 {p99}",
        highlight=False,
    )
    console.print(
        f"peak batch {decode['peak_batch']}; {decode['queued_requests']:,} requests waited for a "
        f"slot (mean wait {decode['mean_wait_s']:.2f} s)"
    )


def print_bucket_plan(console: Console, doc: dict) -> None:
    if line := refused_line(doc["refused"]):
        console.print(line, highlight=False)
    prefill, chosen = doc["prefill"], len(doc["prefill"]["buckets"])
    priced = any(row["compile_seconds"] is not None for row in doc["pareto"])  # with --manifest
    pareto = _table(
        "prefill plans, offline per-request optimum (each prompt alone): graphs against padding"
        + (" and compile" if priced else ""),
        ["graphs", "buckets", "padding share", *(["compile s", "bytes"] if priced else [])],
    )
    for row in doc["pareto"]:
        mark = " *" if row["buckets"] == prefill["buckets"] else ""
        cells = [f"{row['graphs']}{mark}", ", ".join(map(str, row["buckets"])), _pct(row["padding_share"])]
        if priced:
            cells += [f"{row['compile_seconds']:.1f}", _size(row["graph_bytes"])]
        pareto.add_row(*cells)
    _show(console, pareto)
    compare = _table("plan against powers of two", ["", "buckets", "graphs", "padding share"])
    _compare_rows(compare, "prefill", prefill)
    if doc["decode"]:
        _compare_rows(compare, "decode", doc["decode"])
    if doc.get("context"):
        _compare_rows(compare, "decode context", doc["context"])
    _show(console, compare)
    console.print(f"* = chosen: {chosen} prefill graph(s)")
    if replay := doc.get("replay"):
        _print_replay(console, replay)
    if doc.get("holdout"):
        held = doc["holdout"]
        line = (
            f"holdout (last {1 - held['split']:.0%} by arrival, {held['eval_requests']:,} "
            f"requests): prefill padding share {_pct(held['prefill']['padding_share'])} "
            f"(powers of two {_pct(held['baseline']['padding_share'])})"
        )
        if held["decode"]:
            line += (
                f", decode {_pct(held['decode']['padding_share'])} "
                f"(powers of two {_pct(held['decode']['baseline']['padding_share'])})"
            )
        console.print(line)
    for line in doc["config"]["changes"]:
        console.print(line, highlight=False)
    console.print("\nPaste into your config (replacing its [cache] and [buckets]):\n")
    console.print(doc["toml"], markup=False, highlight=False, soft_wrap=True)


def _print_replay(console: Console, replay: dict) -> None:
    """The token buckets chosen on the replayed steps, beside the config's and the offline ones."""
    title = (
        f"token buckets for the replayed steps: {_load_text(replay['load'], replay['requests'])}, "
        f"max_num_seqs {replay['max_num_seqs']}, {replay['calls']:,} packed calls"
    )
    table = _table(title, ["", "buckets", "graphs", "computed tokens", "padding share"])
    rows = [("replay plan", replay), ("config", replay["baseline"])]
    if replay["offline_optimum"]:
        rows.append(("offline per-request optimum", replay["offline_optimum"]))
    for name, part in rows:
        table.add_row(
            name, ", ".join(map(str, part["buckets"])), str(len(part["buckets"])),
            _num(part["computed_tokens"]), _pct(part["padding_share"]),
        )  # fmt: skip
    _show(console, table)


def _compare_rows(table: Table, kind: str, section: dict) -> None:
    for name, part in ((f"{kind} plan", section), (f"{kind} powers of two", section["baseline"])):
        table.add_row(
            name, ", ".join(map(str, part["buckets"])), str(len(part["buckets"])), _pct(part["padding_share"])
        )


def plan_header(doc: dict, trace_name: str, target: str) -> tuple[str, ...]:
    """The comment lines above the planned sections: what the plan was fitted to and what its
    buckets cost there, what it left out, and where the sections go."""
    prefill = doc["prefill"]
    lines = [
        f"nb plan on {trace_name}: prefill padding share {_pct(prefill['padding_share'])} "
        f"(powers of two {_pct(prefill['baseline']['padding_share'])}), each prompt alone",
    ]
    if replay := doc.get("replay"):
        lines.append(
            f"token buckets from the runtime replay ({_load_text(replay['load'], replay['requests'])}, "
            f"max_num_seqs = {replay['max_num_seqs']}): padding share {_pct(replay['padding_share'])} "
            f"(the config's {_pct(replay['baseline']['padding_share'])})"
        )
    if context := doc.get("context"):
        lines.append(
            f"decode context positions attended: padding share {_pct(context['padding_share'])} "
            f"(powers of two from 256: {_pct(context['baseline']['padding_share'])})"
        )
    if (decode := doc["decode"]) and decode["why_not"]:
        lines.append(decode["why_not"])
    if line := refused_line(doc["refused"]):
        lines.append(line)
    lines.append(f"replace the [cache] and [buckets] sections of {target} with these")
    return tuple(lines)

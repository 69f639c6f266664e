"""Human output of ``nb inspect`` and ``nb plan``: rich tables over the same JSON documents that
``--json`` prints, and the plan as a ``[buckets]`` TOML snippet to paste into a config."""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


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


def _padding_table(title: str, section: dict, graphs: list[dict] | None, kind: str) -> Table:
    """One row per bucket: calls, real and padded work, padding, compile cost when known (of a
    decode batch size: its graphs at every context)."""
    unit, key, calls = ("tokens", "seq", "calls") if kind == "prefill" else ("rows", "batch", "steps")
    cost: dict[int, dict] = {}
    for g in graphs or ():
        if g["kind"] == kind:
            row = cost.setdefault(g[key], {"seconds": 0.0, "bytes": 0, "measured": True})
            row["seconds"] += g["seconds"]
            row["bytes"] += g["bytes"]
            row["measured"] &= g["measured"]
    columns = [key, calls, f"real {unit}", f"padded {unit}", "padding", "compile s", "bytes"]
    table = _table(title, columns)
    for b in section["per_bucket"]:
        g = cost.get(b[key], {})
        secs = g.get("seconds")
        est = "" if g.get("measured", True) else " (est.)"
        table.add_row(
            str(b[key]),
            _num(b["calls"]),
            _num(b[f"real_{unit}"]),
            _num(b[f"padded_{unit}"]),
            _pct(b["padding_ratio"]),
            "-" if secs is None else f"{secs:.1f}{est}",
            _size(g.get("bytes")),
        )
    table.add_section()
    table.add_row(
        "all",
        _num(sum(b["calls"] for b in section["per_bucket"])),
        _num(section[f"real_{unit}"]),
        _num(section[f"padded_{unit}"]),
        _pct(section["padding_ratio"]),
        "",
        "",
    )
    return table


def print_inspect(console: Console, doc: dict) -> None:
    prefill = doc["prefill"]
    console.print(_padding_table("prefill padding", prefill, doc["graphs"], "prefill"))
    console.print(
        f"{prefill['requests']:,} requests; {prefill['chunked_requests']:,} longer than the "
        f"largest bucket ({prefill['buckets'][-1]}) ran in chunks"
    )
    _print_decode(console, doc["decode"], doc["graphs"])
    if packed := doc.get("packed"):
        title = f"runtime replay: {_load_text(packed['load'], packed['requests'])}, packed steps"
        table = _table(title, ["bucket", "calls", "real tokens", "padded tokens"])
        for b in packed["per_bucket"]:
            table.add_row(b["bucket"], _num(b["calls"]), _num(b["real_tokens"]), _num(b["padded_tokens"]))
        console.print(table)
        console.print(
            f"runtime padding {_pct(packed['padding_ratio'])} of real tokens over {packed['steps']:,} steps "
            f"({packed['replayed_seconds']:,.1f} s on the replayed clock)"
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
        console.print(f"{len(doc['graphs'])} graphs: {total:.1f} s to compile, {_size(size)}")
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
    console.print(_padding_table(title, decode, graphs, "decode"))
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
    prefill, chosen = doc["prefill"], len(doc["prefill"]["buckets"])
    pareto = _table(
        "prefill plans, offline per-request optimum (each prompt alone): graphs against padding and compile",
        ["graphs", "buckets", "padding", "compile s", "bytes"],
    )
    for row in doc["pareto"]:
        mark = " *" if row["buckets"] == prefill["buckets"] else ""
        pareto.add_row(
            f"{row['graphs']}{mark}",
            ", ".join(map(str, row["buckets"])),
            _pct(row["padding_ratio"]),
            _num(row["compile_seconds"]),
            _size(row["graph_bytes"]),
        )
    console.print(pareto)
    compare = _table("plan against powers of two", ["", "buckets", "graphs", "padding"])
    _compare_rows(compare, "prefill", prefill)
    if doc["decode"]:
        _compare_rows(compare, "decode", doc["decode"])
    if doc.get("context"):
        _compare_rows(compare, "decode context", doc["context"])
    console.print(compare)
    console.print(f"* = chosen: {chosen} prefill graph(s)")
    if replay := doc.get("replay"):
        _print_replay(console, replay)
    if doc.get("holdout"):
        held = doc["holdout"]
        line = (
            f"holdout (last {1 - held['split']:.0%} by arrival, {held['eval_requests']:,} "
            f"requests): prefill padding {_pct(held['prefill']['padding_ratio'])} "
            f"(powers of two {_pct(held['baseline']['padding_ratio'])})"
        )
        if held["decode"]:
            line += (
                f", decode {_pct(held['decode']['padding_ratio'])} "
                f"(powers of two {_pct(held['decode']['baseline']['padding_ratio'])})"
            )
        console.print(line)
    console.print("\nPaste into your config:\n")
    console.print(doc["toml"], markup=False, highlight=False, soft_wrap=True)


def _print_replay(console: Console, replay: dict) -> None:
    """The token buckets chosen on the replayed steps, beside the config's and the offline ones."""
    title = (
        f"token buckets for the replayed steps: {_load_text(replay['load'], replay['requests'])}, "
        f"max_num_seqs {replay['max_num_seqs']}, {replay['calls']:,} packed calls"
    )
    table = _table(title, ["", "buckets", "graphs", "padded tokens", "padding"])
    rows = [("replay plan", replay), ("config", replay["baseline"])]
    if replay["offline_optimum"]:
        rows.append(("offline per-request optimum", replay["offline_optimum"]))
    for name, part in rows:
        table.add_row(
            name, ", ".join(map(str, part["buckets"])), str(len(part["buckets"])),
            _num(part["padded_tokens"]), _pct(part["padding_ratio"]),
        )  # fmt: skip
    console.print(table)


def _compare_rows(table: Table, kind: str, section: dict) -> None:
    for name, part in ((f"{kind} plan", section), (f"{kind} powers of two", section["baseline"])):
        table.add_row(
            name, ", ".join(map(str, part["buckets"])), str(len(part["buckets"])), _pct(part["padding_ratio"])
        )


def toml_snippet(doc: dict, trace_name: str) -> str:
    """The plan as config lines; the limits equal the largest buckets, as the grid rules require
    (the replay never needed more, so they change nothing for this traffic)."""
    prefill = doc["prefill"]
    lines = [
        f"# nb plan on {trace_name}: prefill padding {_pct(prefill['padding_ratio'])} "
        f"(powers of two {_pct(prefill['baseline']['padding_ratio'])}), each prompt alone",
    ]
    if replay := doc.get("replay"):
        prefill = replay
        lines.append(
            f"# token buckets from the runtime replay ({_load_text(replay['load'], replay['requests'])}, "
            f"max_num_seqs = {replay['max_num_seqs']}): padding {_pct(replay['padding_ratio'])} "
            f"(the config's {_pct(replay['baseline']['padding_ratio'])})"
        )
    lines += [
        "[buckets]",
        f"max_num_batched_tokens = {prefill['buckets'][-1]}",
        f"num_batched_tokens_buckets = {prefill['buckets']}",
    ]
    if doc["decode"]:
        lines += [
            f"max_num_seqs = {doc['decode']['buckets'][-1]}",
            f"num_seqs_buckets = {doc['decode']['buckets']}",
        ]
    if context := doc.get("context"):
        lines += [
            f"# decode context positions attended: {_pct(context['padding_ratio'])} over the real "
            f"context (powers of two from 256: {_pct(context['baseline']['padding_ratio'])}); "
            f"needs cache.max_model_len = {context['max_model_len']}",
            f"decode_context_length_buckets = {context['buckets']}",
        ]
    return "\n".join(lines) + "\n"

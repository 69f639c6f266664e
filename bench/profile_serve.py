"""Where one second of ``nb serve`` goes under load: its threads sampled by py-spy, time by stage.

The server and its load are ``bench_serve.py``'s (same model, artifact, limits and client; one
workload at one concurrency, default ``random`` at 8). Once the load has run ``--warmup`` seconds,
two py-spy samplers watch the server for ``--duration`` seconds side by side, without pausing it
(``--nonblocking``): one with ``--idle`` (every thread at every tick: the tick count) and one
without (only the ticks where a thread runs on a CPU or holds the GIL). Each active sample is
charged to a stage by the frames of nb's own code in its stack (``stage``): graph calls by kind
(the runtime's entry point, e.g. ``prefill`` or ``decode``), step inputs and packing, scheduling,
sampling, detokenization, the rest of the engine, the engine loop's hand-off to connections, and
HTTP/SSE (nb's handlers, and the event loop's libraries: uvicorn, starlette, pydantic, json).
What is left of a thread's ticks is idle; a thread that waits for the GIL counts as idle too, so
a busy event loop shows up as idle time of the engine thread; a sample whose innermost frame
waits (a selector, a lock, a queue) is idle whatever py-spy says. py-spy must be allowed to read
the server's memory (same user; ptrace not restricted to descendants).

Also printed, from ``/metrics`` and ``/proc`` over the same window: graph calls per second of each
kind and their real and padded positions, the share of the graph time spent on padding positions
(if a call's time follows the positions it computes), generated tokens per second, and CPU seconds per
wall second of each thread, the native ones (OpenMP workers) included. The figures go into
``bench/RESULTS.md`` as rows (``--results`` names another file; ``--tiny`` writes ``WORK/RESULTS.md``).

    python -m bench.profile_serve --vllm-python VENV/bin/python [--py-spy PATH] [--tiny]
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .bench_serve import (
    Load,
    bench_model,
    client_args,
    common_parser,
    nb_server,
    resolve,
    serve_artifact,
    start_client,
)
from .results_table import PROVENANCE, ResultsTable, add_results_argument
from .servers import free_port

# kernels/ sits beside the package in a checkout, inside it once installed: match where it is.
KERNELS = Path(import_module("neuron_buckets.kernels").__path__[0]).as_posix() + "/"
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*):\d+\)$")
THREAD = re.compile(r"^thread \((?P<tid>\d+)\)(?::\s*(?P<name>.*))?$")
# A stack's stage, by the file of the innermost frame of nb's own code (first fragment that matches).
STAGES = (
    ("neuron_buckets/engine/sampler", "sampling"),
    ("neuron_buckets/engine/detokenizer", "detokenization"),
    ("neuron_buckets/engine/tokenizer", "tokenization of prompts"),
    ("neuron_buckets/runtime/packing", "step inputs and packing"),
    ("neuron_buckets/runtime/step_check", "step inputs and packing"),
    ("neuron_buckets/core/", "step inputs and packing"),
    ("neuron_buckets/runtime/", "graph"),
    ("neuron_buckets/backends/", "graph"),
    ("neuron_buckets/model/", "graph"),
    (KERNELS, "graph"),
    ("neuron_buckets/engine/scheduler", "scheduling"),
    ("neuron_buckets/engine/block_pool", "scheduling"),
    ("neuron_buckets/engine/request", "scheduling"),
    ("neuron_buckets/engine/", "engine, other"),
    ("neuron_buckets/server/engine_loop", "engine loop hand-off"),
    ("neuron_buckets/server/", "HTTP/SSE, nb's handlers"),
)
IDLE = "idle"
# Innermost frames that wait (file ending, function ending): py-spy may still call such a thread
# active (an event loop polling with a zero timeout, say), but it is not doing work.
WAITS = (("selectors.py", ".select"), ("threading.py", ".wait"), ("queue.py", ".get"))
HTTP = tuple(f"/{lib}/" for lib in ("uvicorn", "starlette", "fastapi", "h11", "httptools", "pydantic",
                                     "pydantic_core", "json", "asyncio", "anyio", "prometheus_client"))
# Stages whose own time outranks the stage of the code beneath them: the tokenizer's decode
# runs for the detokenizer, and torch's ops run for the sampler.
OUTER = {"detokenization", "sampling"}
TABLE = ResultsTable(
    heading="Where a second of nb serve goes (profile_serve.py)",
    about="""
`bench/profile_serve.py`: `nb serve` under `bench_serve.py`'s load (SmolLM2-135M shape with a word
tokenizer, 30 layers, float32; vLLM's load generator, a closed loop of `conc` streams), sampled by
two py-spy samplers side by side over a window after a warm-up. Per thread: the share of its wall
time in each stage, charged by the innermost frame of nb's own code (idle: waiting, or waiting for
the GIL), and its CPU seconds per wall second; for the whole process: CPU seconds per second, graph
calls per second with their real and padded positions, and generated tokens per second.
""",
    columns=("workload", "conc", "thread", "what", "value", *PROVENANCE),
    key=4,
)


def frames(stack: str) -> tuple[str, str, list[tuple[str, str]]]:
    """(thread id, thread name, [(function, file)] outermost first) of one py-spy raw stack."""
    head, *rest = stack.split(";")
    m = THREAD.match(head)
    if m is None:
        raise ValueError(f"py-spy raw line without a thread: {stack[:80]!r}")
    out = [(f["func"], f["file"]) for f in map(FRAME.match, rest) if f]
    return m["tid"], m["name"] or "", out


def stage(stack: list[tuple[str, str]]) -> str:
    """The stage one sample is charged to (see ``STAGES``); graph calls carry their entry point."""
    if stack and any(stack[-1][1].endswith(f) and stack[-1][0].endswith(fn) for f, fn in WAITS):
        return IDLE
    found = [next((name for frag, name in STAGES if frag in path), None) for _, path in stack]
    outer = next((s for s in found if s in OUTER), None)
    inner = next((s for s in reversed(found) if s), None)
    if outer:
        return outer
    if inner == "graph":
        # a stack read while it changed (py-spy does not pause the server) may lack its outer frames
        names = (func.rsplit(".", 1)[-1] for (func, _), s in zip(stack, found, strict=True) if s == "graph")
        return f"graph: {next((n for n in names if not n.startswith('<')), 'entry point unseen')}"
    if inner:
        return inner
    http = any(lib in path for _, path in stack for lib in HTTP)
    return "HTTP/SSE, event loop libraries" if http else "other"


def read_raw(path: Path) -> Counter[tuple[str, str, str]]:
    """Samples per (thread id, thread name, stage) of one py-spy raw file."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        tid, name, stack_frames = frames(stack)
        counts[tid, name, stage(stack_frames)] += int(n)
    return counts


def scrape(port: int) -> dict[tuple[str, str], float]:
    """``/metrics`` as {(sample name, bucket label or ""): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {(s.name, s.labels.get("bucket", "")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def thread_cpu(pid: int) -> dict[str, tuple[str, float]]:
    """CPU seconds (user + system) so far of each thread of ``pid``: {tid: (name, seconds)}."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        fields = stat.rpartition(")")[2].split()
        out[task.name] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


@dataclass
class Window:
    """What was measured over the sampling window."""

    seconds: float
    ticks: Counter[str]  # tid -> samples of the --idle sampler (every tick)
    active: Counter[tuple[str, str, str]]  # (tid, name, stage) -> samples of the other sampler
    metrics: dict[tuple[str, str], float]  # /metrics, end minus start
    cpu: dict[str, tuple[str, float]]  # tid -> (name, CPU seconds in the window)
    names: dict[str, str]  # tid -> thread name
    load_ran_throughout: bool


def sample(pid: int, port: int, args, client: subprocess.Popen) -> Window:
    """Run both samplers over the window; the counters around it."""
    spy = [str(args.py_spy), "record", "--pid", str(pid), "--duration", str(args.duration), "--rate",
           str(args.rate), "--format", "raw", "--threads", "--nonblocking", "--full-filenames"]
    raw_idle, raw_active = args.work / "profile-idle.raw", args.work / "profile-active.raw"
    m0, cpu0, start = scrape(port), thread_cpu(pid), time.perf_counter()
    with (args.work / "profile-py-spy.log").open("w") as log:
        procs = [subprocess.Popen([*spy, "--idle", "-o", str(raw_idle)], stdout=log, stderr=log),
                 subprocess.Popen([*spy, "-o", str(raw_active)], stdout=log, stderr=log)]
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"py-spy failed (status {p.returncode}); its log: {log.name}")
    seconds = time.perf_counter() - start
    m1, cpu1 = scrape(port), thread_cpu(pid)
    idle = read_raw(raw_idle)
    ticks: Counter[str] = Counter()
    names = {}
    for (tid, name, _), n in idle.items():
        ticks[tid] += n
        names[tid] = name
    return Window(
        seconds=seconds, ticks=ticks, active=read_raw(raw_active),
        metrics={k: v - m0.get(k, 0.0) for k, v in m1.items()},
        cpu={tid: (name, sec - cpu0.get(tid, (name, 0.0))[1]) for tid, (name, sec) in cpu1.items()},
        names=names, load_ran_throughout=client.poll() is None,
    )


def bucket_totals(w: Window) -> dict[str, dict[str, float]]:
    """Per bucket kind (the bucket name up to its first "_"): calls, real and padded positions."""
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (name, bucket), value in w.metrics.items():
        for metric, key in (("nb:bucket_calls_total", "calls"), ("nb:bucket_real_tokens_total", "real"),
                            ("nb:bucket_computed_tokens_total", "padded")):
            if name == metric and bucket:
                kinds[bucket.split("_")[0]][key] += value
    return kinds


def print_thread(w: Window, tid: str, kinds: dict[str, dict[str, float]]) -> list[list[str]]:
    """One thread's wall time by stage, padding inside graph calls, and idle; as rows too."""
    ticks, name = w.ticks[tid], w.names[tid] or tid
    stages = {s: n for (t, _, s), n in w.active.items() if t == tid and s != IDLE}
    cpu = w.cpu.get(tid, ("", 0.0))[1] / w.seconds
    real, padded = (sum(k[f] for k in kinds.values()) for f in ("real", "padded"))
    print(f"  thread {name} (CPU {cpu:.2f} s per s):")
    rows = [[name, "CPU s per s", f"{cpu:.2f}"]]
    for s, n in sorted(stages.items(), key=lambda kv: -kv[1]):
        print(f"    {s:34s}{n / ticks:7.1%}")
        rows.append([name, s, f"{n / ticks:.1%}"])
        if s.startswith("graph: ") and padded:  # a step's calls of every kind, under run_plan
            pad = 1 - real / padded
            print(f"      {'of which padding positions':32s}{pad * n / ticks:7.1%}  ({pad:.0%} of them)")
            rows.append([name, f"{s}, of which padding positions", f"{pad * n / ticks:.1%}"])
    idle = max(ticks - sum(stages.values()), 0) / ticks
    print(f"    {'idle (or waiting for the GIL)':34s}{idle:7.1%}")
    return [*rows, [name, "idle (or waiting for the GIL)", f"{idle:.1%}"]]


def print_calls(w: Window, kinds: dict[str, dict[str, float]]) -> list[list[str]]:
    """Graph calls per second of each bucket kind and their real and padded positions, from
    /metrics (one ``run_plan`` sample covers every call of its step, so time per kind is not
    told apart here; ``bench_roofline.py`` times the calls themselves); as rows too."""
    rows = []
    for kind, k in sorted(kinds.items()):
        if k["calls"]:
            said = (f"{k['calls'] / w.seconds:.1f} calls per s, "
                    f"{k['real'] / k['calls']:.0f} real of {k['padded'] / k['calls']:.0f} positions per call")
            print(f"  {kind}: {said}")
            rows.append(["whole process", f"{kind} graph calls", said])
    return rows


def report(w: Window, load: Load) -> list[list[str]]:
    """The table: per thread, the share of its wall time in each stage, then the counters; as
    ``TABLE``'s rows too."""
    rate = max(w.ticks.values()) / w.seconds
    print(f"\nwhere one second of nb serve goes: {load.workload} at concurrency {load.concurrency}, "
          f"{w.seconds:.1f} s window, py-spy at {rate:.0f} samples/s")
    if not w.load_ran_throughout:
        print("  warning: the load ended inside the window; raise --num-prompts or lower --duration")
    kinds = bucket_totals(w)
    rows = [row for tid, _ in w.ticks.most_common() for row in print_thread(w, tid, kinds)]
    native = sum(sec for tid, (_, sec) in w.cpu.items() if tid not in w.ticks) / w.seconds
    total = sum(sec for _, sec in w.cpu.values()) / w.seconds
    print(f"  native threads (OpenMP workers...): CPU {native:.2f} s per s; "
          f"whole process {total:.2f} s per s on {os.cpu_count()} cores")
    rows += print_calls(w, kinds)
    gen = w.metrics.get(("vllm:generation_tokens_total", ""), 0.0)
    print(f"  generated {gen / w.seconds:.1f} tokens per s in the window")
    rows += [["native threads", "CPU s per s", f"{native:.2f}"],
             ["whole process", "CPU s per s", f"{total:.2f}"],
             ["whole process", "generated tokens per s", f"{gen / w.seconds:.1f}"]]
    return [[load.workload, str(load.concurrency), *row] for row in rows]


def main() -> None:
    p = common_parser(__doc__)
    p.add_argument("--workload", default="random")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=96, help="enough to outlast warm-up and window")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of load before sampling starts")
    p.add_argument("--duration", type=int, default=30, help="seconds sampled")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--py-spy", type=Path, default=os.environ.get("PY_SPY", "py-spy"),
                   help="the py-spy binary (default: $PY_SPY, else py-spy on PATH)")
    add_results_argument(p)
    args = resolve(p.parse_args())
    if args.tiny:
        args.num_prompts, args.warmup, args.duration, args.results = 48, 5.0, 5, args.work / "RESULTS.md"
    model = bench_model(args.models, args.layers)
    artifact = serve_artifact(args.work, model, args)
    load = Load(args.workload, args.concurrency, args.num_prompts)
    port = free_port()
    with nb_server(artifact, port, args.work / "profile-nb-serve.log") as server:
        log = args.work / "profile-client.log"
        cargs = client_args(load, port, model)
        client = start_client(args.vllm_python, cargs, args.work / "profile.json", log)
        try:
            deadline = time.monotonic() + 600
            while scrape(port).get(("vllm:generation_tokens_total", ""), 0.0) == 0.0:
                if client.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the load produced no token; the client's log: {log}")
                time.sleep(0.5)
            time.sleep(args.warmup)
            window = sample(server.pid, port, args, client)
        finally:
            client.terminate()
            client.wait(60)
    print(f"SmolLM2-135M shape, {args.layers} layers, float32, {os.cpu_count()} CPUs; "
          f"nb serves {artifact.name}")
    TABLE.write(args.results, report(window, load))


if __name__ == "__main__":
    main()

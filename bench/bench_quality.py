"""Quality on real text, on the real model: perplexity by dtype and quantization, nb against
transformers; with ``--speculation``, n-gram speculation's acceptance and speed.

Model: SmolLM2-135M-Instruct, the GGUF of ``tests/real_model.py`` (fetched once per machine).
Text: the project's own prose, ``docs/design.md`` (``TEXT``), its first ``--tokens`` tokens in
windows of ``WINDOW``; each window is scored from its second token (prompt logprobs), and the
perplexity is exp of minus the mean log-probability over every scored token.

- nb runs the GGUF compiled in float32 and in bfloat16, and three compressed-tensors checkpoints
  of the same model (transformers' float32 reading of the GGUF, saved, then quantized data-free by
  ``model/checkpoint_quantizer.py``): W8A16 INT8, W8A8 INT8 (per-token activations) and FP8 weights,
  each compiled in float32 so that the row shows the quantization alone;
- transformers runs the GGUF in float32 (its own reading of the file) over the same windows.

Each row gives nb's perplexity, transformers' where it ran, and the row's perplexity over nb's
float32 one; the rows go into ``bench/RESULTS.md`` (``--results`` names another file). Perplexity
is no timing: a loaded machine gives the same figures.

``--speculation``: greedy chat replies to prompts that summarise or continue a passage of the same
text (``SPEC_TASKS``), where prompt lookup should pay: the artifact without speculation rows and
the one whose decode rows carry ``1 + K`` tokens with n-gram drafts, alternating round by round
(``--rounds``, at least 3), each round every prompt once at concurrency 1. Its row: acceptance,
mean accepted length, and tok/s of each (median, min-max) with the ratio of the medians; the
greedy texts must be identical, or it fails. Timings vary with the machine's load: run it quiet.

    python -m bench.bench_quality [--tokens 2048] [--speculation [--rounds 3] [--k 3]]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from neuron_buckets import LLMEngine, RequestOutput, SamplingParams, generate
from neuron_buckets.compile.compiler import Compiler
from neuron_buckets.config import load_config
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.model.checkpoint_quantizer import quantize_checkpoint
from neuron_buckets.model.quant.quant_scheme import QuantScheme
from neuron_buckets.utils.files import sha256_file
from tests.real_model import fetch

from .results_table import PROVENANCE, Ratio, ResultsTable, add_results_argument
from .rounds import run_rounds, spreads

TEXT = Path(__file__).parents[1] / "docs" / "design.md"
WINDOW = 256  # tokens per scored window: a prompt of its own, within max_model_len
SCHEMES = (QuantScheme("int8", "channel"), QuantScheme("int8", "channel", "int8_token"),
           QuantScheme("float8_e4m3fn", "channel"))
LABELS = {"w8a16-int8-channel": "W8A16 INT8", "w8a8-int8-channel": "W8A8 INT8",
          "w8a16-fp8-channel": "FP8 (W8A16)"}
CONFIG = """
[model]
path = "{model}"

[cache]
block_size = 16
num_blocks = 96
max_model_len = 512
dtype = "{dtype}"

[buckets]
max_num_seqs = 1
max_num_batched_tokens = 128
num_seqs_buckets = [1]
num_batched_tokens_buckets = [128]
speculation_length = {k}

[compile]
backend = "{backend}"
"""
TABLE = ResultsTable(
    heading="Perplexity on real text (bench_quality.py)",
    about="""
`bench/bench_quality.py`: SmolLM2-135M-Instruct (its GGUF, Q4_1, from the package index) over the
first `tokens` tokens of `docs/design.md` (`text`: the first 12 digits of its sha256) in windows of
256, each scored from its second token.
nb runs the GGUF in float32 and bfloat16, and compressed-tensors checkpoints of the same model
(transformers' float32 reading of the GGUF, quantized data-free) in float32; transformers runs
the GGUF in float32 (its row only). `/ nb float32` is the row's nb perplexity over nb's float32 one.
""",
    columns=("model", "text", "tokens", "nb perplexity", "nb float32 perplexity", "/ nb float32",
             "transformers perplexity", *PROVENANCE),
    key=3,
    derived={"/ nb float32": Ratio("nb perplexity", "nb float32 perplexity", digits=4, suffix="")},
)
SPEC_TABLE = ResultsTable(
    heading="n-gram speculation on the real model, --speculation (bench_quality.py)",
    about="""
`bench/bench_quality.py` `--speculation`: SmolLM2-135M-Instruct (its GGUF) compiled in float32, greedy
chat replies (`tokens` new tokens each, or its end of sequence) to `prompts` tasks that summarise,
continue or quote a 160-token passage of `docs/design.md`, each prompt alone (concurrency 1), in
process. `plain` is the artifact without speculation; `ngram` the one whose decode rows carry
1 + `K` tokens, with prompt-lookup drafts. The two alternate over `rounds` rounds (the order
swapped each round) after an untimed pass each; tok/s are medians with min-max beside them, the
ratio is of the medians. The bench fails unless every round's greedy texts are identical.
""",
    columns=("model", "K", "prompts", "tokens", "rounds", "acceptance", "mean accepted length",
             "tok/s plain", "tok/s ngram", "tok/s min-max plain ; ngram", "ngram / plain",
             "greedy texts identical", *PROVENANCE),
    key=2,
    derived={"ngram / plain": Ratio("tok/s ngram", "tok/s plain")},
)
# Greedy chat tasks over a passage of the text: output that quotes its prompt, where lookup pays.
SPEC_TASKS = ("Summarise the following passage in two sentences.\n\n{passage}",
              "Continue the following passage with its next paragraph.\n\n{passage}",
              "Repeat the first sentence of the following passage, then explain it.\n\n{passage}")
SPEC_PASSAGE = 160  # tokens of the text per passage
SPEC_NEW = 64


def tokenizer(gguf: Path):
    """transformers' tokenizer of the GGUF (nb's own is converted from the same metadata)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def text_windows(gguf: Path, tokens: int, window: int = WINDOW) -> list[list[int]]:
    """The text's first ``tokens`` tokens, in windows of ``window`` (the last one may be shorter)."""
    ids = tokenizer(gguf)(TEXT.read_text(), add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"{TEXT.name} has {len(ids)} tokens, fewer than the {tokens} asked for")
    return [ids[i: i + window] for i in range(0, len(ids), window)]


def perplexity(logprobs: Sequence[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def nb_logprobs(artifact: Path, windows: list[list[int]]) -> list[float]:
    """Each window's tokens from its second, scored by nb (prompt logprobs of one generated token)."""
    outs = generate(LLMEngine.open(artifact), windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [e.logprob for o in outs for e in o.prompt_logprobs[1:]]


def transformers_logprobs(gguf: Path, windows: list[list[int]]) -> list[float]:
    """The same tokens scored by transformers loading the GGUF in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    scored = []
    for ids in windows:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        scored += logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    return scored


def float_checkpoint(gguf: Path, models: Path) -> Path:
    """transformers' float32 reading of the GGUF, saved as a checkpoint directory (once; its
    config.json last, so a directory that has one is whole)."""
    out = models / f"{gguf.stem}-float32"
    if not (out / "config.json").is_file():
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the GGUF's: the saved tensors are plain float32
        tied = config.get("tie_word_embeddings", False)
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()
                   if not (tied and k == "lm_head.weight")}
        out.mkdir(parents=True, exist_ok=True)
        tokenizer(gguf).save_pretrained(out)
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def quantized_checkpoint(gguf: Path, models: Path, scheme: QuantScheme) -> Path:
    """The float checkpoint quantized by ``scheme`` with compressed-tensors (once)."""
    out = models / f"{gguf.stem}-{scheme.name}"
    if not (out / "config.json").is_file():
        quantize_checkpoint(float_checkpoint(gguf, models), out, scheme)
    return out


def compile_artifact(model: Path, dtype: str, out: Path, cache: Path, k: int = 0,
                     backend: str = "inductor") -> Path:
    """``model`` (a GGUF or a checkpoint directory) compiled with ``CONFIG``'s grid."""
    out.parent.mkdir(parents=True, exist_ok=True)
    config = out.with_suffix(".toml")
    config.write_text(CONFIG.format(model=model.as_posix(), dtype=dtype, k=k, backend=backend))
    report = Compiler(load_config(config), out, cache).run(jobs=1)
    if report.failed:
        raise SystemExit(f"compile of {model.name} failed: {[o.error for o in report.failed]}")
    return out


def quality_rows(gguf: Path, work: Path, tokens: int) -> list[list[str]]:
    """One row per model: nb's perplexity, transformers' (float32), the ratio to nb's float32."""
    windows, cache = text_windows(gguf, tokens), work / "cache"
    models = {"float32": (gguf, "float32", "float32"), "bfloat16": (gguf, "bfloat16", "bfloat16")}
    models |= {LABELS[s.name]: (quantized_checkpoint(gguf, work / "models", s), "float32", s.name)
               for s in SCHEMES}
    ppl = {name: perplexity(nb_logprobs(compile_artifact(model, dtype, work / out, cache), windows))
           for name, (model, dtype, out) in models.items()}
    reference = perplexity(transformers_logprobs(gguf, windows))
    text = sha256_file(TEXT)[:12]
    print(f"{TEXT.name} ({text}), {tokens} tokens: transformers float32 {reference:.4f}")
    rows = []
    for name, value in ppl.items():
        print(f"nb {name}: {value:.4f} ({value / ppl['float32']:.4f} of nb float32)")
        theirs = f"{reference:.4f}" if name == "float32" else "-"
        rows.append([name, text, str(tokens), f"{value:.4f}", f"{ppl['float32']:.4f}", theirs])
    return rows


def spec_prompts(gguf: Path) -> list[list[int]]:
    """Chat prompts of ``SPEC_TASKS``, each over its own passage of the text."""
    tok, ids = tokenizer(gguf), text_windows(gguf, SPEC_PASSAGE * len(SPEC_TASKS), SPEC_PASSAGE)
    prompts = []
    for task, passage in zip(SPEC_TASKS, ids, strict=True):
        message = {"role": "user", "content": task.format(passage=tok.decode(passage))}
        prompts.append(list(tok.apply_chat_template([message], add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]))
    return prompts


def greedy_alone(engine: LLMEngine, prompts: list[list[int]], new: int) -> list[RequestOutput]:
    """Each prompt alone (concurrency 1), greedy, ``new`` tokens or its end of sequence."""
    return [generate(engine, [p], SamplingParams(max_tokens=new, temperature=0))[0] for p in prompts]


def spec_round(engine: LLMEngine, prompts: list[list[int]], new: int) -> tuple[list[str], float]:
    """``greedy_alone``'s texts and generated tokens per second."""
    start = time.perf_counter()
    outs = greedy_alone(engine, prompts, new)
    return [o.text for o in outs], sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def speculation(gguf: Path, work: Path, k: int, rounds: int) -> list[str]:
    """The row of greedy replies with n-gram drafts against without, alternating; identical texts."""
    cache, prompts = work / "cache", spec_prompts(gguf)
    plain = LLMEngine.open(compile_artifact(gguf, "float32", work / "float32", cache))
    wide = compile_artifact(gguf, "float32", work / f"float32-k{k}", cache, k)
    drafting = LLMEngine.open(wide, speculative=SpeculativeConfig(num_speculative_tokens=k, auto_off=False))
    engines = {"plain": plain, "ngram": drafting}
    for engine in engines.values():  # a first pass untimed: whatever a first call costs is paid
        spec_round(engine, prompts, SPEC_NEW)
    texts: dict[str, list[list[str]]] = {name: [] for name in engines}

    def run(name: str, _: int) -> dict[str, dict[str, float]]:
        got, rate = spec_round(engines[name], prompts, SPEC_NEW)
        texts[name].append(got)
        return {"replies": {"tok_s": rate}}

    figures = spreads(run_rounds(list(engines), rounds, run))
    st = {name: cells["replies"]["tok_s"] for name, cells in figures.items()}
    if texts["plain"] != texts["ngram"]:
        sys.exit("greedy texts differ with n-gram speculation")
    stats = drafting.spec_stats
    return ["SmolLM2-135M-Instruct float32", str(k), str(len(prompts)), str(SPEC_NEW), str(rounds),
            f"{stats.acceptance_rate:.0%}", f"{stats.mean_accepted_length:.2f}",
            f"{st['plain'].median:.1f}", f"{st['ngram'].median:.1f}",
            f"{st['plain'].cell('.1f')} ; {st['ngram'].cell('.1f')}", "yes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text to score")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nb-bench-quality",
                        help="artifacts, checkpoints and graph cache, kept between runs")
    parser.add_argument("--speculation", action="store_true", help="the n-gram speculation run instead")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per decode row")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (at least 3)")
    add_results_argument(parser)
    args = parser.parse_args()
    gguf = fetch()
    if args.speculation:
        if args.rounds < 3:
            parser.error("--rounds must be at least 3")
        SPEC_TABLE.write(args.results, [speculation(gguf, args.work, args.k, args.rounds)])
        return
    TABLE.write(args.results, quality_rows(gguf, args.work, args.tokens))


if __name__ == "__main__":
    main()

"""``nb generate``: prompts in, text (or token ids) out, streamed as the tokens arrive.

Outputs are printed in prompt order: the first unfinished request streams its text as each step
adds to it, the ones behind it are held and printed when their turn comes, so several prompts
never interleave. Generated text goes to stdout exactly as decoded (model output is data, never
markup); why each request finished goes to stderr.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from neuron_buckets.cli.console import err, int_list
from neuron_buckets.cli.lora_option import lora_modules
from neuron_buckets.utils.errors import UserError

if TYPE_CHECKING:  # the serve stage loads on first use, keeping every other `nb` command cheap
    from neuron_buckets.config.speculative import SpeculativeConfig
    from neuron_buckets.engine.llm_engine import LLMEngine
    from neuron_buckets.engine.request_output import RequestOutput


def finish_detail(o: RequestOutput, eos: frozenset[int], max_tokens: int) -> str:
    """Why a request ended, in words."""
    if o.finish_reason == "stop" and isinstance(o.stop_reason, str):
        return f"stop string {o.stop_reason!r}"
    if o.finish_reason == "stop":
        return f"{'end-of-sequence' if o.stop_reason in eos else 'stop'} token {o.stop_reason}"
    if o.finish_reason == "length":
        return f"max-new-tokens {max_tokens} reached"
    return str(o.finish_reason)


def stream(engine: LLMEngine, order: list[int], as_text: bool, max_tokens: int) -> None:
    """Step ``engine`` until the requests in ``order`` finish, printing them in that order."""
    held = dict.fromkeys(order, "")
    final: dict[int, RequestOutput] = {}
    shown = 0
    while shown < len(order):
        for o in engine.step():
            held[o.request_id] += o.new_text
            if o.finished:
                final[o.request_id] = o
        while shown < len(order):
            rid = order[shown]
            if as_text:
                sys.stdout.write(held[rid])
                sys.stdout.flush()
                held[rid] = ""
            if rid not in final:
                break
            o = final[rid]
            sys.stdout.write("\n" if as_text else ",".join(map(str, o.token_ids)) + "\n")
            sys.stdout.flush()
            detail = finish_detail(o, engine.eos_token_ids, max_tokens)
            err.print(f"[request {shown}: {len(o.token_ids)} tokens, {o.finish_reason}: {detail}]")
            shown += 1


def print_stats(engine: LLMEngine) -> None:
    table = Table(title="bucket counters")
    for col in ("bucket", "calls", "real tokens", "computed tokens", "padding share"):
        table.add_column(col)
    counters = [*engine.stats.items(), *((f"draft {name}", s) for name, s in engine.draft_stats.items())]
    for label, s in counters:
        if s.calls:
            cells = (s.calls, s.real_tokens, s.computed_tokens, f"{s.padding_share:.1%}")
            table.add_row(label, *map(str, cells))
    err.print(table)
    pool = engine.pool
    if pool.enable_prefix_caching:
        rate = pool.hits / pool.queries if pool.queries else 0.0
        err.print(f"prefix cache: {pool.hits} of {pool.queries} prompt tokens hit ({rate:.0%})")
    else:
        err.print("prefix cache: off")
    kv = engine.kv_cache
    err.print(f"KV cache: {kv.num_preemptions} preemptions, at most {kv.peak_usage:.0%} of "
              f"{engine.pool.num_blocks - 1} blocks in use")
    if (lora := engine.adapters).requests:
        counts = ", ".join(f"{n}: {c}" for n, c in sorted(lora.requests.items()))
        err.print(f"LoRA: requests per adapter {counts}; {lora.swaps} adapters swapped into a slot")
    if (spec := engine.spec_stats).num_drafts or spec.num_steps_off:
        err.print(
            f"speculation: {spec.num_drafts} drafted rows, {spec.num_accepted_tokens} of "
            f"{spec.num_draft_tokens} draft tokens accepted ({spec.acceptance_rate:.0%}), "
            f"mean accepted length {spec.mean_accepted_length:.2f}, "
            f"{spec.num_steps_off} steps with speculation off (it did not pay)",
            soft_wrap=True,
        )


IDS = "comma separated; repeat for more"
SPECULATIVE_HELP = (
    "Draft up to K tokens per decode row by prompt lookup (n-grams of 1 to 4), verified in the same "
    "step; K <= the artifact's speculation_length. 0 = off"
)
DRAFT_HELP = (
    "Draft K tokens per decode row with the draft model compiled into the artifact's draft/ "
    "(speculative.method = 'draft_model'); K <= the artifact's speculation_length. 0 = off"
)


LORA_HELP = "A LoRA adapter NAME=PATH (a PEFT directory) for an artifact with [lora] slots; repeatable"
ADAPTER_HELP = (
    "The adapter (a --lora NAME, or 'base') of each prompt, in order; one for all. Default: the one "
    "--lora adapter, else the base model"
)


def prompt_adapters(loras: dict[str, Path], adapters: list[str], prompts: int) -> list[str | None]:
    """Each prompt's adapter name, None for the base model."""
    if not adapters:
        return [next(iter(loras)) if len(loras) == 1 else None] * prompts
    if len(adapters) not in (1, prompts):
        raise UserError(f"--adapter: {len(adapters)} given for {prompts} prompts; give one or one per prompt")
    names = [None if a == "base" else a for a in adapters]
    if unknown := sorted({n for n in names if n is not None} - set(loras)):
        raise UserError(f"--adapter {unknown[0]!r} is no --lora name; given: {sorted(loras)}")
    return names * prompts if len(names) == 1 else names


CONFIG_HELP = (
    "Runtime file: TOML whose [speculative] table sets the drafting (method, num_speculative_tokens, "
    "prompt lookup lengths, auto_off); no compile setting; --speculative-* flags override it"
)
ConfigOpt = Annotated[Path | None, typer.Option("--config", help=CONFIG_HELP)]


def speculative_config(ngram: int, draft: int, config: Path | None = None) -> SpeculativeConfig | None:
    """The drafting to run: the runtime file ``config``'s, its drafter and drafts per row replaced
    by ``--speculative-ngram`` or ``--speculative-draft`` (one of the two); None when no option
    was given (off), so an artifact that does not decode can refuse any that was."""
    from neuron_buckets.config.runtime_file import load_runtime_config
    from neuron_buckets.config.speculative import SpeculativeConfig

    if ngram and draft:
        raise UserError("--speculative-ngram and --speculative-draft each pick a drafter: give one")
    if not (config or ngram or draft):
        return None
    spec = load_runtime_config(config) if config else SpeculativeConfig()
    if draft:
        return replace(spec, method="draft_model", num_speculative_tokens=draft)
    if ngram:
        return replace(spec, method="ngram", num_speculative_tokens=ngram)
    return spec


def generate(
    directory: Annotated[Path, typer.Argument(help="Artifact directory")],
    prompt: Annotated[list[str] | None, typer.Option(help="Prompt text; repeat for more")] = None,
    prompt_ids: Annotated[list[str] | None, typer.Option(help=f"Prompt token ids, {IDS}")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Apply the chat template to each --prompt")] = False,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 16,
    min_new_tokens: Annotated[int, typer.Option(min=0, help="No stop ends a request before this")] = 0,
    temperature: Annotated[float, typer.Option(help="below 1e-5 (0 included) = greedy")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 = off")] = 0,
    top_p: Annotated[float, typer.Option(help="Keep the fewest most likely tokens of this mass")] = 1.0,
    min_p: Annotated[float, typer.Option(help="Keep tokens of at least this fraction of the top one")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option(help="Above 1 discourages tokens already seen")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed of each request's sampling")] = None,
    stop_token_id: Annotated[
        list[str] | None, typer.Option("--stop-token-id", help=f"Ids that end a request, {IDS}")
    ] = None,
    stop: Annotated[list[str] | None, typer.Option(help="A string that ends a request; repeatable")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Run past end-of-sequence tokens")] = False,
    speculative_ngram: Annotated[int, typer.Option(min=0, help=SPECULATIVE_HELP)] = 0,
    speculative_draft: Annotated[int, typer.Option(min=0, help=DRAFT_HELP)] = 0,
    config: ConfigOpt = None,
    lora: Annotated[list[str] | None, typer.Option("--lora", help=LORA_HELP)] = None,
    adapter: Annotated[list[str] | None, typer.Option("--adapter", help=ADAPTER_HELP)] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print per-bucket and speculation counters")] = False,
) -> None:
    """Generate through the runtime (continuous batching, packed and chunked prefill): text for
    --prompt, token ids for --prompt-ids; says why each request finished."""
    from neuron_buckets.engine.llm_engine import LLMEngine
    from neuron_buckets.engine.sampling_params import SamplingParams
    from neuron_buckets.engine.tokenizer import Tokenizer
    from neuron_buckets.runtime.bucket_runtime import BucketRuntime
    from neuron_buckets.runtime.rank_worker import follower

    if bool(prompt) == bool(prompt_ids):
        raise UserError("give the prompts as text (--prompt) or as token ids (--prompt-ids): one of the two")
    if chat and not prompt:
        raise UserError("--chat applies the chat template to text: use it with --prompt")
    ids = [int_list("--prompt-ids", p) for p in prompt_ids or ()]
    stop_ids = [t for text in stop_token_id or () for t in int_list("--stop-token-id", text)]
    params = SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed, stop_token_ids=tuple(stop_ids),
        stop=tuple(stop or ()), ignore_eos=ignore_eos, min_tokens=min_new_tokens,
    )
    if (rank := follower(directory)) is not None:  # a rank other than 0 (torchrun starts every rank)
        rank.run()
        return
    runtime = BucketRuntime.open(directory)
    tokenizer = Tokenizer.open(directory) if prompt or stop else None
    if prompt:
        if tokenizer is None:
            raise UserError(f"{directory} has no tokenizer (its model directory had none): use --prompt-ids")
        if chat:
            ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompt]
        else:
            ids = [tokenizer.encode(p) for p in prompt]
    speculative = speculative_config(speculative_ngram, speculative_draft, config)
    engine = LLMEngine(runtime, tokenizer, speculative=speculative)
    loras = lora_modules("--lora", lora)
    names = prompt_adapters(loras, adapter or [], len(ids))
    for name, path in loras.items():
        engine.adapters.add(name, path)
    checked = [engine.check_request(p, params, f"prompt {i}") for i, p in enumerate(ids)]
    order = [engine.add_request(p, params, n) for p, n in zip(checked, names, strict=True)]
    stream(engine, order, bool(prompt), max_new_tokens)
    if stats:
        print_stats(engine)
    runtime.close()  # a tensor-parallel artifact's other ranks end with it


def register(app: typer.Typer) -> None:
    """Add ``generate`` to the ``nb`` app."""
    app.command(short_help="Generate from an artifact: text or token ids in and out.")(generate)


"""The step-wise engine over a ``BucketRuntime``: add requests, step, read what each step produced.

nano-vllm's ``LLMEngine`` in miniature, and a step is straight-line code: the scheduler plans it
(``engine/scheduler.py``: prefill chunks up to the token budget, a continuing prompt first, and a
decode row for every request whose prompt is complete), the runtime runs the plan on its buckets,
the step sampler picks the tokens of every segment that returned logits, and the scheduler commits
them. Blocks are taken per step for the tokens actually written, never for padding; when they run
short the newest request is preempted and later recomputed (``engine/kv_cache_manager.py``), its
reported tokens unchanged. A request ends at an end-of-sequence token, one of its stop tokens or
strings, its ``max_tokens``, or an abort, and gives its blocks back at once. Requests may be
added and aborted between steps. Tokens are picked on the host (``engine/step_sampler.py``), each
request with its own parameters and random generator, under its grammar's mask when it has
structured outputs (``engine/structured_output_manager.py``); asked-for logprobs come from the raw
logits (``engine/logprobs.py``), a prompt's from the logits its chunks return for every token when
its request asks (docs/design.md, "Prompt logits").

On an artifact compiled with ``speculation_length > 0`` decode rows carry
``1 + speculation_length`` positions. Without a ``SpeculativeConfig`` the engine sends one real
token per row and the runtime pads the others (slot -1: no cache write, no block; causal
attention keeps them out of the real token's output). With one (``speculative=``, or
``nb generate/serve --speculative-ngram K``) each decode row carries the last token and up to
K prompt-lookup drafts (``engine/ngram_drafter.py``), verified in the same step
(``engine/rejection_sampler.py``): greedy requests keep the drafts the target's argmax agrees
with, so their tokens are exactly those without speculation; sampled ones use rejection
sampling, which keeps the target's distribution. ``spec_stats`` counts drafts and acceptances;
``step_stats`` counts steps and their wall seconds, in graph calls and in all; with
``NB_TRACE_TTFT=1``, ``ttft`` breaks each served request's time to first token into parts
(``engine/ttft_trace.py``).
With ``method = "draft_model"`` the drafts come from the artifact's compiled draft model instead
(``engine/draft_model_drafter.py``), which also prefills every prompt chunk the target does.
Drafting stops by itself while it does not pay and is tried again now and then
(``engine/speculation_gate.py``; ``auto_off`` in ``[speculative]``), so rows without drafts
still run the wide graphs then; ``spec_stats.num_steps_off`` counts those steps.

Single-threaded: a server drives it from one loop thread.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from neuron_buckets.artifact.manifest import Manifest
from neuron_buckets.config.speculative import SpeculativeConfig
from neuron_buckets.core.step_plan import StepPlan
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.draft_model_drafter import DraftModelDrafter
from neuron_buckets.engine.drafter import Drafter
from neuron_buckets.engine.kv_cache_manager import KVCacheManager
from neuron_buckets.engine.lora_pool import AdapterPool
from neuron_buckets.engine.ngram_drafter import NgramDrafter
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.request_check import RequestError, check_request
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.scheduler import Scheduler
from neuron_buckets.engine.spec_decode_stats import SpecDecodeStats
from neuron_buckets.engine.speculation_gate import SpeculationGate
from neuron_buckets.engine.step_sampler import StepSampler
from neuron_buckets.engine.step_stats import StepStats
from neuron_buckets.engine.structured_output_manager import StructuredOutputManager
from neuron_buckets.engine.tokenizer import Tokenizer
from neuron_buckets.engine.ttft_trace import TTFTTrace
from neuron_buckets.runtime.bucket_runtime import BucketRuntime
from neuron_buckets.runtime.bucket_stats import BucketStats
from neuron_buckets.utils.errors import UserError


class CacheOwned(UserError, RuntimeError):
    """An engine that would share its runtime's KV cache with another one, refused."""


def prefix_salt(manifest: Manifest) -> bytes:
    """What besides its tokens decides a cached block's K/V: the model and the cache's geometry
    and dtype. Two artifacts that differ in any of them never share a block's name."""
    identity = {"model": manifest.model.config, "weights": manifest.weights and manifest.weights.sha256,
                "cache": asdict(manifest.cache)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


class LLMEngine:
    def __init__(
        self,
        runtime: BucketRuntime,
        tokenizer: Tokenizer | None = None,
        pool: BlockPool | None = None,
        eos_token_ids: Sequence[int] | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """``pool`` defaults to one covering the runtime's whole cache, with prefix caching as the
        artifact was configured (``cache.enable_prefix_caching``); pass a smaller one to bound
        the blocks in use. ``eos_token_ids`` defaults to the artifact's (from the model
        directory's generation_config.json or config.json; none for older artifacts).
        ``speculative`` turns drafting on; its drafts must fit the artifact's decode rows.

        A runtime's KV cache has one engine at a time, the newest: it is refused with one line
        while the runtime's engine has unfinished requests, and the engine it replaces refuses
        to run from then on (its prefix cache names blocks the new one reuses)."""
        runtime.check_generates()
        self.runtime, self.tokenizer = runtime, tokenizer
        self.pool = pool or BlockPool(
            runtime.num_blocks, runtime.block_size, runtime.manifest.decode.enable_prefix_caching,
            prefix_salt(runtime.manifest),
        )
        if self.pool.block_size != runtime.block_size or self.pool.num_blocks > runtime.num_blocks:
            raise ValueError(
                f"pool of {self.pool.num_blocks} blocks of {self.pool.block_size} does not fit the runtime's "
                f"cache ({runtime.num_blocks} blocks of {runtime.block_size})"
            )
        text = runtime.manifest.text
        default = text.eos_token_ids if text else []
        self.eos_token_ids = frozenset(default if eos_token_ids is None else eos_token_ids)
        spec = speculative or SpeculativeConfig()
        spec.check_fits(runtime.buckets.decode_seq - 1)
        draft_model = spec.enabled and spec.uses_draft_model
        self.kv_cache = KVCacheManager(self.pool, follows_draft=draft_model)  # the drafter reads it
        self.drafter: Drafter | None = None
        if draft_model:
            self.drafter = DraftModelDrafter.open(runtime, self.kv_cache)
        elif spec.enabled:
            self.drafter = NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.spec_stats = SpecDecodeStats()
        self.gate: SpeculationGate | None = None
        if self.drafter is not None and spec.auto_off:
            self.gate = SpeculationGate(
                self.drafter, self.spec_stats, spec.auto_off_window, spec.auto_off_probe_interval
            )
        self.adapters = AdapterPool(runtime)  # LoRA adapters by name (``add``, ``remove``)
        self.scheduler = Scheduler(
            self.kv_cache, runtime.buckets.token_budget, runtime.buckets.max_rows,
            self.gate or self.drafter, spec.num_speculative_tokens,
            [b.seq for b in runtime.buckets.prefill], runtime.buckets.mix_decode, self.adapters,
        )
        self.step_stats = StepStats()
        self.ttft = TTFTTrace.from_env()  # None unless NB_TRACE_TTFT=1; the server feeds it arrivals
        self.sampler = StepSampler(self.spec_stats, None if tokenizer is None else StructuredOutputManager(
            tokenizer.hf, runtime.config.vocab_size, self.eos_token_ids, self.step_stats
        ))
        self._requests: dict[int, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._next_id = 0
        if isinstance(previous := runtime.owner, LLMEngine) and previous.has_unfinished:
            raise CacheOwned(f"{runtime.directory}: this runtime's engine still has requests; add these "
                             "to it (generate(engine, ...)), or open another runtime")
        runtime.claim(self)  # last: an engine refused above never takes the cache

    @classmethod
    def open(
        cls,
        directory: str | Path,
        device: str | None = None,
        speculative: SpeculativeConfig | None = None,
        preload: bool = False,
        manifest: Manifest | None = None,
    ) -> LLMEngine:
        """An engine over an artifact directory (its ``manifest``, if read already): its runtime
        (every graph loaded now with ``preload``) and its tokenizer (if it has one)."""
        runtime = BucketRuntime.open(directory, device, preload=preload, manifest=manifest)
        return cls(runtime, Tokenizer.open(directory, runtime.manifest), speculative=speculative)

    @property
    def max_model_len(self) -> int:
        return self.runtime.max_model_len

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests or self._aborted)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def stats(self) -> dict[str, BucketStats]:
        """The runtime's per-bucket counters: calls, real tokens, padded tokens."""
        return self.runtime.stats

    @property
    def draft_stats(self) -> dict[str, BucketStats]:
        """The draft model's per-bucket counters; none without a draft model."""
        return self.drafter.runtime.stats if isinstance(self.drafter, DraftModelDrafter) else {}

    def check_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, what: str = "prompt"
    ) -> list[int]:
        """The prompt as ints, or a RequestError (one line) for a request that could never complete."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"{what}: expected SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"{what}: stop strings need a tokenizer, and this engine has none")
        self.sampler.check(params, what)
        return check_request(prompt_token_ids, params.max_tokens, self.runtime.limits, self.pool, what)

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, lora: str | None = None
    ) -> int:
        """Queue a request (of LoRA adapter ``lora``, a name ``adapters.add`` registered; None: the
        base model); its id. It waits, never refused, while the pool or the slots are busy."""
        self._check_owner()
        ids = self.check_request(prompt_token_ids, params)
        adapter = None if lora is None else self.adapters.get(lora)
        rid, self._next_id = self._next_id, self._next_id + 1
        request = Request.create(rid, ids, params, self.eos_token_ids, self.tokenizer)
        if adapter is not None:
            request.lora, request.lora_salt = lora, bytes.fromhex(adapter.digest)
        self.sampler.admit(request)
        self._requests[rid] = request
        self.scheduler.add(request)
        return rid

    def abort(self, request_id: int) -> None:
        """End a request now and free its blocks; the next step reports it, reason "abort".
        Unknown or finished ids are ignored (a client may leave as its request ends)."""
        if (request := self._requests.pop(request_id, None)) is None:
            return
        self.scheduler.abort(request)
        self._aborted.append(request.output())

    def step(self) -> list[RequestOutput]:
        """One step: plan it, run the plan, sample, commit. An output for every request that got
        tokens or finished (aborted ones included)."""
        outputs, self._aborted = self._aborted, []
        if not self.scheduler.busy:
            return outputs
        self._check_owner()
        start, accepted = time.perf_counter(), self.spec_stats.num_accepted_tokens
        plan = self.scheduler.schedule()
        logits, graph_seconds = self._run(plan)
        sampled = self.sampler.sample(plan, [self._requests[s.request_id] for s in plan], logits)
        for request in self.scheduler.commit(plan, sampled):
            outputs.append(request.output())
            if request.done:
                del self._requests[request.request_id]
        seconds = time.perf_counter() - start
        if self.ttft is not None:
            self.ttft.stepped(plan, start, outputs)
        self.step_stats.add(seconds, graph_seconds)
        if self.gate is not None:
            self.gate.observe(seconds, self.spec_stats.num_accepted_tokens - accepted)
        return outputs

    def _run(self, plan: StepPlan) -> tuple[Tensor, float]:
        """The plan's logits from the runtime, the drafter following its prompt chunks, and the
        seconds of both (the target's calls and the draft's catch-up)."""
        start = time.perf_counter()
        # empty only when the requests it had ended as it was planned (the pool could not hold them)
        logits = self.runtime.run_plan(plan) if plan else torch.empty(0)
        if (drafter := self.scheduler.drafter) is not None:  # the gate, when there is one
            chunks = [(r, s) for s in plan
                      if s.context_len < self.kv_cache.prefill_len(r := self._requests[s.request_id])]
            drafter.follow(chunks)
        return logits, time.perf_counter() - start

    def use_manifest(self, manifest: Manifest) -> None:
        """Move to another version of this artifact's buckets between two steps
        (``BucketRuntime.use_manifest``); the requests, their blocks and the prefix cache carry on,
        and the scheduler cuts steps at the new token buckets from the next step."""
        self.runtime.use_manifest(manifest)
        self.scheduler.token_buckets = tuple(sorted(b.seq for b in self.runtime.buckets.prefill))

    def _check_owner(self) -> None:
        if self.runtime.owner is not self:
            raise CacheOwned(f"{self.runtime.directory}: a newer engine took this engine's runtime, and "
                             "its KV cache with it; use that engine")


def generate(
    engine_or_runtime: LLMEngine | BucketRuntime,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    loras: Sequence[str | None] | None = None,
) -> list[RequestOutput]:
    """Run ``prompts`` to the end; their final outputs, in prompt order.

    ``params`` is one SamplingParams for all (default: greedy, 16 tokens) or one per prompt;
    ``loras`` the LoRA adapter of each prompt (None: the base model), loaded in the engine.
    Every request is checked before any is added, so an impossible one fails before anything
    runs. A runtime runs on the engine that holds its cache, if one lives (a second engine with
    a pool of its own would overwrite blocks the first one's prefix cache names), else on one of
    its own (no tokenizer: no text, no stop strings); an engine's other requests advance too.
    """
    if isinstance(params, int):  # the 0.1 signature, generate(runtime, prompts, max_new_tokens)
        raise TypeError(f"generate() takes SamplingParams now: pass SamplingParams(max_tokens={params!r})")
    engine = engine_or_runtime
    if not isinstance(engine, LLMEngine):
        owner = engine.owner
        engine = owner if isinstance(owner, LLMEngine) else LLMEngine(engine)
    params = SamplingParams() if params is None else params
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling parameters")
    pairs = list(zip(prompts, per_prompt, strict=True))
    checked = [engine.check_request(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(pairs)]
    loras = [None] * len(prompts) if loras is None else list(loras)
    if len(loras) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(loras)} adapters")
    for name in {n for n in loras if n is not None}:
        engine.adapters.get(name)  # an unknown one fails before anything is added
    ids = [engine.add_request(p, sp, lo) for p, (_, sp), lo in zip(checked, pairs, loras, strict=True)]
    wanted, final = set(ids), {}
    while len(final) < len(ids):
        final.update((o.request_id, o) for o in engine.step() if o.finished and o.request_id in wanted)
    return [final[i] for i in ids]

"""The step-wise engine over a ``BucketRuntime``: add requests, step, read what each step produced.

nano-vllm's ``LLMEngine`` in miniature, over the bookkeeping of ``engine/scheduler.py``: each step
prefills one packed call (a continuing prompt first, then newly admitted ones, up to the token
budget), then decodes every request whose prompt is complete in one batch (the runtime splits
it over the decode buckets). Blocks are taken per step for the tokens actually written, never
for padding. A request ends at an end-of-sequence token, one of its stop tokens or strings, its
``max_tokens``, or an abort, and gives its blocks back at once. Requests may be added and
aborted between steps. Tokens are picked on the host (``engine/sampler.py``), each request with
its own parameters and random generator.

On an artifact compiled with ``speculation_length > 0`` decode rows carry
``1 + speculation_length`` positions; the engine sends one real token per row and the runtime
pads the others (slot -1: no cache write, no block; causal attention keeps them out of the real
token's output), so such artifacts generate the same tokens, without the speedup of drafts.

Single-threaded: a server drives it from one loop thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from neuron_buckets.core.padding import DecodeRow, PrefillChunk
from neuron_buckets.engine.block_pool import BlockPool
from neuron_buckets.engine.detokenizer import Detokenizer
from neuron_buckets.engine.request import Request
from neuron_buckets.engine.request_check import RequestError, check_request
from neuron_buckets.engine.request_output import RequestOutput
from neuron_buckets.engine.sampler import sample
from neuron_buckets.engine.sampling_params import SamplingParams
from neuron_buckets.engine.scheduler import Chunks, Scheduler
from neuron_buckets.engine.tokenizer import Tokenizer
from neuron_buckets.runtime.bucket_runtime import BucketRuntime, BucketStats


@dataclass
class Tracked:
    """The engine's side of a request: how it samples and stops, and what was already reported."""

    request: Request
    params: SamplingParams
    generator: torch.Generator | None  # None for greedy requests, which draw nothing
    detokenizer: Detokenizer | None  # None without a tokenizer
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0


class LLMEngine:
    def __init__(
        self,
        runtime: BucketRuntime,
        tokenizer: Tokenizer | None = None,
        pool: BlockPool | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        """``pool`` defaults to one covering the runtime's whole cache; pass a smaller one to bound
        the blocks in use. ``eos_token_ids`` defaults to the artifact's (from the model
        directory's generation_config.json or config.json; none for older artifacts)."""
        self.runtime, self.tokenizer = runtime, tokenizer
        self.pool = pool or BlockPool(runtime.num_blocks, runtime.block_size)
        if self.pool.block_size != runtime.block_size or self.pool.num_blocks > runtime.num_blocks:
            raise ValueError(
                f"pool of {self.pool.num_blocks} blocks of {self.pool.block_size} does not fit the runtime's "
                f"cache ({runtime.num_blocks} blocks of {runtime.block_size})"
            )
        text = runtime.manifest.text
        default = text.eos_token_ids if text else []
        self.eos_token_ids = frozenset(default if eos_token_ids is None else eos_token_ids)
        budget = max(b.seq for b in runtime.prefill_buckets)
        self.scheduler = Scheduler(self.pool, budget, runtime.max_rows, stop=self._stop)
        self._tracked: dict[int, Tracked] = {}
        self._aborted: list[RequestOutput] = []
        self._next_id = 0

    @classmethod
    def open(cls, directory: str | Path, device: str | None = None) -> LLMEngine:
        """An engine over an artifact directory: its runtime and its tokenizer (if it has one)."""
        return cls(BucketRuntime.open(directory, device), Tokenizer.open(directory))

    @property
    def max_model_len(self) -> int:
        return self.runtime.max_model_len

    @property
    def has_unfinished(self) -> bool:
        return bool(self._tracked or self._aborted)

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

    def check_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, what: str = "prompt"
    ) -> list[int]:
        """The prompt as ints, or a RequestError (one line) for a request that could never complete."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"{what}: expected SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"{what}: stop strings need a tokenizer, and this engine has none")
        return check_request(prompt_token_ids, params.max_tokens, self.runtime.limits, self.pool, what)

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; its id. It waits, never refused, while the pool is busy."""
        ids = self.check_request(prompt_token_ids, params)
        rid, self._next_id = self._next_id, self._next_id + 1
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()  # a fresh nondeterministic seed
            else:
                generator.manual_seed(params.seed)
        detokenizer = Detokenizer(self.tokenizer, params.stop) if self.tokenizer else None
        request = Request(rid, ids, len(ids), params.max_tokens)
        self._tracked[rid] = Tracked(request, params, generator, detokenizer)
        self.scheduler.add(request)
        return rid

    def abort(self, request_id: int) -> None:
        """End a request now and free its blocks; the next step reports it, reason "abort".
        Unknown or finished ids are ignored (a client may leave as its request ends)."""
        if (t := self._tracked.pop(request_id, None)) is None:
            return
        self.scheduler.abort(t.request)
        self._aborted.append(self._output(t))

    def step(self) -> list[RequestOutput]:
        """One scheduler step: at most one packed prefill call, then one decode batch. An output
        for every request that got tokens or finished (aborted ones included)."""
        outputs, self._aborted = self._aborted, []
        if self.scheduler.busy:
            for request in self.scheduler.step(self._prefill, self._decode):
                t = self._tracked[request.index]
                outputs.append(self._output(t))
                if request.done:
                    del self._tracked[request.index]
        return outputs

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        tracked = [self._tracked[r.index] for r in requests]
        params, generators = [t.params for t in tracked], [t.generator for t in tracked]
        return sample(logits, params, generators, [r.tokens for r in requests])

    def _prefill(self, chunks: Chunks) -> list[int]:
        logits = self.runtime.prefill([PrefillChunk(r.tokens[r.cached : r.cached + n], r.cached, r.blocks)
                                       for r, n in chunks])
        # only a chunk that completes its prompt samples: a cut one must not draw from its generator
        rows = [i for i, (r, n) in enumerate(chunks) if r.cached + n >= r.prompt_len]
        tokens = [0] * len(chunks)
        if rows:
            for i, token in zip(rows, self._sample(logits[rows], [chunks[i][0] for i in rows]), strict=True):
                tokens[i] = token
        return tokens

    def _decode(self, batch: list[Request]) -> list[int]:
        rows = [DecodeRow(r.tokens[-1:], len(r.tokens) - 1, r.blocks) for r in batch]
        return self._sample(self.runtime.decode(rows)[:, 0], batch)  # position 0: each row's real token

    def _stop(self, request: Request) -> str | None:
        """After each new token: "stop" if it ends the request early, else None (the scheduler
        ends it as "length" at max_tokens). A stop token is not text; a stop string is cut."""
        t = self._tracked[request.index]
        token = request.tokens[-1]
        if (token in self.eos_token_ids and not t.params.ignore_eos) or token in t.params.stop_token_ids:
            t.stop_reason = token
        elif t.detokenizer is not None:
            t.stop_reason = t.detokenizer.push(token)
        return "stop" if t.stop_reason is not None else None

    def _output(self, t: Tracked) -> RequestOutput:
        """What ``t`` has that was not reported yet."""
        r = t.request
        finished = r.done
        text = ""
        if t.detokenizer is not None:
            if finished:
                t.detokenizer.flush()
            text = t.detokenizer.visible(finished)
        generated = r.tokens[r.prompt_len :]
        out = RequestOutput(
            request_id=r.index,
            prompt_token_ids=r.tokens[: r.prompt_len],
            token_ids=generated,
            new_token_ids=generated[t.sent_tokens :],
            text=text,
            new_text=text[t.sent_text :],
            finished=finished,
            finish_reason=r.finish_reason,
            stop_reason=t.stop_reason,
        )
        t.sent_tokens, t.sent_text = len(generated), len(text)
        return out


def generate(
    engine_or_runtime: LLMEngine | BucketRuntime,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
) -> list[RequestOutput]:
    """Run ``prompts`` to the end; their final outputs, in prompt order.

    ``params`` is one SamplingParams for all (default: greedy, 16 tokens) or one per prompt.
    Every request is checked before any is added, so an impossible one fails before anything
    runs. A runtime gets an engine of its own (no tokenizer: no text, no stop strings); an
    engine's other requests advance too.
    """
    engine = engine_or_runtime if isinstance(engine_or_runtime, LLMEngine) else LLMEngine(engine_or_runtime)
    params = SamplingParams() if params is None else params
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling parameters")
    pairs = list(zip(prompts, per_prompt, strict=True))
    checked = [engine.check_request(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(pairs)]
    ids = [engine.add_request(p, sp) for p, (_, sp) in zip(checked, pairs, strict=True)]
    wanted, final = set(ids), {}
    while len(final) < len(ids):
        final.update((o.request_id, o) for o in engine.step() if o.finished and o.request_id in wanted)
    return [final[i] for i in ids]

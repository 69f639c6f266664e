"""Which token buckets an artifact should have for the traffic it served, and by how much they
beat the ones it has.

The served trace is replayed through the engine's own scheduler and packing on the artifact's
limits (``traffic/runtime_replay.py``; at the recorded arrivals when it has them), with steps
filled to the token budget whatever the buckets, so every candidate set is scored on the same
calls. Each request prefills its prompt less what it found in the server's prefix cache (the
trace's ``cached_tokens``): that is what the server's prefill computed. The planner's exact
programme (``traffic/planner.py``) then picks at most ``graphs`` token buckets on multiples of
``align``, the largest fixed at the budget, and the choice is scored against the current set on
the same calls: padding is computed tokens beyond the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neuron_buckets.config import Config, enumerate_grid
from neuron_buckets.traffic.padding_stats import padding_stats
from neuron_buckets.traffic.planner import PlanError, optimal_sets
from neuron_buckets.traffic.replay_load import ALL_AT_ONCE, ReplayLoad
from neuron_buckets.traffic.runtime_replay import fit_requests, replay_runtime
from neuron_buckets.traffic.traces import Trace

REPLAY_REQUESTS = 2000  # the newest requests of the trace the replay runs


@dataclass(frozen=True)
class BucketChoice:
    current: tuple[int, ...]
    chosen: tuple[int, ...]
    requests: int  # replayed
    calls: int  # packed prefill calls they ran
    real_tokens: int
    current_computed: int
    chosen_computed: int

    @property
    def padding_before(self) -> int:
        return self.current_computed - self.real_tokens

    @property
    def padding_after(self) -> int:
        return self.chosen_computed - self.real_tokens

    @property
    def gain(self) -> float:
        """The share of the current set's padding the chosen set removes (0 with none to remove)."""
        return 1 - self.padding_after / self.padding_before if self.padding_before else 0.0

    def to_json(self) -> dict:
        return {"current": list(self.current), "chosen": list(self.chosen), "requests": self.requests,
                "calls": self.calls, "real_tokens": self.real_tokens,
                "padding_before": self.padding_before, "padding_after": self.padding_after,
                "gain": self.gain}


def served_calls(config: Config, trace: Trace, limit: int = REPLAY_REQUESTS) -> np.ndarray:
    """The prefill-chunk tokens of each packed call the trace's newest ``limit`` requests run on
    ``config``'s limits, cut by the budget alone (the same calls for every bucket set)."""
    cache = config.cache
    servable = trace.servable(cache.max_model_len)
    if not len(servable):
        raise PlanError(f"no request of the trace fits cache.max_model_len ({cache.max_model_len})")
    newest = slice(max(0, len(servable) - limit), None)
    lens, outputs = fit_requests(servable.prefill_lens[newest], servable.output_lens[newest],
                                 cache.max_model_len, limit)
    arrivals = servable.arrivals
    load = ALL_AT_ONCE if arrivals is None else ReplayLoad.of(None, arrivals[newest] - arrivals[newest][0])
    replay = replay_runtime(lens, outputs, enumerate_grid(config), cache.num_blocks, cache.block_size, None,
                            cache.enable_prefix_caching, load, fit_buckets=False)
    return replay.packed_tokens()


def choose_buckets(config: Config, trace: Trace, graphs: int | None = None, align: int | None = None,
                   limit: int = REPLAY_REQUESTS) -> BucketChoice:
    """The padding-least token buckets for ``trace`` on ``config``'s limits: at most ``graphs``
    (default: as many as now) on multiples of ``align`` (default: the block size when it divides
    the budget, else 1); the current set where nothing on that grid pads less."""
    budget = config.buckets.max_num_batched_tokens
    current = tuple(config.buckets.num_batched_tokens_buckets)
    step = align or (config.cache.block_size if budget % config.cache.block_size == 0 else 1)
    if budget % step:
        raise PlanError(f"the token budget {budget} is not a multiple of --align {step}")
    tokens = served_calls(config, trace, limit)
    if not len(tokens):
        raise PlanError("the replay ran no prefill call: there is nothing to plan")
    # a zero-weight call of the budget itself keeps the largest bucket there (the scheduler's budget)
    weights = np.append(np.ones(len(tokens)), 0.0)
    chosen = optimal_sets(np.append(tokens, budget), graphs or len(current), step, budget, weights)[-1]
    before, after = (int(padding_stats(tokens, s).padded_total) for s in (current, chosen))
    if before <= after:
        chosen, after = current, before
    requests = min(limit, len(trace.servable(config.cache.max_model_len)))
    return BucketChoice(current, tuple(chosen), requests, len(tokens), int(tokens.sum()), before, after)

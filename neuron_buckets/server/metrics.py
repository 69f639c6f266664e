"""The server's Prometheus metrics: vLLM's names where vLLM has one, ``nb:`` for the buckets.

Dashboards and alerts written for ``vllm serve`` read the same series here: requests running and
waiting, time to first token, time per output token, end-to-end latency, a finished request's
queued, prefill, decode and inference seconds, prompt and generation token counters, finished
requests by reason, the prefix cache's query and hit counters (in tokens), preemptions and the KV
cache's usage, and speculative decoding's draft and acceptance counters, all labelled with
``model_name``. What
vLLM has no name for is the point of nb: per-bucket calls, real and computed tokens and the
padding share, the engine's steps with their seconds (``nb:engine_*``: step time under HTTP load, to
compare with the same steps run in-process), and the steps speculation sat out because it did
not pay (``nb:spec_decode_steps_off``). Both kinds of counter are read from the engine's own
at scrape time (so they are exactly ``nb generate --stats``). Each server owns its registry, so
several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from neuron_buckets.engine.spec_decode_stats import SpecDecodeStats
from neuron_buckets.engine.step_stats import StepStats
from neuron_buckets.runtime.bucket_stats import BucketStats

# vLLM's bucket boundaries, so histograms from both servers can be compared bin by bin.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class BucketCollector(Collector):
    """Per-bucket counters, read from the runtime's ``BucketStats`` when Prometheus scrapes, in
    the words every other output uses: calls, real tokens, computed tokens (real and padding) and
    the padding share (padding / computed)."""

    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, BucketStats]]) -> None:
        self.model_name, self.stats = model_name, stats

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "bucket"]
        calls = CounterMetricFamily("nb:bucket_calls", "Graph calls per bucket", labels=labels)
        real = CounterMetricFamily("nb:bucket_real_tokens", "Real tokens run per bucket", labels=labels)
        computed = CounterMetricFamily(
            "nb:bucket_computed_tokens", "Positions computed per bucket: real and padding", labels=labels
        )
        share = GaugeMetricFamily(
            "nb:bucket_padding_share", "Padding / computed tokens per bucket (0 to 1)", labels=labels
        )
        for name, s in list(self.stats().items()):
            key = [self.model_name, name]
            calls.add_metric(key, s.calls)
            real.add_metric(key, s.real_tokens)
            computed.add_metric(key, s.computed_tokens)
            share.add_metric(key, s.padding_share)
        yield from (calls, real, computed, share)


class EngineCounterCollector(Collector):
    """vLLM's counters that the engine keeps itself (the prefix cache's, in prompt tokens, the
    preemptions, and speculative decoding's), read when Prometheus scrapes: acceptance rate =
    accepted / draft tokens, mean accepted length = 1 + accepted / drafts."""

    def __init__(
        self, model_name: str, pool: Callable[[], tuple[int, int]], spec: Callable[[], SpecDecodeStats],
        steps: Callable[[], StepStats], preemptions: Callable[[], int],
    ) -> None:
        self.model_name, self.pool, self.spec, self.steps = model_name, pool, spec, steps
        self.preemptions = preemptions

    def collect(self) -> Iterator[Metric]:
        (queries, hits), s, steps, preemptions = self.pool(), self.spec(), self.steps(), self.preemptions()
        for name, doc, value in (
            ("vllm:num_preemptions", "Requests preempted: blocks taken back, recomputed later", preemptions),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", hits),
            ("vllm:spec_decode_num_drafts", "Decode rows that carried drafts", s.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", s.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", s.num_accepted_tokens),
            ("nb:spec_decode_steps_off", "Steps speculation sat out: it did not pay", s.num_steps_off),
            ("nb:engine_steps", "Engine steps that ran a plan", steps.steps),
            ("nb:engine_step_seconds", "Wall seconds in those steps", steps.seconds),
            ("nb:engine_graph_seconds", "Of which in the runtime's graph calls", steps.graph_seconds),
            ("nb:engine_grammar_masks", "Logits rows masked by a grammar", steps.grammar_masks),
            ("nb:engine_grammar_seconds", "Host seconds making those masks", steps.grammar_seconds),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """Everything ``/metrics`` exposes; the engine thread records, any thread may scrape."""

    def __init__(
        self,
        model_name: str,
        bucket_stats: Callable[[], Mapping[str, BucketStats]],
        prefix_cache: Callable[[], tuple[int, int]] = lambda: (0, 0),
        spec_stats: Callable[[], SpecDecodeStats] = SpecDecodeStats,
        step_stats: Callable[[], StepStats] = StepStats,
        preemptions: Callable[[], int] = lambda: 0,
    ) -> None:
        """``prefix_cache`` reads the pool's (queries, hits) counters, ``spec_stats`` the engine's
        speculative decoding counters, ``step_stats`` its steps and their seconds, ``preemptions``
        its KV cache manager's count of them."""
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the engine's decode or prefill")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for blocks or a prefill slot")
        # Set with the two above after each step, as vLLM publishes it with its step's stats: read
        # live, mid-step, it would count the blocks of requests the step is about to release.
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage: 1 is every block held")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS)
        # vLLM's intervals of a finished request, on its bins: queued (arrival to first scheduled),
        # prefill (to first token), decode (first to last token), inference (first scheduled to
        # last token; preempted spells inside count). Their ``_sum`` over a run divided by its
        # length is the mean number of requests held (Little's law), whenever a gauge is set.
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Seconds queued before first scheduled", E2E_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Seconds from first scheduled to first token", E2E_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "Seconds from first to last token",
                                     E2E_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Seconds from first scheduled to last token", E2E_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self._success = Counter(
            "vllm:request_success", "Finished requests by finish reason", [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.registry.register(BucketCollector(model_name, bucket_stats))
        counters = EngineCounterCollector(model_name, prefix_cache, spec_stats, step_stats, preemptions)
        self.registry.register(counters)

    def intervals(
        self, arrival: float, scheduled: float | None, first: float | None, last: float | None
    ) -> None:
        """Observe a finished request's intervals, as vLLM does, where it was scheduled and produced
        a token (a request aborted before either has none)."""
        if scheduled is None or first is None or last is None:
            return
        self.queue_time.observe(scheduled - arrival)
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(last - first)
        self.inference_time.observe(last - scheduled)

    def finished(self, reason: str | None) -> None:
        self._success.labels(self.model_name, reason or "unknown").inc()

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)

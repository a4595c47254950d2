"""Engine metrics: one set of numbers, read as a dict (`LLM.stats()`) or scraped by Prometheus.

Each engine owns its own `CollectorRegistry`, so several engines in one process (tests, notebooks)
never collide; the server exposes the registry of the engine it serves.
"""

from __future__ import annotations

import bisect
import collections
import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets in seconds: fine enough for an accelerator's steps, long enough for a queued
# request on a CPU (TTFTs of minutes happen there under load).
_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
    163.84,
    327.68,
    655.36,
    float("inf"),
)


PHASES = ("prefill", "decode")


class LatencyHistogram:
    """A histogram kept in Python (for `stats()` and percentiles) and mirrored to Prometheus.

    Counts and sums cover every observation; the percentiles cover the most recent `window` of them,
    so a long-running server's p50/p99 keep describing its present, not its first minutes.
    """

    def __init__(self, prom, *, window: int = 100_000):
        self._prom = prom  # a prometheus Histogram (or one label's child)
        self.counts = [0] * len(_BUCKETS)
        self.count = 0
        self.sum = 0.0
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self._prom.observe(seconds)
        self.counts[bisect.bisect_left(_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds
        self._recent.append(seconds)

    def percentiles(self, *qs: float) -> list[float | None]:
        ordered = sorted(self._recent)  # a copy: stats() may run on another thread than observe()
        if not ordered:
            return [None] * len(qs)
        n = len(ordered)  # nearest rank: the smallest value with at least q% of them at or below it
        return [ordered[min(n - 1, max(0, math.ceil(q / 100 * n) - 1))] for q in qs]

    def as_dict(self) -> dict:
        p50, p99 = self.percentiles(50, 99)
        return {
            "count": self.count,
            "sum": self.sum,
            "buckets": {str(b): c for b, c in zip(_BUCKETS, self.counts)},
            "p50": p50,
            "p99": p99,
        }


class EngineMetrics:
    def __init__(self, *, kv_pages_total: int, kv_cache_bytes: int, kv_window_pages_total: int | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        # "capacity", not "total": Prometheus keeps the _total suffix for counters (rate() over it is wrong).
        Gauge("jaxinfer_kv_pages_capacity", "KV-cache pages that can be allocated", registry=r).set(kv_pages_total)
        Gauge("jaxinfer_kv_cache_bytes", "Device memory held by the KV cache", registry=r).set(kv_cache_bytes)
        self.kv_pages_free = Gauge(
            "jaxinfer_kv_pages_free", "KV pages free or held only by the prefix cache", registry=r
        )
        self.kv_pages_used = Gauge("jaxinfer_kv_pages_used", "KV pages held by sequences", registry=r)
        self.kv_window_pages_free = self.kv_window_pages_used = None
        if kv_window_pages_total is not None:  # a hybrid model's sliding-window layers' own pools
            Gauge(
                "jaxinfer_kv_window_pages_capacity",
                "Pages of the sliding-window layers' pools (hybrid models) that can be allocated",
                registry=r,
            ).set(kv_window_pages_total)
            self.kv_window_pages_free = Gauge(
                "jaxinfer_kv_window_pages_free", "Window-pool pages free or held only by the prefix cache", registry=r
            )
            self.kv_window_pages_used = Gauge(
                "jaxinfer_kv_window_pages_used", "Window-pool pages held by sequences", registry=r
            )
        self.running = Gauge("jaxinfer_running_sequences", "Sequences being computed", registry=r)
        self.waiting = Gauge("jaxinfer_waiting_sequences", "Sequences queued", registry=r)
        self.preemptions = Counter("jaxinfer_preemptions", "Sequences preempted for lack of KV pages", registry=r)
        self.prefix_hits = Counter(
            "jaxinfer_prefix_cache_hit_tokens",
            "Tokens whose K/V came from the prefix cache instead of being computed (shared prompt prefixes, "
            "and a preempted sequence's own pages when it resumes)",
            registry=r,
        )
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "Prompt tokens received", registry=r)
        self.generated_tokens = Counter("jaxinfer_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "jaxinfer_finished_sequences", "Sequences ended, by finish reason", ["reason"], registry=r
        )
        self.compiles = Gauge("jaxinfer_xla_compilations", "XLA compilations in this process", registry=r)
        self.ttft = LatencyHistogram(
            Histogram(
                "jaxinfer_time_to_first_token_seconds",
                "Arrival to a request's first token (of any of its n samples)",
                buckets=_BUCKETS,
                registry=r,
            )
        )
        self.itl = LatencyHistogram(
            Histogram(
                "jaxinfer_inter_token_latency_seconds", "Time between a sample's tokens", buckets=_BUCKETS, registry=r
            )
        )
        self.e2e = LatencyHistogram(
            Histogram(
                "jaxinfer_request_latency_seconds",
                "Arrival to a request's end (its last sample finished or aborted)",
                buckets=_BUCKETS,
                registry=r,
            )
        )
        # Where time to first token goes: waiting for a slot (queue), then computing the prompt.
        self.queue_time = LatencyHistogram(
            Histogram(
                "jaxinfer_request_queue_time_seconds",
                "Arrival to first scheduled (waiting for pages or a running slot)",
                buckets=_BUCKETS,
                registry=r,
            )
        )
        self.prefill_time = LatencyHistogram(
            Histogram(
                "jaxinfer_request_prefill_time_seconds",
                "First scheduled to first token (the prompt's chunks, interleaved with other work)",
                buckets=_BUCKETS,
                registry=r,
            )
        )
        # The two workloads, per jitted call: prompt chunks (compute-bound) and decode (memory-bound).
        step = Histogram(
            "jaxinfer_step_seconds",
            "Wall time of one jitted call, until its tokens are on the host, by phase",
            ["phase"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.step_time = {phase: LatencyHistogram(step.labels(phase)) for phase in PHASES}
        tokens = Counter(
            "jaxinfer_step_tokens", "Tokens computed (prompt tokens, decode rows), by phase", ["phase"], registry=r
        )
        self.step_tokens = {phase: tokens.labels(phase) for phase in PHASES}
        # The two labelled counters' values for stats() (prometheus_client has no public getter).
        self.finished_counts = {"stop": 0, "length": 0, "abort": 0}
        for reason in self.finished_counts:  # every series exported from the start, at 0
            self.finished.labels(reason)
        self.step_token_counts = dict.fromkeys(PHASES, 0)
        self._preemptions_seen = 0
        self._hits_seen = 0

    def count_finished(self, reason: str) -> None:
        self.finished.labels(reason).inc()
        self.finished_counts[reason] += 1

    def count_step_tokens(self, phase: str, n: int) -> None:
        self.step_tokens[phase].inc(n)
        self.step_token_counts[phase] += n

    def sync_counters(self, *, preemptions: int, prefix_hits: int) -> None:
        """Brings the Prometheus counters up to the scheduler's running totals."""
        if preemptions > self._preemptions_seen:
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        if prefix_hits > self._hits_seen:
            self.prefix_hits.inc(prefix_hits - self._hits_seen)
            self._hits_seen = prefix_hits

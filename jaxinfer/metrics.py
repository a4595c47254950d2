"""Engine metrics: one set of numbers, read as a dict (`LLM.stats()`) or scraped by Prometheus.

Each engine owns its own `CollectorRegistry`, so several engines in one process (tests, notebooks)
never collide; the server exposes the registry of the engine it serves.
"""

from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets in seconds: fine enough for a CPU and for an accelerator.
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
    float("inf"),
)


class LatencyHistogram:
    """A histogram kept in Python (for `stats()` and percentiles) and mirrored to Prometheus."""

    def __init__(self, prom: Histogram):
        self._prom = prom
        self.counts = [0] * len(_BUCKETS)
        self.count = 0
        self.sum = 0.0
        self._samples: list[float] = []  # kept sorted, bounded, for percentiles

    def observe(self, seconds: float) -> None:
        self._prom.observe(seconds)
        self.counts[bisect.bisect_left(_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds
        if len(self._samples) < 100_000:
            bisect.insort(self._samples, seconds)

    def percentile(self, q: float) -> float | None:
        if not self._samples:
            return None
        return self._samples[min(len(self._samples) - 1, int(q / 100 * len(self._samples)))]

    def as_dict(self) -> dict:
        return {
            "count": self.count,
            "sum": self.sum,
            "buckets": {str(b): c for b, c in zip(_BUCKETS, self.counts)},
            "p50": self.percentile(50),
            "p99": self.percentile(99),
        }


class EngineMetrics:
    def __init__(self, *, kv_pages_total: int, kv_cache_bytes: int):
        self.registry = CollectorRegistry()
        r = self.registry
        self.kv_pages_total = kv_pages_total
        self.kv_cache_bytes = kv_cache_bytes
        Gauge("jaxinfer_kv_pages_total", "KV-cache pages that can be allocated", registry=r).set(kv_pages_total)
        Gauge("jaxinfer_kv_cache_bytes", "Device memory held by the KV cache", registry=r).set(kv_cache_bytes)
        self.kv_pages_free = Gauge(
            "jaxinfer_kv_pages_free", "KV pages free or held only by the prefix cache", registry=r
        )
        self.kv_pages_used = Gauge("jaxinfer_kv_pages_used", "KV pages held by sequences", registry=r)
        self.running = Gauge("jaxinfer_running_sequences", "Sequences being computed", registry=r)
        self.waiting = Gauge("jaxinfer_waiting_sequences", "Sequences queued", registry=r)
        self.preemptions = Counter("jaxinfer_preemptions", "Sequences preempted for lack of KV pages", registry=r)
        self.prefix_hits = Counter(
            "jaxinfer_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "Prompt tokens received", registry=r)
        self.generated_tokens = Counter("jaxinfer_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "jaxinfer_finished_sequences", "Sequences ended, by finish reason", ["reason"], registry=r
        )
        self.compiles = Gauge("jaxinfer_xla_compilations", "XLA compilations in this process", registry=r)
        self.ttft = LatencyHistogram(
            Histogram("jaxinfer_time_to_first_token_seconds", "Time to first token", buckets=_BUCKETS, registry=r)
        )
        self.itl = LatencyHistogram(
            Histogram("jaxinfer_inter_token_latency_seconds", "Time between tokens", buckets=_BUCKETS, registry=r)
        )
        self.e2e = LatencyHistogram(
            Histogram("jaxinfer_request_latency_seconds", "Arrival to last token", buckets=_BUCKETS, registry=r)
        )
        self._preemptions_seen = 0
        self._hits_seen = 0

    def sync_counters(self, *, preemptions: int, prefix_hits: int) -> None:
        """Brings the Prometheus counters up to the scheduler's running totals."""
        if preemptions > self._preemptions_seen:
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        if prefix_hits > self._hits_seen:
            self.prefix_hits.inc(prefix_hits - self._hits_seen)
            self._hits_seen = prefix_hits

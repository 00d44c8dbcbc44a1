"""Prometheus metrics of the router, all named `pdserve:*`, in a registry owned by the app.

Per request (histograms, seconds): time to first token, time per output token (after the
first), inter-token latency (between token chunks), end-to-end latency, queue time (arrival to
the Generate call being opened), KV transfer time. Counters: requests by finish reason, HTTP
responses by endpoint and status code, prompt / generation / cached tokens, KV bytes moved,
routing decisions by role and reason, requests / prompt tokens / KV bytes by how the prompt was
filled (`pdserve:prompt_fill_*{path}`) and the P/D engagement alarm
(`pdserve:disaggregation_degraded`, router/engagement.py). Per-worker gauges, each worker's failed KV transfers by
reason (`pdserve:kv_transfer_failures_total{worker,role,reason}`, engine/kv_connector.py) and
its model step times by kind (`pdserve:worker_step_seconds{worker,role,kind}`,
engine/step_times.py) are read from the pool at scrape time. Under `pdserve serve`, the goodput
planner's metrics (`pdserve:planner_*`) join them through `create_app(collectors=...)`: the
router processes read them from the controller (deploy/router_process.py, `PlannerMetrics`).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.kv_events import TIERS
from engine.kv_hooks import FAILURE_REASONS
from engine.step_times import STEP_TIME_BUCKETS
from router.engagement import EngagementMonitor, PromptFill
from router.pool import WorkerPool

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0, 10.0, 20.0)


class RouterMetrics:
    """The router's Prometheus metrics. `engagement`: the P/D engagement alarm the requests'
    prompt fills feed, exported as pdserve:disaggregation_degraded."""

    def __init__(self, pool: WorkerPool, engagement: EngagementMonitor,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.engagement = engagement
        r = self.registry
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Arrival to the first output token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Time between consecutive token chunks.",
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Arrival to the last output token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("pdserve:request_queue_time_seconds",
                                    "Arrival to the Generate call being opened on a decode worker.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.kv_transfer_time = Histogram("pdserve:kv_transfer_seconds",
                                          "KV transfer time per remotely prefilled request.",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.finished = Counter("pdserve:request_finished", "Requests finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.responses = Counter("pdserve:http_responses", "HTTP responses, by endpoint and status code.",
                                 ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Output tokens streamed.", registry=r)
        self.cached_tokens = Counter("pdserve:cached_prompt_tokens",
                                     "Prompt tokens served from a prefix cache.", registry=r)
        self.kv_bytes = Counter("pdserve:kv_transfer_bytes", "KV bytes moved into decode workers.", registry=r)
        self.routing = Counter("pdserve:routing_decisions", "Worker choices, by role and reason.",
                               ["role", "reason"], registry=r)
        self.routing_hits = Counter("pdserve:routing_cache_hits", "Routed requests by role and the deepest tier "
                                    "of their cached prefix on the chosen worker (none, device, host).",
                                    ["role", "tier"], registry=r)
        self.shed = Counter("pdserve:requests_shed", "Requests refused with 429 because the router was full, "
                            "by priority class (interactive: priority <= 0; batch: > 0).", ["priority_class"],
                            registry=r)
        self.migrations = Counter("pdserve:request_migrations",
                                  "Generations resumed on another decode worker after theirs failed mid-stream.",
                                  registry=r)
        self.prompt_fills = Counter("pdserve:prompt_fill_requests",
                                    "Requests by how their prompt got its KV: remote (a prefill worker), local "
                                    "(the decode worker), cached (the decode worker's prefix cache), fallback "
                                    "(a failed transfer, then local; reason: why it failed).",
                                    ["path", "reason"], registry=r)
        self.prompt_fill_tokens = Counter("pdserve:prompt_fill_tokens", "Prompt tokens by how they were filled.",
                                          ["path"], registry=r)
        self.prompt_fill_kv_bytes = Counter("pdserve:prompt_fill_kv_bytes",
                                            "KV bytes received by decode workers, by how the prompt was filled "
                                            "(a fallback's are the part that arrived before the failure).",
                                            ["path"], registry=r)
        degraded = Gauge("pdserve:disaggregation_degraded",
                         "1 while P/D is not engaged: prefill workers in the pool, none used by the window's "
                         "qualifying requests (router/engagement.py; /health says why).", registry=r)
        degraded.set_function(lambda: float(engagement.degraded() is not None))
        self.registry.register(_PoolCollector(pool))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def start_request(self) -> "RequestTimer":
        return RequestTimer(self)


@dataclass
class RequestTimer:
    """One request's clock: arrival, dispatch, token chunks, finish (observed once)."""
    metrics: RouterMetrics
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    finished: bool = False

    def dispatched(self) -> None:
        self.metrics.queue_time.observe(time.monotonic() - self.arrival)

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
        elif self.last_token is not None:
            self.metrics.itl.observe(now - self.last_token)
        self.last_token = now
        self.num_tokens += count
        self.metrics.generation_tokens.inc(count)

    def kv_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes:
            self.metrics.kv_bytes.inc(num_bytes)
        if seconds > 0:
            self.metrics.kv_transfer_time.observe(seconds)

    def prompt_filled(self, fill: PromptFill, prompt_tokens: int, kv_bytes: int) -> None:
        metrics = self.metrics
        metrics.prompt_fills.labels(fill.path, fill.reason).inc()
        metrics.prompt_fill_tokens.labels(fill.path).inc(prompt_tokens)
        if kv_bytes:
            metrics.prompt_fill_kv_bytes.labels(fill.path).inc(kv_bytes)
        metrics.engagement.record(fill)

    def finish(self, finish_reason: str, prompt_tokens: int, cached_tokens: int) -> None:
        if self.finished:
            return
        self.finished = True
        now = time.monotonic()
        self.metrics.finished.labels(finish_reason).inc()
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_tokens.inc(cached_tokens)
        if self.first_token is not None:
            self.metrics.e2e.observe(now - self.arrival)
            if self.num_tokens > 1 and self.last_token is not None:
                self.metrics.tpot.observe((self.last_token - self.first_token) / (self.num_tokens - 1))


_WORKER_GAUGES = (
    ("healthy", "1 when the worker answers its health checks.", lambda w: float(w.healthy)),
    ("running_requests", "Requests running on the worker.", lambda w: w.stats.running),
    ("waiting_requests", "Requests waiting on the worker.", lambda w: w.stats.waiting),
    ("kv_blocks_total", "KV cache blocks of the worker.", lambda w: w.stats.kv_blocks_total),
    ("kv_blocks_free", "Free KV cache blocks of the worker.", lambda w: w.stats.kv_blocks_free),
    ("kv_blocks_cached", "KV blocks holding reusable prefixes.", lambda w: w.stats.kv_blocks_cached),
    ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.",
     lambda w: w.stats.prefix_cache_hit_rate or 0.0),
    ("prefill_tokens_queued",
     "Tokens the worker must compute before its requests decode (prompts, and outputs a preempted request recomputes).",
     lambda w: w.stats.prefill_tokens_queued),
    ("host_cache_blocks_used", "KV blocks kept in the worker's host-memory prefix cache tier.",
     lambda w: w.stats.host_cache_blocks_used),
    ("host_cache_hit_tokens", "Prompt tokens copied back from the host tier instead of recomputed (cumulative).",
     lambda w: w.stats.host_cache_hits),
    ("router_inflight_requests", "This router's requests on the worker.", lambda w: w.inflight_requests),
    ("resident_bytes", "The worker process's resident memory.", lambda w: w.stats.rss_bytes),
    ("weight_bytes", "Of it, the model's weights (pre-blocked copies included).", lambda w: w.stats.weight_bytes),
    ("spec_decode_acceptance_rate", "Speculative decoding: draft tokens accepted / verified (cumulative; 0 before "
     "any draft).", lambda w: w.stats.spec_acceptance_rate or 0.0),
)

# Speculative decoding counters per worker (vLLM's names, pdserve's prefix): tokens per step of a
# request with a draft = 1 + accepted / drafts.
_SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Drafts verified (one per decode step of a request that had one).",
     lambda w: w.stats.spec_drafts),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", lambda w: w.stats.spec_draft_tokens),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", lambda w: w.stats.spec_accepted_tokens),
)


class _PoolCollector:
    """Per-worker gauges, read from the pool when Prometheus scrapes (removed workers vanish)."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    def collect(self):
        workers = self._pool.workers()
        for name, help_text, read in _WORKER_GAUGES:
            family = GaugeMetricFamily(f"pdserve:worker_{name}", help_text, labels=["worker", "role"])
            for worker in workers:
                family.add_metric([worker.address, worker.role], float(read(worker)))
            yield family
        failures = CounterMetricFamily("pdserve:kv_transfer_failures",
                                       "KV transfers that failed on the worker, by reason (then recomputed or "
                                       "failed per --on-transfer-failure).", labels=["worker", "role", "reason"])
        for worker in workers:
            counts = worker.stats.kv_transfer_failures
            for reason in FAILURE_REASONS:
                failures.add_metric([worker.address, worker.role, reason], float(counts.get(reason, 0)))
        yield failures
        index = GaugeMetricFamily("pdserve:kv_index_blocks", "Blocks in this router's KV index, by tier "
                                  "(reported device / host, routed and not yet reported: pending).", labels=["tier"])
        for tier in (*TIERS, "pending"):
            index.add_metric([tier], float(self._pool.kv_index.size(tier)))
        yield index
        for name, help_text, read in _SPEC_COUNTERS:
            family = CounterMetricFamily(f"pdserve:{name}", help_text, labels=["worker", "role"])
            for worker in workers:
                family.add_metric([worker.address, worker.role], float(read(worker)))
            yield family
        yield _step_times(workers)

    def describe(self):
        return []


def _step_times(workers) -> HistogramMetricFamily:
    """Each worker's model step times by kind (engine/step_times.py), as its Stats report them."""
    family = HistogramMetricFamily("pdserve:worker_step_seconds", "The worker's model steps (forward and sampling) "
                                   "by kind: decode (plain decodes only) or prefill (with prompt tokens).",
                                   labels=["worker", "role", "kind"])
    bounds = [*(f"{b:g}" for b in STEP_TIME_BUCKETS), "+Inf"]
    for worker in workers:
        for kind, (counts, total) in worker.stats.step_times.items():
            if len(counts) != len(bounds):  # a worker of another version: other buckets
                continue
            cumulative = itertools.accumulate(counts)
            family.add_metric([worker.address, worker.role, kind], list(zip(bounds, map(float, cumulative))), total)
    return family

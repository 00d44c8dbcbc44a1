"""Router configuration: one dataclass, validated at construction (no module globals)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from engine.config import CacheConfig, Role
from engine.model.default_model import DEFAULT_MODEL_NAME
from engine.model.packaged_models import PACKAGED_MODELS
# (LOOPBACK_HOST(S) are wire's, the servers' shared layer: re-exported for the router and deploy)
from wire.cluster_auth import LOOPBACK_HOST, LOOPBACK_HOSTS, ClusterAuth  # noqa: F401
from wire.tracing import check_endpoint

PREFILL_POLICIES = ("prefix_affinity", "round_robin")
DECODE_POLICIES = ("power_of_two", "round_robin")
# What users call each role's pool (RouterConfig's worker lists, `pdserve serve`'s flags and pool
# sizes; `Role.pool`): the workers of role "both" make up the colocated pool.
POOL_NAMES: dict[str, str] = {role.value: role.pool for role in Role}


def check_grpc_address(address: str, what: str) -> str:
    """`host:port` with a port in 1..65535 ([v6]:port allowed); ValueError naming `what` otherwise."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"{what} address {address!r} must look like host:port, e.g. 127.0.0.1:50051")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} address {address!r} must look like host:port with a port in 1..65535")
    return address


# `--local-prefill-weight`'s help, for `python -m router` and `pdserve serve`.
LOCAL_PREFILL_WEIGHT_HELP = (
    "conditional disaggregation: how many tokens of time to first token one running stream's stalled token "
    "costs (a decode worker's --max-step-ratio already bounds any one inter-token interval); a decode worker "
    "prefills a prompt itself when its wait there plus that stall is below the prefill worker's wait; "
    "0: stalls are free, inf: never while it streams (default: %(default)s)")


# Router settings `python -m router` and `pdserve serve` both take: RouterConfig field -> (flag, help).
SHARED_ROUTER_FLAGS: dict[str, tuple[str, str]] = {
    "max_stored_responses": ("--max-stored-responses",
                             "/v1/responses kept for previous_response_id and GET, in each router process's memory; "
                             "the least recently used are forgotten first (default: %(default)s)"),
    "engagement_window_s": ("--engagement-window-s",
                            "seconds of the P/D engagement alarm's window (/health's `degraded`, "
                            "pdserve:disaggregation_degraded: prefill workers in the pool and none of the window's "
                            "qualifying requests prefilled on one; default: %(default)s)"),
    "engagement_min_requests": ("--engagement-min-requests",
                                "qualifying requests the window needs before the alarm can fire (default: "
                                "%(default)s)"),
    "engagement_min_prompt_tokens": ("--engagement-min-prompt-tokens",
                                     "computed prompt tokens a request needs to qualify (default: %(default)s)"),
}


def add_shared_router_arguments(parser: argparse.ArgumentParser) -> None:
    """SHARED_ROUTER_FLAGS on `parser`, typed and defaulted as RouterConfig's fields."""
    for name, (flag, help_text) in SHARED_ROUTER_FLAGS.items():
        default = getattr(RouterConfig, name)
        parser.add_argument(flag, dest=name, type=type(default), default=default, help=help_text)


def shared_router_options(args: argparse.Namespace) -> dict[str, Any]:
    """The RouterConfig fields of SHARED_ROUTER_FLAGS, from parsed arguments."""
    return {name: getattr(args, name) for name in SHARED_ROUTER_FLAGS}


@dataclass
class RouterConfig:
    """Everything `create_app` needs.

    `model` is the tokenizer source (a Hugging Face folder, a .gguf file or a packaged model's name:
    `PACKAGED_MODELS`, `DEFAULT_MODEL_NAME` among them);
    `served_model_name` is the name clients send in `model` (defaults to `model`).
    Worker lists are the static pool, one per role, each named by its pool (`POOL_NAMES`); the Ray
    controller may add and remove workers later.
    """
    model: str = DEFAULT_MODEL_NAME
    served_model_name: str | None = None
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    colocated: list[str] = field(default_factory=list)
    host: str = LOOPBACK_HOST
    port: int = 8000
    api_key: str | None = None
    # The cluster secret's file (wire/cluster_auth.py): the workers' gRPC is mutual TLS under it;
    # None: plaintext gRPC (workers started without one).
    cluster_secret_file: str | None = None
    max_model_len: int | None = None  # None: the tokenizer's (the model's) context length
    max_request_body_bytes: int = 8 * 2**20
    max_inflight_requests: int = 1024  # beyond it: 429 with Retry-After
    # Requests of priority > 0 (the "batch" class; lower is more important, as in vLLM) may hold
    # at most this share of max_inflight_requests, so a flood of them leaves room for the rest.
    batch_share: float = 0.75
    retry_after_s: int = 1
    prefill_policy: str = "prefix_affinity"
    decode_policy: str = "power_of_two"
    # KV block size used for prefix-affinity hashes until a worker reports its own.
    block_size: int = CacheConfig.block_size
    # Per worker, how many routed block hashes not yet reported by its KV events the index keeps.
    affinity_capacity_blocks: int = 65536
    # Follow every worker's KV-cache events (KVEvents stream) into the routing index; off: route on
    # what this router sent where (an estimate that cannot see evictions or other routers).
    kv_events: bool = True
    # While a worker's events flow, a block routed there counts as cached for this long before
    # its report arrives (a burst sharing a prefix lands together).
    kv_pending_ttl_s: float = 10.0
    # What a host-tier hit costs next to recomputing the block (it is copied back to the device).
    host_hit_cost: float = 0.25
    # Prefix affinity yields to load when the preferred worker has this many more queued
    # prefill tokens than the least loaded one.
    affinity_max_imbalance_tokens: int = 16384
    # A cached prefix attracts a request only when it covers at least this share of the prompt's
    # full blocks (so a shared system prompt alone does not pile every request onto one worker).
    affinity_min_match_ratio: float = 0.5
    # Conversation affinity on decode yields when the preferred worker has this many more
    # requests in flight than the least loaded one.
    affinity_max_imbalance_requests: int = 8
    # A decode worker with less than this share of free KV blocks is avoided when others have room.
    kv_free_low_watermark: float = 0.05
    # Conditional disaggregation (router/policies.py `prefill_locally`): a prompt is prefilled on its
    # decode worker when its time to first token there, plus the stall it puts on the streams
    # running there (each stalled token counted this many times), is below its time to first token
    # on the prefill worker. 1: a token of a running stream's time is worth one of the newcomer's;
    # a decode worker's --max-step-ratio (2) already keeps a local prefill from stretching any one
    # inter-token interval past twice a decode step. 0: stalls are free; inf: a decode worker with
    # running streams never prefills for the router. Measured (benchmarks/HISTORY.md, 2026-12-04):
    # 1 against 8 gave short-request TTFT p99 505-521 vs 647-653 ms on the interference workload
    # at the same ITL, and 1.08x the throughput at 64 in flight.
    local_prefill_weight: float = 1.0
    stats_interval_s: float = 1.0
    rpc_timeout_s: float = 2.0
    # Consecutive failed polls before a worker is taken out of routing. Stats are answered between
    # engine steps, so a long prefill on a loaded CPU can miss a poll or two without the worker being
    # ill; a refused connection still takes it out at once.
    unhealthy_after_failures: int = 4
    # When a decode worker does not answer a Generate call, retry on another one this many times.
    max_dispatch_retries: int = 1
    # When a decode worker fails mid-stream (dies, or its stream breaks off), resume the generation
    # on another worker from the tokens already delivered, at most this many times (0: never).
    max_migrations: int = 2
    # Responses kept for /v1/responses' previous_response_id and GET (router/responses.py): in this
    # process's memory, the least recently used forgotten first.
    max_stored_responses: int = 1000
    # The "is P/D engaged?" alarm (router/engagement.py): degraded when prefill workers are in the
    # pool and, of the last `engagement_window_s` seconds' requests that qualified for remote
    # prefill (at least `engagement_min_prompt_tokens` computed prompt tokens, and no reason of
    # their own to stay local), at least `engagement_min_requests` finished and none was
    # prefilled remotely.
    engagement_window_s: float = 300.0
    engagement_min_requests: int = 10
    engagement_min_prompt_tokens: int = 256
    seed: int = 0  # for the power-of-two sampler, so routing is reproducible in tests
    # OpenTelemetry traces (OTLP/gRPC, wire/tracing.py) go to this collector URL; None: no tracing.
    # The process that serves the app sets it up (`python -m router`, deploy/router_process.py).
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string (a model folder, a .gguf file or a packaged "
                             f"model: {', '.join(PACKAGED_MODELS)})")
        if self.served_model_name is None:
            self.served_model_name = self.model
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        for role, addresses in self.workers_by_role().items():
            for address in addresses:
                check_grpc_address(address, f"{POOL_NAMES[role]} worker")
        all_addresses = [*self.prefill, *self.decode, *self.colocated]
        duplicates = sorted({a for a in all_addresses if all_addresses.count(a) > 1})
        if duplicates:
            raise ValueError(f"worker address(es) listed more than once: {', '.join(duplicates)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when set (omit it to disable authentication)")
        self.cluster_auth()  # a bad secret file fails here, naming the problem
        check_endpoint(self.otlp_traces_endpoint)
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"unknown prefill policy {self.prefill_policy!r}; choose one of {', '.join(PREFILL_POLICIES)}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"unknown decode policy {self.decode_policy!r}; choose one of {', '.join(DECODE_POLICIES)}")
        positive = {"max_request_body_bytes": self.max_request_body_bytes,
                    "max_inflight_requests": self.max_inflight_requests, "block_size": self.block_size,
                    "affinity_capacity_blocks": self.affinity_capacity_blocks,
                    "unhealthy_after_failures": self.unhealthy_after_failures,
                    "stats_interval_s": self.stats_interval_s, "rpc_timeout_s": self.rpc_timeout_s,
                    "kv_pending_ttl_s": self.kv_pending_ttl_s,
                    "engagement_window_s": self.engagement_window_s,
                    "engagement_min_requests": self.engagement_min_requests,
                    "engagement_min_prompt_tokens": self.engagement_min_prompt_tokens,
                    "max_stored_responses": self.max_stored_responses,
                    "retry_after_s": self.retry_after_s}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 0.0 < self.batch_share <= 1.0:
            raise ValueError(f"batch_share must be in (0, 1], got {self.batch_share}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        for name in ("affinity_max_imbalance_tokens", "affinity_max_imbalance_requests", "max_dispatch_retries",
                     "max_migrations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.local_prefill_weight >= 0.0:
            raise ValueError(f"local_prefill_weight must be >= 0 (inf allowed), got {self.local_prefill_weight}")
        for name in ("affinity_min_match_ratio", "kv_free_low_watermark", "host_hit_cost"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def cluster_auth(self) -> ClusterAuth:
        """How the router reaches the workers: mutual TLS under `cluster_secret_file`, or insecure."""
        try:
            return ClusterAuth.from_file(self.cluster_secret_file)
        except ValueError as exc:
            raise ValueError(f"cluster_secret_file: {exc}") from None

    def workers_by_role(self) -> dict[str, list[str]]:
        """The static worker lists by role ("both": the `colocated` list)."""
        return {role: getattr(self, pool) for role, pool in POOL_NAMES.items()}

"""Routing policies: which prefill worker and which decode worker serve a request.

Both kinds take the routable candidates and the prompt's chained block hashes (the same ones
the engine computes, `engine.block_hash`) and return a `Choice` (the worker, why, and what of
the prompt is cached there). What is cached where comes from the `KVIndex` (router/kv_index.py):
the workers' KV events, exact and per tier, plus what was routed and not yet reported. After
the request is sent, `record` tells the index where those blocks will live.

- `PrefixAffinityPrefill`: the worker with the longest cached run of the prompt's blocks wins
  (a host-tier block counts `1 - host_hit_cost` of a device one: it is copied back, not
  recomputed), when that run covers at least `affinity_min_match_ratio` of them and the worker
  is not more than `affinity_max_imbalance_tokens` queued prefill tokens behind the least
  loaded one; otherwise the least loaded (queued prefill tokens, then requests sent).
- `PowerOfTwoDecode`: conversation affinity first (the worker that holds most of this prompt's
  blocks from an earlier turn, unless it is short of KV blocks or far busier than the
  least loaded); otherwise sample two workers and take the less loaded (KV pressure, then
  requests in flight).
- `RoundRobin`: the baseline, for either role.

`prefill_locally` then decides where the chosen pair runs the prompt (conditional disaggregation).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from engine.block_hash import BlockHash
from router.config import RouterConfig
from router.kv_index import KVIndex, Match
from router.pool import WorkerInfo


@dataclass(frozen=True)
class Choice:
    worker: WorkerInfo
    reason: str  # "prefix_affinity", "conversation_affinity", "load", "power_of_two", "round_robin", "sibling"
    match: Match = field(default_factory=Match)  # the prompt's blocks cached there, by tier

    @property
    def matched_blocks(self) -> int:
        return self.match.blocks


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[WorkerInfo], hashes: Sequence[BlockHash]) -> Choice:
        """Pick one of `candidates` (non-empty)."""

    def record(self, worker: WorkerInfo, hashes: Sequence[BlockHash]) -> None:
        """`hashes` (a prompt's, or a finished sequence's) are now cached on `worker`."""

    def forget(self, address: str) -> None:
        """The worker left the pool."""


def _best_match(index: KVIndex, candidates: Sequence[WorkerInfo], hashes: Sequence[BlockHash],
                min_ratio: float, host_weight: float) -> tuple[list[WorkerInfo], dict[str, Match]]:
    """The candidates with the most valuable cached run of `hashes` (a host-tier block is worth
    `host_weight` of a device one: it is copied back, not recomputed), if it is long enough to
    count; and every candidate's match."""
    if not hashes:
        return [], {}
    matches = {w.address: index.match(w.address, hashes) for w in candidates}
    value = {address: m.device + host_weight * m.host for address, m in matches.items()}
    best = max(value.values())
    if best == 0 or best / len(hashes) < min_ratio:
        return [], matches
    return [w for w in candidates if value[w.address] == best], matches


class PrefixAffinityPrefill:
    name = "prefix_affinity"

    def __init__(self, config: RouterConfig, index: KVIndex | None = None) -> None:
        """`index`: the pool's (the workers' KV events); a private one holds only what this
        policy routed (the estimate)."""
        self.index = index if index is not None else KVIndex.for_router(config)
        self.min_match_ratio = config.affinity_min_match_ratio
        self.max_imbalance_tokens = config.affinity_max_imbalance_tokens
        self.host_weight = 1.0 - config.host_hit_cost

    @staticmethod
    def _load(worker: WorkerInfo) -> tuple[int, int, int]:
        return worker.prefill_load_tokens, worker.inflight_requests, worker.num_routed

    def choose(self, candidates: Sequence[WorkerInfo], hashes: Sequence[BlockHash]) -> Choice:
        least_loaded = min(candidates, key=self._load)
        preferred, matches = _best_match(self.index, candidates, hashes, self.min_match_ratio, self.host_weight)
        if preferred:
            worker = min(preferred, key=self._load)
            if worker.prefill_load_tokens - least_loaded.prefill_load_tokens <= self.max_imbalance_tokens:
                return Choice(worker, "prefix_affinity", matches[worker.address])
        return Choice(least_loaded, "load", matches.get(least_loaded.address, Match()))

    def record(self, worker: WorkerInfo, hashes: Sequence[BlockHash]) -> None:
        self.index.note_routed(worker.address, hashes)

    def forget(self, address: str) -> None:
        self.index.forget(address)


class PowerOfTwoDecode:
    name = "power_of_two"

    def __init__(self, config: RouterConfig, index: KVIndex | None = None) -> None:
        """`index`: as for PrefixAffinityPrefill."""
        self.index = index if index is not None else KVIndex.for_router(config)
        self.min_match_ratio = config.affinity_min_match_ratio
        self.max_imbalance_requests = config.affinity_max_imbalance_requests
        self.host_weight = 1.0 - config.host_hit_cost
        self.low_watermark = config.kv_free_low_watermark
        self._rng = random.Random(config.seed)

    def _short_of_kv(self, worker: WorkerInfo) -> bool:
        total = worker.stats.kv_blocks_total
        return bool(total) and worker.stats.kv_blocks_free / total < self.low_watermark

    @staticmethod
    def _requests(worker: WorkerInfo) -> int:
        return max(worker.inflight_requests, worker.stats.running + worker.stats.waiting)

    def _load(self, worker: WorkerInfo) -> tuple[bool, int]:
        return self._short_of_kv(worker), self._requests(worker)

    def choose(self, candidates: Sequence[WorkerInfo], hashes: Sequence[BlockHash]) -> Choice:
        preferred, matches = _best_match(self.index, candidates, hashes, self.min_match_ratio, self.host_weight)
        if preferred:
            worker = min(preferred, key=self._load)
            fewest = min(self._requests(w) for w in candidates)
            if not self._short_of_kv(worker) and self._requests(worker) - fewest <= self.max_imbalance_requests:
                return Choice(worker, "conversation_affinity", matches[worker.address])
        if len(candidates) == 1:
            worker = candidates[0]
        else:
            first, second = self._rng.sample(list(candidates), 2)
            worker = second if self._load(second) < self._load(first) else first
        return Choice(worker, "power_of_two", matches.get(worker.address, Match()))

    def record(self, worker: WorkerInfo, hashes: Sequence[BlockHash]) -> None:
        self.index.note_routed(worker.address, hashes)

    def forget(self, address: str) -> None:
        self.index.forget(address)


class RoundRobin:
    name = "round_robin"

    def __init__(self, config: RouterConfig | None = None) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[WorkerInfo], hashes: Sequence[BlockHash]) -> Choice:
        ordered = sorted(candidates, key=lambda w: w.address)
        worker = ordered[self._next % len(ordered)]
        self._next += 1
        return Choice(worker, "round_robin")

    def record(self, worker: WorkerInfo, hashes: Sequence[BlockHash]) -> None:
        pass

    def forget(self, address: str) -> None:
        pass


def prefill_locally(decode: Choice, prefill: Choice, num_tokens: int, block_size: int, weight: float) -> bool:
    """Conditional disaggregation: prefill the prompt (`num_tokens`) on the chosen decode worker
    itself rather than on the chosen prefill worker?

    Costs in prompt tokens (both sides drain them at about the same rate on the same hardware;
    each choice's `matched_blocks` are cached there, so only the rest is computed):

    - remote: the prompt's time to first token on the prefill worker, its wait plus its own
      uncached tokens. The wait is the worker's queued prefill tokens, but a worker that runs long
      prompts in chunks (`prefill_chunk_tokens` in its stats, the prefill role's default) lets a
      newcomer in after one chunk, so then at most a chunk.
    - local: its time to first token on the decode worker (that worker's queued prefill tokens
      plus its own uncached ones), plus what it costs the decodes already running there: each of
      them waits for those tokens in its next inter-token intervals (a decode worker caps each of
      its steps with prompt tokens, `--max-step-ratio`), a stall counted `weight` times a token of
      time to first token (1, the default: time for time; 0: stalls are free).

    The prompt stays local when that is cheaper: an idle decode worker takes prompts that would
    queue on a busy prefill worker, one with a stream or two running takes a short prompt while
    the prefill worker is a chunk behind, a busier one rarely does, and an idle pair
    disaggregates (equal costs).
    """
    local = max(0, num_tokens - decode.matched_blocks * block_size)
    remote = max(0, num_tokens - prefill.matched_blocks * block_size)
    wait = prefill.worker.prefill_load_tokens
    chunk = prefill.worker.stats.prefill_chunk_tokens
    if chunk:
        wait = min(wait, chunk)
    running = max(decode.worker.inflight_requests, decode.worker.stats.running)
    stall = weight * running * local if running else 0.0  # inf * 0 is nan
    return decode.worker.prefill_load_tokens + local + stall < wait + remote


def make_prefill_policy(config: RouterConfig, index: KVIndex | None = None) -> Policy:
    return PrefixAffinityPrefill(config, index) if config.prefill_policy == "prefix_affinity" else RoundRobin(config)


def make_decode_policy(config: RouterConfig, index: KVIndex | None = None) -> Policy:
    return PowerOfTwoDecode(config, index) if config.decode_policy == "power_of_two" else RoundRobin(config)

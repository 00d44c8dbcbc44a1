"""Is P/D engaged? How each request's prompt was filled, and an alarm when the prefill pool sits
unused while prompts that should go there do not.

The failure this catches is silent: a misconfigured transport, a KV layout mismatch or a
refused handshake makes every remote prefill fall back to the decode worker, which computes the
prompt itself. Text stays correct; the disaggregation is gone. Each finished request is
classified once, by what its decode worker reported (`TokenChunk.prefilled_remotely`,
`kv_failure_reason`) and what the router chose:

    remote    the prompt's KV came from a prefill worker
    fallback  a prefill worker was asked, the transfer failed (its reason: engine/kv_hooks.py's
              FAILURE_REASONS) and the decode worker prefilled the prompt
    cached    prefilled on the decode worker, all but its last partial block from its prefix cache
    local     prefilled on the decode worker (conditional disaggregation, a colocated worker,
              prompt_logprobs, a sibling choice, or no prefill worker to ask)

`EngagementMonitor` keeps, over a sliding window, the requests that *qualify* for remote prefill
(a decode-role worker, prefill workers in the pool, a prompt of at least `min_prompt_tokens`
computed tokens, no reason of their own to stay local) and says the cluster is degraded when at
least `min_requests` of them finished in the window and none was filled remotely. It is
evaluated when a request finishes and when /health or /metrics asks: nothing polls.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)

FILL_PATHS = ("remote", "local", "cached", "fallback")


@dataclass(frozen=True)
class PromptFill:
    """How one request's prompt got its KV: `path` (one of FILL_PATHS), `reason` (fallback's
    failure reason, else ""), and whether it counts toward the engagement alarm."""
    path: str
    reason: str = ""
    qualifies: bool = False


def classify(prefilled_remotely: bool, failure_reason: str, num_prompt_tokens: int, num_cached_tokens: int,
             block_size: int, eligible: bool, min_prompt_tokens: int) -> PromptFill:
    """`eligible`: the router could have sent this prompt to a prefill worker (see the module
    docstring); it qualifies when, besides, at least `min_prompt_tokens` of it were computed."""
    qualifies = eligible and num_prompt_tokens - num_cached_tokens >= min_prompt_tokens
    if prefilled_remotely:
        return PromptFill("remote", "", qualifies)
    if failure_reason:
        return PromptFill("fallback", failure_reason, qualifies)
    full_blocks = num_prompt_tokens // block_size * block_size
    # A prompt its decode worker held in cache left nothing for a prefill worker to do.
    cached = num_cached_tokens > 0 and num_cached_tokens >= min(full_blocks, num_prompt_tokens - 1)
    return PromptFill("cached" if cached else "local", "", qualifies and not cached)


class EngagementMonitor:
    """The engagement alarm over the last `window_s` seconds (see the module docstring).
    `has_prefill_workers`: whether the pool has prefill workers now (healthy or not: a pool whose
    prefill workers all stopped answering is degraded too)."""

    def __init__(self, window_s: float, min_requests: int, has_prefill_workers: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.min_requests = min_requests
        self._has_prefill_workers = has_prefill_workers
        self._clock = clock
        self._qualified: collections.deque[tuple[float, PromptFill]] = collections.deque()
        self._alarmed = False

    def record(self, fill: PromptFill) -> None:
        if fill.qualifies:
            self._qualified.append((self._clock(), fill))
        self.degraded()

    def degraded(self) -> str | None:
        """Why P/D is not engaged, or None when it is (or there is too little traffic to tell).
        Logs a warning when the alarm starts and a line when it clears."""
        horizon = self._clock() - self.window_s
        while self._qualified and self._qualified[0][0] < horizon:
            self._qualified.popleft()
        detail = self._detail() if self._has_prefill_workers() else None
        if detail and not self._alarmed:
            logger.warning("P/D is not engaged: %s", detail)
        elif self._alarmed and not detail:
            logger.info("P/D is engaged again: a prompt was prefilled on a prefill worker")
        self._alarmed = detail is not None
        return detail

    def _detail(self) -> str | None:
        fills = [fill for _, fill in self._qualified]
        if len(fills) < self.min_requests or any(fill.path == "remote" for fill in fills):
            return None
        paths = collections.Counter(f"{fill.path} ({fill.reason})" if fill.reason else fill.path for fill in fills)
        how = ", ".join(f"{path}: {count}" for path, count in paths.most_common())
        return (f"prefill workers are in the pool but none of the last {len(fills)} requests that qualified "
                f"for remote prefill (in {self.window_s:g} s) was prefilled on one; {how}")

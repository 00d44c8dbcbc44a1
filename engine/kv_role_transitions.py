"""The disaggregation roles' transitions of a request, mixed into `Scheduler` (engine/scheduler.py).

Contract: these methods move a request between `RequestStatus` states (engine/request.py) and
the scheduler's queues; there is no state of their own. The scheduler's core puts a prefill-role
request whose blocks wait for a send in SENDING_KV (`_finish`, when the connector's
`request_finished` says so); from here on:
- prefill role: `finish_sending(request_id, error)` ends a SENDING_KV request ("prefill_done",
  or "error") and unpins its blocks; a send that failed before the prompt was done ends the
  request with the error.
- decode role: `add_imported_request` allocates blocks for every token so far after this
  worker's own prefix-cache match and makes the request WAITING_FOR_KV (raises
  `KVCacheFullError`, nothing changed, when blocks are short, or while a waiting request ahead
  of it (priority, then arrival) could not get its blocks at the last admission: imports do not
  take the blocks it waits for). `finish_import` counts the prompt computed, caches its full
  blocks and appends the first token: the request runs at once, or waits (WAITING, blocks kept)
  if `max_num_seqs` is reached or an import deferred earlier still waits, and is admitted in
  queue order. `fail_import` either falls back to a local prefill (WAITING, blocks kept) or
  ends the request with an error.

`KVRoleTransitions` declares below, as annotations, what it uses of the scheduler: its
queues and counters, and the core's steps (validation, registration, finishing, outputs).
Called from the engine thread only, like the rest of the scheduler.
"""
from __future__ import annotations

from collections.abc import Callable

from engine.block_groups import GroupedBlockManager
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.kv_hooks import ImportPlan, KVCacheFullError
from engine.request import Request, RequestStatus
from engine.step_types import SampledToken, StepOutput


class KVRoleTransitions:
    """The send (prefill role) and import (decode role) transitions of `Scheduler`."""

    # What the scheduler provides (engine/scheduler.py):
    role: str
    config: SchedulerConfig
    block_manager: BlockManager
    waiting: list[Request]
    running: list[Request]
    _importing: dict[str, Request]  # WAITING_FOR_KV
    _sending: dict[str, Request]  # SENDING_KV
    _short_of_blocks: Request | None  # set by each admission
    _imported_tokens: int
    _prefix_queries: int
    _prefix_hits: int
    _validate: Callable[[Request], None]
    _register: Callable[[Request], None]
    _enqueue_waiting: Callable[[Request], None]
    _enqueue_running: Callable[[Request], None]
    _after_token: Callable[[Request, int], tuple[str | None, str | None]]
    _finish: Callable[..., tuple[str | None, str | None]]
    _end: Callable[[str, str, str | None], StepOutput | None]
    _output: Callable[[Request, list[SampledToken], str | None, str | None], StepOutput]

    # ---- prefill role: the send ------------------------------------------------------------

    def finish_sending(self, request_id: str, error: str | None) -> StepOutput | None:
        """The connector's send of a request ended (`error` None: every block arrived). A
        SENDING_KV request finishes ("prefill_done", or "error") and its blocks are unpinned; a
        send that failed before the prompt was done ends its request with the error. None if
        the request is unknown or finished."""
        request = self._sending.get(request_id)
        if request is None:
            return self._end(request_id, "error", error) if error is not None else None
        reason, error = self._finish(request, "prefill_done" if error is None else "error", error)
        return StepOutput(request_id, [], [], True, reason, request.num_cached_tokens, error)

    # ---- decode role: import ---------------------------------------------------------------

    def add_imported_request(self, request: Request) -> ImportPlan:
        """Allocate blocks for the whole prompt after this worker's own prefix-cache match.

        The request waits (WAITING_FOR_KV) until `finish_import` or `fail_import`; its blocks are
        its own meanwhile. Raises ValueError for an invalid request and KVCacheFullError if the
        blocks are not free now (in both cases nothing changed).
        """
        if self.role == "prefill":
            raise ValueError("a prefill-role scheduler does not import KV")
        self._validate(request)
        if request.needs_prompt_logprobs:
            raise ValueError("prompt_logprobs are computed where the prompt is prefilled: send this request "
                             "without a prefill worker")
        ahead = self._short_of_blocks
        if ahead is not None and ahead.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) \
                and not ahead.block_ids and ahead.priority <= request.priority:
            raise KVCacheFullError(f"request {ahead.request_id} waits for free KV blocks ahead of "
                                   f"{request.request_id}")
        prefix_blocks, num_hit = self.block_manager.find_cached_prefix(request)
        host_hits = self.block_manager.find_host_prefix(request, len(prefix_blocks))
        # The imported KV covers every token so far: the prompt, and a resumed request's outputs;
        # this worker computes from their end on.
        if not self.block_manager.allocate_slots(request, request.num_tokens, prefix_blocks, host_hits,
                                                 start=request.num_tokens):
            needed = self.block_manager.blocks_needed(request.num_tokens) - len(prefix_blocks)
            raise KVCacheFullError(f"request {request.request_id} needs {needed} free KV blocks, "
                                   f"{self.block_manager.num_free_blocks} are free")
        self._register(request)
        num_hit += host_hits * self.block_manager.block_size
        request.num_computed_tokens = num_hit
        request.num_cached_tokens = num_hit
        self._prefix_queries += request.num_tokens
        self._prefix_hits += num_hit
        request.status = RequestStatus.WAITING_FOR_KV
        self._importing[request.request_id] = request
        first = num_hit // self.block_manager.block_size
        if isinstance(self.block_manager, GroupedBlockManager):
            return ImportPlan(request.request_id, list(request.block_ids), num_hit, [],
                              self.block_manager.destination_groups(request, first))
        return ImportPlan(request.request_id, list(request.block_ids), num_hit,
                          [(index, request.block_ids[index]) for index in range(first, len(request.block_ids))])

    def _importing_request(self, request_id: str) -> Request:
        request = self._importing.get(request_id)
        if request is None:
            raise ValueError(f"request {request_id!r} is not waiting for KV")
        return request

    def finish_import(self, request_id: str, first_token: SampledToken, complete_blocks: int | None = None) -> StepOutput:
        """The transfer wrote every block to fill: the prompt counts as computed, its full blocks
        join the prefix cache (those before `complete_blocks` only, when the blocks from there on
        lack some sliding-window layer's KV), and the first token (sampled by the prefill worker)
        is appended. Returns that token's output (finished if the token already ends the request)."""
        request = self._importing_request(request_id)
        self._imported_tokens += request.num_tokens - request.num_computed_tokens
        request.num_computed_tokens = request.num_tokens
        request.max_cached_blocks = complete_blocks
        self.block_manager.cache_computed_blocks(request)
        request.append_output(first_token.token_id, first_token)
        reason, error = self._after_token(request, first_token.token_id)
        if reason is not None:
            reason, error = self._finish(request, reason, error)
        else:
            del self._importing[request_id]
            # Straight to running (its next token is a decode, scheduled before any prefill chunk)
            # unless the seq cap is reached or an import deferred earlier still waits: then it is
            # admitted in queue order after that one.
            if len(self.running) < self.config.max_num_seqs and not any(r.block_ids for r in self.waiting):
                self._enqueue_running(request)
            else:
                request.status = RequestStatus.WAITING
                self._enqueue_waiting(request)
        return self._output(request, [first_token], reason, error)

    def fail_import(self, request_id: str, fallback_to_local_prefill: bool, message: str = "KV transfer failed",
                    first_token: SampledToken | None = None) -> StepOutput | None:
        """The transfer failed or timed out. Either prefill locally from the cached prefix (the
        request keeps its blocks and waits; returns None) or end it with an error.

        `first_token`: the prefill worker's, already streamed to the caller (only its KV failed).
        A fallback keeps it: it is appended (its output is returned, finished if it ends the
        request) and the local prefill covers the prompt and it, then samples the second token."""
        request = self._importing_request(request_id)
        if not fallback_to_local_prefill:
            return self._end(request_id, "error", message)
        request.num_computed_tokens = request.num_cached_tokens
        reason, error = None, None
        if first_token is not None:
            request.append_output(first_token.token_id, first_token)
            reason, error = self._after_token(request, first_token.token_id)
        if reason is not None:
            reason, error = self._finish(request, reason, error)
        else:
            del self._importing[request_id]
            request.status = RequestStatus.WAITING
            self._enqueue_waiting(request)
        if first_token is None:
            return None
        return self._output(request, [first_token], reason, error)

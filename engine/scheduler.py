"""Token-budget scheduler: continuous batching, chunked prefill, prefix caching, preemption.

Contract (docs/design.md, "Inside the engine"): `schedule() -> Batch`, the model runner turns the batch
into tensors and returns one `SampledToken` per seq with `sample=True`, then
`update(batch, sampled) -> list[StepOutput]`; `sampled` maps each such request to its new tokens
(one, or with a draft the accepted draft tokens and one more). There is no prefill/decode phase: every running
request has `num_computed_tokens` catching up with `num_tokens`. Per step:

    1. running decodes (one token each; a block boundary takes a new block), then, with
       speculative decoding (engine/speculative.py), their draft tokens from what is left,
    2. running prefill chunks (the rest of the budget; with `long_prefill_chunk_tokens`, a long
       prompt runs at most that many tokens per step while others wait, so they pass it, and
       it skips steps while prompts that fit in a chunk are waiting, until they have run a
       chunk's worth of tokens since its last chunk),
    3. waiting requests in priority order (prefix-cache match first), while the token budget
       (`max_num_batched_tokens`), the running cap (`max_num_seqs`) and free blocks allow; a
       request that does not fit blocks those behind it, except requests already holding their
       blocks (a KV import deferred or falling back), which may pass it. If nothing runs and
       waiting requests that hold blocks still cannot be admitted (each needs one block more and
       they hold them all), the last of them in queue order gives its blocks back (a recompute
       preemption) until one can: no step would free a block otherwise.

When a running request needs a block and none is free, the least important running request is
preempted: its blocks are freed, its outputs are kept, and it is requeued by priority/arrival;
after a preemption no waiting request is admitted that step. `recompute` (the default) sets
`num_computed_tokens = 0`; readmitted, it recomputes what the prefix cache no longer holds.
`swap` first copies the blocks holding its computed tokens to host swap slots
(`Batch.swap_out`, done by the runner before that step's forward, so the freed blocks can be
reused at once) and keeps `num_computed_tokens`; readmitted, it takes the blocks still in the
prefix cache and gets the rest copied back (`Batch.swap_in`). Without enough free swap slots a
victim is recomputed instead. A step never has both swap-outs and swap-ins, so a slot freed by a
swap-in is never refilled before it is read.

With a host cache tier (`num_host_slots`, engine/host_cache.py), admission looks a fresh
request's prefix up on the device, then in the host tier; host hits count as cached tokens and
come back by copy (`Batch.kv_reload`), and cached blocks evicted on the way are saved
(`Batch.kv_offload`). The runner does, before the forward: offloads, swap-outs, swap-ins, reloads.

Conventions and choices beyond the shared contract:
- priority: a LOWER value is MORE important; equal priorities are first-come-first-served.
- a generation stops with "length" at `min(max_model_len, num_blocks * block_size)` tokens, so a
  request alone always fits in the cache (no endless self-preemption).
- `Batch.seqs` puts every decode (one token that samples) before every prefill chunk; a decode
  with a draft (`ScheduledSeq.draft_token_ids`) runs 1 + k tokens and comes after the plain
  decodes. After its step the request has `num_computed_tokens == num_tokens - 1` again: the
  rejected draft tokens' slots hold KV that nothing counts as computed, and blocks that only
  they used go back to the free list.
- `StepOutput.new_logprobs[i]` is the runner's `SampledToken` for `new_token_ids[i]`;
  `StepOutput.error` carries the message of an "error" finish.
- prefill role: a request is admitted with blocks for its whole prompt (it never needs more, so it
  is never preempted) and finishes after its first token with finish_reason "prefill_done". If
  the KV connector says its blocks wait for a send (`request_finished`), it becomes SENDING_KV
  instead (blocks pinned, the first token's output not final) until `finish_sending`.
- the roles' send and import transitions (`finish_sending`; `add_imported_request`,
  `finish_import`, `fail_import`) are `KVRoleTransitions` (engine/kv_role_transitions.py, its
  contract there), mixed in: the same `RequestStatus` states and queues as the core here.
- `get_request(id)` also finds requests finished since the last `schedule()` call.
- a request that ends early (abort, error) in any state first has the connector's
  `request_ended` stop its transfer, then its blocks are freed.
Not thread-safe: one thread drives schedule/update/abort/imports.
"""
from __future__ import annotations

import bisect
import itertools
import time

from engine.block_groups import GroupedBlockManager
from engine.block_manager import BlockManager
from engine.config import ROLES, CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.kv_groups import KVGroups
from engine.kv_hooks import SchedulerConnector
from engine.kv_role_transitions import KVRoleTransitions
from engine.request import Request, RequestStatus
from engine.speculative import Proposer, build_proposer
from engine.step_cost import StepCostModel
from engine.step_types import Batch, SampledToken, ScheduledSeq, SchedulerStats, StepOutput
from engine.step_times import StepTimeHistogram

class Scheduler(KVRoleTransitions):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, role: str = "both", kv_connector: SchedulerConnector | None = None,
                 num_swap_slots: int = 0, num_host_slots: int = 0,
                 speculative: SpeculativeConfig | None = None, proposer: Proposer | None = None,
                 kv_groups: KVGroups | None = None) -> None:
        """`speculative`: speculative decoding's config (off when None or not enabled); its
        drafts come from `proposer`, by default the one the config names. `kv_groups`: the
        cache's layer groups (engine/kv_groups.py; None: one group of every layer)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if scheduler_config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {scheduler_config.preemption_mode!r}")
        if scheduler_config.preemption_mode == "swap" and num_swap_slots < 1:
            raise ValueError("swap preemption needs host swap space: set swap_space_gb > 0")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if not scheduler_config.enable_chunked_prefill and scheduler_config.max_num_batched_tokens < max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens "
                             f"({scheduler_config.max_num_batched_tokens}) must be >= max_model_len ({max_model_len})")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.step_cost = StepCostModel(min_tokens=cache_config.block_size)  # fed by observe_step()
        self.step_times = StepTimeHistogram()  # fed by observe_step(); in stats()
        self.role = role
        self.kv_connector = kv_connector
        self.max_model_len = max_model_len
        if kv_groups is not None and kv_groups.grouped:
            if role == "prefill" or num_swap_slots or num_host_slots:
                raise ValueError("a grouped KV cache (sliding-window layers' blocks given back) works in a colocated "
                                 "or decode-role engine without swap space or the host tier")
            self.block_manager: BlockManager = GroupedBlockManager(
                num_blocks, cache_config.block_size, kv_groups, cache_config.enable_prefix_caching,
                record_kv_events=cache_config.kv_events)
        else:
            self.block_manager = BlockManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                              num_host_slots=num_host_slots, record_kv_events=cache_config.kv_events)
        self.max_sequence_tokens = min(max_model_len, self.block_manager.token_capacity)
        # Speculative decoding: a prefill-role worker samples one token per request, never drafts.
        self.speculative = speculative if speculative is not None and speculative.enabled and role != "prefill" else None
        self.proposer = None
        if self.speculative is not None:
            self.proposer = proposer or build_proposer(self.speculative)

        self.waiting: list[Request] = []  # sorted by (priority, arrival_time, admission order)
        self.running: list[Request] = []  # same order; the last one is the first to be preempted
        self._importing: dict[str, Request] = {}
        # the first fresh waiting request the last admission could not give blocks (decode role:
        # imports must not take the blocks it waits for)
        self._short_of_blocks: Request | None = None
        self._sending: dict[str, Request] = {}  # SENDING_KV
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._recently_finished: dict[str, Request] = {}
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        # (the long prompt that skipped the last step's chunk, prompt tokens run in the steps it skipped in a row)
        self._yielded: tuple[str, int] | None = None

        self._num_preemptions = 0
        self.num_swap_slots = num_swap_slots if scheduler_config.preemption_mode == "swap" else 0
        self._free_swap_slots = list(range(self.num_swap_slots - 1, -1, -1))  # a stack: low slots first
        self._swap_out: list[tuple[int, int]] = []  # this schedule() call's copies, for its Batch
        self._swap_in: list[tuple[int, int]] = []
        self._swapped_out_blocks = 0
        self._swapped_in_blocks = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._prompt_tokens_computed = 0
        self._decode_tokens = 0
        self._imported_tokens = 0
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted_tokens = 0

    # ---- queues ----------------------------------------------------------------------------

    def _key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time, self._order[request.request_id])

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._key)

    def _enqueue_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        bisect.insort(self.running, request, key=self._key)

    def get_request(self, request_id: str) -> Request | None:
        return (self._requests.get(request_id) or self._sending.get(request_id)
                or self._recently_finished.get(request_id))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_sending_kv(self) -> int:
        return len(self._sending)

    def request_ids(self) -> list[str]:
        """Ids of every unfinished request, then of SENDING_KV ones (blocks still pinned)."""
        return list(self._requests) + list(self._sending)

    def has_unfinished(self) -> bool:
        """True while a request is waiting, running, waiting for its KV or sending it."""
        return bool(self.waiting or self.running or self._importing or self._sending)

    # ---- admission -------------------------------------------------------------------------

    def _validate(self, request: Request) -> None:
        if request.request_id in self._requests or request.request_id in self._sending:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if (request.status is not RequestStatus.WAITING or request.block_ids
                or len(request.output_token_ids) != request.num_resumed_tokens):
            raise ValueError(f"request {request.request_id!r} is not a new request")
        prompt = request.all_token_ids  # a resumed request's outputs so far are computed like its prompt
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        # below 2**32: block hashes (engine/block_hash.py) and the wire pack token ids as uint32, and a
        # larger one would fail in schedule(), outside any one request, and stop the engine loop
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 32 for t in prompt):
            raise ValueError("prompt token ids must be non-negative integers below 2**32")
        if len(prompt) > self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens, more than max_model_len ({self.max_model_len})")
        capacity = self.block_manager.token_capacity
        if len(prompt) > capacity:
            raise ValueError(f"the prompt has {len(prompt)} tokens, more than the whole KV cache holds ({capacity})")
        max_tokens = request.sampling_params.max_tokens
        if request.num_resumed_tokens >= max_tokens:
            raise ValueError(f"the request resumes with {request.num_resumed_tokens} output tokens, "
                             f"max_tokens ({max_tokens}) leaves none to generate")

    def _register(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._order[request.request_id] = next(self._counter)

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError (nothing changed) for an invalid one."""
        self._validate(request)
        self._register(request)
        self._enqueue_waiting(request)

    # ---- schedule --------------------------------------------------------------------------

    def schedule(self) -> Batch:
        self._recently_finished.clear()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        preempted: list[str] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        yielded: Request | None = None  # at most one long prompt skips its chunk per step

        for decodes in (True, False):
            if not decodes and self.proposer is not None:
                budget = self._add_drafts(scheduled, budget)
            if not decodes and self.config.step_target_set and scheduled:
                target_s = None if self.config.max_step_ms is None else self.config.max_step_ms / 1000.0
                drafts = sum(len(seq.draft_token_ids) for seq in scheduled.values())
                cap = self.step_cost.prefill_budget(len(scheduled), target_s, self.config.max_step_ratio, drafts)
                if cap is not None:
                    budget = min(budget, cap)
            for request in list(self.running):
                if budget == 0:
                    break
                if request.status is not RequestStatus.RUNNING or request.request_id in scheduled:
                    continue
                remaining = request.num_tokens - request.num_computed_tokens
                if (remaining == 1) != decodes:
                    continue
                if not decodes and yielded is None and self._yields_to_short_prompts(request):
                    yielded = request
                    continue
                budget = self._schedule_running(request, remaining, budget, scheduled, preempted)

        admitted = 0
        if not preempted:
            before = len(scheduled)
            budget = self._admit_waiting(budget, scheduled)
            while not self.running and self._release_a_waiting_holder():
                budget = self._admit_waiting(budget, scheduled)
            admitted = len(scheduled) - before
        if yielded is not None and not admitted:  # nobody took the step: the chunk runs after all
            if budget > 0 and yielded.status is RequestStatus.RUNNING:
                budget = self._schedule_running(yielded, yielded.num_tokens - yielded.num_computed_tokens,
                                                budget, scheduled, preempted)
            yielded = None
        self._note_yield(yielded, scheduled)

        seqs = sorted(scheduled.values(), key=lambda s: not s.is_plain_decode)
        offloads, reloads = self.block_manager.take_host_copies()
        return Batch(seqs=seqs, num_tokens=sum(s.num_new_tokens for s in seqs), preempted_ids=preempted,
                     swap_out=self._swap_out, swap_in=self._swap_in, kv_offload=offloads, kv_reload=reloads)

    def observe_step(self, batch: Batch, seconds: float) -> None:
        """How long the model took for `batch` (the engine times every step it runs): counted in
        the step-time histogram; learned by the step-cost model when a step-time target is set."""
        # prompt work: a prompt's tokens, or a recompute's several tokens (a decode runs one, plus its draft)
        prompt = any(seq.start < seq.request.num_prompt_tokens or seq.num_new_tokens > 1 + len(seq.draft_token_ids)
                     for seq in batch.seqs)
        self.step_times.observe("prefill" if prompt else "decode", seconds)
        if not self.config.step_target_set:
            return
        # a decode runs 1 + its draft tokens: decode work, never prompt work
        decoding = [seq for seq in batch.seqs if seq.sample and seq.num_new_tokens == 1 + len(seq.draft_token_ids)]
        drafts = sum(len(seq.draft_token_ids) for seq in decoding)
        self.step_cost.observe(len(decoding), batch.num_tokens - len(decoding) - drafts, seconds, drafts)

    def take_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Host-tier copies queued outside `schedule()` (a decode-role import's allocation): the
        caller must do them (offloads, then reloads) before anything writes into those blocks."""
        return self.block_manager.take_host_copies()

    def _schedule_running(self, request: Request, remaining: int, budget: int,
                          scheduled: dict[str, ScheduledSeq], preempted: list[str]) -> int:
        """Schedule a running request's next `remaining` tokens (a decode, or a prompt chunk up to
        the budget and the long-prompt cap), preempting from the back for its blocks; returns the
        budget left."""
        num_new = min(remaining, budget)
        if remaining > 1:
            num_new = min(num_new, self._long_prefill_cap(request))
        if num_new < remaining and not self.config.enable_chunked_prefill:
            return budget
        while not self.block_manager.allocate_slots(request, request.num_computed_tokens + num_new):
            victim = self.running[-1]
            budget += self._preempt(victim, scheduled)
            preempted.append(victim.request_id)
            if victim is request:
                return budget
        scheduled[request.request_id] = self._scheduled_seq(request, num_new)
        return budget - num_new

    def _yields_to_short_prompts(self, request: Request) -> bool:
        """Whether a long prompt skips its chunk this step so that short prompts waiting behind it
        run alone (their TTFT is one short step, not a chunk plus their own prefill). A short
        prompt is one whose uncomputed tokens fit in one chunk. A long prompt keeps yielding, step
        after step, until the prompts that ran in the steps it skipped reach a chunk's worth of
        tokens: two short prompts that arrive a moment apart both pass, and a stream of them
        cannot starve it (it skips no more steps once they ran a chunk's worth, however many
        prompts its last skipped step admitted). One long prompt yields per step (the others keep
        running)."""
        cap = self.config.long_prefill_chunk_tokens
        if (cap is None or not self.config.enable_chunked_prefill
                or request.num_tokens - request.num_computed_tokens <= cap
                or (self._yielded is not None and self._yielded[0] == request.request_id
                    and self._yielded[1] >= cap)
                or len(self.running) >= self.config.max_num_seqs):
            return False
        return any(not waiting.block_ids and waiting.num_tokens - waiting.num_computed_tokens <= cap
                   for waiting in self.waiting)

    def _note_yield(self, yielded: Request | None, scheduled: dict[str, ScheduledSeq]) -> None:
        """Count the prompt tokens that ran in a step `yielded` skipped (its yields in a row add up)."""
        if yielded is None:
            self._yielded = None
            return
        tokens = sum(seq.num_new_tokens for seq in scheduled.values() if not seq.is_plain_decode)
        if self._yielded is not None and self._yielded[0] == yielded.request_id:
            tokens += self._yielded[1]
        self._yielded = (yielded.request_id, tokens)

    def _long_prefill_cap(self, request: Request) -> int:
        """How many of a running prompt's tokens this step may run: at most
        `long_prefill_chunk_tokens`, even alone, so that a prompt arriving meanwhile waits for one
        chunk rather than the whole prompt; the rest of the budget admits it (it passes between the
        long prompt's chunks)."""
        cap = self.config.long_prefill_chunk_tokens
        if cap is None or not self.config.enable_chunked_prefill:
            return request.num_tokens
        return cap

    def _add_drafts(self, scheduled: dict[str, ScheduledSeq], budget: int) -> int:
        """Speculative decoding: extend this step's decodes with draft tokens, within the budget;
        returns the budget left. A draft stops at max_tokens and at the context's end, and is
        dropped when its KV slots are not free, leaving aside the blocks the running prompts'
        chunks of this step need (which run after it): a draft never causes a preemption."""
        config = self.speculative
        decodes = [seq for seq in scheduled.values() if seq.is_plain_decode]
        if (budget <= 0 or not decodes or (config.speculative_disable_by_batch_size is not None
                                           and len(decodes) > config.speculative_disable_by_batch_size)):
            return budget
        decodes = [seq for seq in decodes
                   if seq.request.sampling_params.speculative and seq.request.grammar is None]
        limits = [max(0, min(config.num_speculative_tokens,
                             seq.request.sampling_params.max_tokens - seq.request.num_output_tokens - 1,
                             self.max_sequence_tokens - seq.request.num_tokens)) for seq in decodes]
        blocks = self.block_manager
        reserved = sum(blocks.new_blocks_for(r, r.num_computed_tokens + min(r.num_tokens - r.num_computed_tokens, budget))
                       for r in self.running if r.status is RequestStatus.RUNNING and r.request_id not in scheduled
                       and r.num_tokens - r.num_computed_tokens > 1)
        for seq, draft in zip(decodes, self.proposer.propose([seq.request for seq in decodes], limits)):
            draft = list(draft[:budget])
            request = seq.request
            needed = blocks.new_blocks_for(request, request.num_tokens + len(draft))
            if not draft or needed > blocks.num_free_blocks - reserved:
                continue
            if not blocks.allocate_slots(request, request.num_tokens + len(draft)):
                continue
            seq.draft_token_ids = draft
            seq.num_new_tokens += len(draft)
            budget -= len(draft)
            if budget == 0:
                break
        return budget

    def _scheduled_seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        return ScheduledSeq(request, start, num_new, start + num_new == request.num_tokens)

    def _admit_waiting(self, budget: int, scheduled: dict[str, ScheduledSeq]) -> int:
        """Admit in queue order. Once a request without blocks cannot be admitted, only requests
        that already hold their blocks (imports falling back or deferred by the seq cap) may pass
        it: they need no more than a block, and their progress is what frees blocks."""
        blocked = False
        self._short_of_blocks = None
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[index]
            fresh = not request.block_ids  # new or preempted
            if blocked and fresh:
                index += 1
                continue
            # A request that still needs its prompt's logprobs computes the whole prompt.
            lookup = fresh and not request.needs_prompt_logprobs
            prefix_blocks, num_hit = self.block_manager.find_cached_prefix(request) if lookup else ([], 0)
            host_hits = 0
            if request.swap_slots:  # swapped out: its computed tokens come back, the cache first
                prefix_blocks = prefix_blocks[:request.num_computed_tokens // self.block_manager.block_size]
                computed = request.num_computed_tokens
            elif fresh:
                host_hits = self.block_manager.find_host_prefix(request, len(prefix_blocks)) if lookup else 0
                num_hit += host_hits * self.block_manager.block_size
                computed = num_hit
            else:
                computed = request.num_computed_tokens
            remaining = request.num_tokens - computed
            num_new = min(remaining, budget, self._long_prefill_cap(request))
            if num_new < remaining and not self.config.enable_chunked_prefill:
                blocked = True
                index += 1
                continue
            # a prefill-role request takes its whole prompt now: it never asks again
            if not self.block_manager.allocate_slots(
                    request, request.num_tokens if self.role == "prefill" else computed + num_new,
                    prefix_blocks, host_hits):
                if fresh and not blocked:
                    self._short_of_blocks = request
                blocked = True
                index += 1
                continue
            self.waiting.pop(index)
            if request.swap_slots:
                self._swap_back(request, len(prefix_blocks))
            elif fresh:
                request.num_computed_tokens = num_hit
                self._prefix_queries += request.num_tokens
                self._prefix_hits += num_hit
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_hit
            self._enqueue_running(request)
            scheduled[request.request_id] = self._scheduled_seq(request, num_new)
            budget -= num_new
        return budget

    def _release_a_waiting_holder(self) -> bool:
        """Nothing runs: give back the blocks of the last waiting request (queue order) that holds
        some, as a recompute preemption. False when none does."""
        for request in reversed(self.waiting):
            if request.block_ids:
                request.num_computed_tokens = 0
                request.max_cached_blocks = None
                self.block_manager.free(request)
                request.status = RequestStatus.PREEMPTED
                request.num_preemptions += 1
                self._num_preemptions += 1
                return True
        return False

    def _preempt(self, victim: Request, scheduled: dict[str, ScheduledSeq]) -> int:
        """Swap or recompute preemption. Returns the budget given back if the victim was already
        scheduled."""
        self.running.remove(victim)
        held = self.block_manager.blocks_needed(victim.num_computed_tokens)
        if self.num_swap_slots and victim.num_computed_tokens and held <= len(self._free_swap_slots):
            victim.swap_slots = [self._free_swap_slots.pop() for _ in range(held)]
            self._swap_out.extend(zip(victim.block_ids[:held], victim.swap_slots))
            self._swapped_out_blocks += held
        else:
            victim.num_computed_tokens = 0
            victim.max_cached_blocks = None  # recomputed here: every layer's KV
        self.block_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self._num_preemptions += 1
        self._enqueue_waiting(victim)
        unscheduled = scheduled.pop(victim.request_id, None)
        return unscheduled.num_new_tokens if unscheduled is not None else 0

    def _swap_back(self, request: Request, num_cached: int) -> None:
        """The request holds blocks again, the first `num_cached` from the prefix cache: copy the
        others back from its swap slots and free every slot."""
        pairs = list(zip(request.swap_slots[num_cached:], request.block_ids[num_cached:len(request.swap_slots)]))
        self._swap_in.extend(pairs)
        self._swapped_in_blocks += len(pairs)
        self._release_swap(request)

    def _release_swap(self, request: Request) -> None:
        self._free_swap_slots.extend(reversed(request.swap_slots))
        request.swap_slots = []

    # ---- update ----------------------------------------------------------------------------

    def update(self, batch: Batch, sampled: dict[str, list[SampledToken]]) -> list[StepOutput]:
        """Advance every scheduled seq by its tokens, append sampled tokens (up to the first that
        stops the request), finish stopped requests.

        Seqs whose request finished (e.g. was aborted) since `schedule()` are skipped.
        """
        outputs: list[StepOutput] = []
        for seq in batch.seqs:
            request = seq.request
            if request.status is not RequestStatus.RUNNING or self._requests.get(request.request_id) is not request:
                continue
            if request.num_computed_tokens != seq.start:
                raise RuntimeError(f"stale batch: request {request.request_id} has {request.num_computed_tokens} "
                                   f"computed tokens, the batch started it at {seq.start}")
            end = seq.start + seq.num_new_tokens
            prompt_part = max(0, min(end, request.num_prompt_tokens) - seq.start)
            self._prompt_tokens_computed += prompt_part
            self._decode_tokens += seq.num_new_tokens - prompt_part
            if not seq.sample:
                request.num_computed_tokens = end
                self.block_manager.cache_computed_blocks(request)
                continue
            tokens = self._verified(seq, sampled.get(request.request_id))
            new: list[SampledToken] = []
            reason = error = None
            for token in tokens:
                request.append_output(token.token_id, token)
                new.append(token)
                reason, error = self._after_token(request, token.token_id)
                if reason is not None:
                    break
            # What the step computed: every real token, and the accepted draft tokens (the last
            # new token is not computed yet). Without a draft that is `end`.
            request.num_computed_tokens = request.num_tokens - 1
            self.block_manager.cache_computed_blocks(request)
            if seq.draft_token_ids and reason is None:  # the blocks of the rejected draft tokens' slots
                self.block_manager.free_tail(request, request.num_tokens)
            if reason is not None:
                reason, error = self._finish(request, reason, error)
            outputs.append(self._output(request, new, reason, error))
        return outputs

    def _verified(self, seq: ScheduledSeq, tokens: list[SampledToken] | None) -> list[SampledToken]:
        """The runner's new tokens for a sampled seq, checked against its draft; counts the draft."""
        request_id, draft = seq.request.request_id, seq.draft_token_ids
        if not tokens:
            raise ValueError(f"the runner returned no sampled token for request {request_id}")
        accepted = len(tokens) - 1
        if accepted > len(draft) or [t.token_id for t in tokens[:accepted]] != draft[:accepted]:
            raise ValueError(f"the runner returned {len(tokens)} tokens for request {request_id}, which are not "
                             f"an accepted prefix of its {len(draft)}-token draft and one more")
        if draft:
            self._spec_drafts += 1
            self._spec_draft_tokens += len(draft)
            self._spec_accepted_tokens += accepted
        return tokens

    @staticmethod
    def _output(request: Request, new: list[SampledToken], reason: str | None, error: str | None) -> StepOutput:
        """The output of a step's (or a transfer's) new tokens for `request`, finished when `reason`."""
        grammar = request.grammar
        invalid = reason == "error" and grammar is not None and grammar.rejected_token is not None \
            and grammar.allows_nothing
        return StepOutput(request.request_id, [t.token_id for t in new], new, reason is not None, reason,
                          request.num_cached_tokens, error, invalid_request=invalid)

    def _after_token(self, request: Request, token_id: int) -> tuple[str | None, str | None]:
        """(finish reason, error) once `token_id` was appended; (None, None) to go on."""
        grammar = request.grammar
        if grammar is not None and grammar.rejected_token is not None:
            kind = request.sampling_params.structured_output.kind
            if grammar.allows_nothing:
                return "error", (f"the request's {kind} constraint allows no token after "
                                 f"{request.num_output_tokens - 1} output tokens: no text satisfies it "
                                 "(an impossible pattern or an empty enum, say)")
            # Otherwise sampling was masked by the grammar, so this means an inconsistent state (e.g.
            # a first token from a prefill worker that did not apply the constraint).
            return "error", f"token {grammar.rejected_token} does not match the request's {kind} constraint"
        if self.role == "prefill":
            return "prefill_done", None
        return self._stop_reason(request, token_id), None

    def _stop_reason(self, request: Request, token_id: int) -> str | None:
        params = request.sampling_params
        if request.grammar is not None and request.grammar.is_terminated:
            return "stop"  # the output is complete (its end-of-sequence token was accepted)
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_sequence_tokens:
            return "length"
        return None

    def _finish(self, request: Request, reason: str, error: str | None = None) -> tuple[str | None, str | None]:
        """End a request (any state) and free its blocks, or make a prefill-role request
        SENDING_KV (returns (None, None): not finished yet). Returns the final (reason, error)."""
        request_id = request.request_id
        status = request.status
        if status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif status is RequestStatus.WAITING_FOR_KV:
            del self._importing[request_id]
        if status is RequestStatus.SENDING_KV:
            del self._sending[request_id]
        else:
            del self._requests[request_id]
            del self._order[request_id]
        self._release_swap(request)
        connector = self.kv_connector
        if (reason == "prefill_done" and status is not RequestStatus.SENDING_KV and connector is not None
                and connector.request_finished(request)):
            request.status = RequestStatus.SENDING_KV
            self._sending[request_id] = request
            return None, None
        if connector is not None and reason != "prefill_done":
            connector.request_ended(request)  # no transfer touches its blocks after this
        self._recently_finished[request_id] = request
        request.set_finished(reason, error)
        self.block_manager.free(request)
        return reason, error

    # ---- abort / errors --------------------------------------------------------------------

    def abort(self, request_id: str) -> StepOutput | None:
        """End a request in any state, freeing its blocks at once. Returns its final output, or
        None if it is unknown or already finished."""
        return self._end(request_id, "abort", None)

    def finish_with_error(self, request_id: str, message: str) -> StepOutput | None:
        return self._end(request_id, "error", message)

    def _end(self, request_id: str, reason: str, message: str | None) -> StepOutput | None:
        request = self._requests.get(request_id) or self._sending.get(request_id)
        if request is None:
            return None
        reason, error = self._finish(request, reason, message)
        return StepOutput(request_id, [], [], True, reason, request.num_cached_tokens, error)

    # ---- prefill role: the send; decode role: import: KVRoleTransitions (kv_role_transitions.py)

    # ---- counters --------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        host = bm.host_cache
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting), kv_blocks_total=bm.num_blocks - bm.num_reserved,
            kv_blocks_free=bm.num_free_blocks, kv_blocks_cached=bm.num_cached_blocks,
            prefix_cache_queries=self._prefix_queries, prefix_cache_hits=self._prefix_hits,
            num_preemptions=self._num_preemptions, prompt_tokens_computed=self._prompt_tokens_computed,
            decode_tokens=self._decode_tokens, waiting_for_kv=len(self._importing), sending_kv=len(self._sending),
            imported_tokens=self._imported_tokens,
            swapped=sum(1 for r in self.waiting if r.swap_slots), swap_slots_free=len(self._free_swap_slots),
            swapped_out_blocks=self._swapped_out_blocks, swapped_in_blocks=self._swapped_in_blocks,
            host_cache_slots=host.num_slots if host else 0, host_cache_used=host.num_used if host else 0,
            # every host-hit block is copied back exactly once
            host_cache_hits=host.reloaded_blocks * bm.block_size if host else 0,
            offloaded_blocks=host.offloaded_blocks if host else 0, reloaded_blocks=host.reloaded_blocks if host else 0,
            spec_drafts=self._spec_drafts, spec_draft_tokens=self._spec_draft_tokens,
            spec_accepted_tokens=self._spec_accepted_tokens,
            prefill_chunk_tokens=(self.config.long_prefill_chunk_tokens or 0) if self.config.enable_chunked_prefill else 0,
            step_times=self.step_times.snapshot())

    def check_integrity(self) -> None:
        """Block-manager invariants, plus: every request sits in exactly the queue its status
        names, running ones hold blocks for their computed tokens, only live or SENDING_KV requests
        hold blocks, and the running cap holds. Raises AssertionError naming what is broken."""
        self.block_manager.check_integrity()
        queues = ([(r, (RequestStatus.RUNNING,)) for r in self.running]
                  + [(r, (RequestStatus.WAITING, RequestStatus.PREEMPTED)) for r in self.waiting]
                  + [(r, (RequestStatus.WAITING_FOR_KV,)) for r in self._importing.values()])
        seen = [r.request_id for r, _ in queues]
        if sorted(seen) != sorted(self._requests):
            raise AssertionError(f"queued requests {sorted(seen)} != live requests {sorted(self._requests)}")
        for request, statuses in queues:
            if request.status not in statuses:
                raise AssertionError(f"{request} is queued as {statuses[0].name}")
            covered = len(request.block_ids) * self.block_manager.block_size
            if request.status is not RequestStatus.PREEMPTED and covered < request.num_computed_tokens:
                raise AssertionError(f"{request} has computed tokens outside its blocks")
            if request.status is RequestStatus.PREEMPTED and request.num_computed_tokens and (
                    len(request.swap_slots) != self.block_manager.blocks_needed(request.num_computed_tokens)):
                raise AssertionError(f"preempted {request} keeps computed tokens without swap slots for them")
        held = sorted(s for r in self._requests.values() for s in r.swap_slots)
        if len(held) != len(set(held)) or sorted(held + self._free_swap_slots) != list(range(self.num_swap_slots)):
            raise AssertionError(f"swap slots are not free xor held by exactly one request: held {held}, "
                                 f"free {sorted(self._free_swap_slots)}")
        for request_id in self.block_manager.holder_ids():
            if request_id not in self._requests and request_id not in self._sending:
                raise AssertionError(f"request {request_id} holds blocks but is finished")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running requests exceed max_num_seqs")

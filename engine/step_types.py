"""What one engine step schedules and returns, as plain values (torch-free): the scheduler's
`schedule() -> Batch` (its `ScheduledSeq`s), the runner's `SampledToken`s, the scheduler's
`update() -> list[StepOutput]`, and `SchedulerStats`. The contract around them is
engine/scheduler.py's docstring."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.request import Request


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_new_tokens: int  # run request.all_token_ids[start:start + num_new_tokens] this step
    sample: bool  # the last real token is in this step: its logits give the next token
    # Speculative decoding: tokens guessed to follow the request's last one, run after it (counted
    # in num_new_tokens); each of their positions is sampled too (engine/speculative.py).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step runs: the request's, then the draft."""
        end = self.start + self.num_new_tokens - len(self.draft_token_ids)
        return self.request.all_token_ids[self.start:end] + self.draft_token_ids

    @property
    def is_plain_decode(self) -> bool:
        """One token, sampled, no draft."""
        return self.sample and self.num_new_tokens == 1

    @property
    def block_table(self) -> list[int]:
        """The request's blocks (live list), covering every position < start + num_new_tokens."""
        return self.request.block_ids

    @property
    def block_tables(self) -> list[list[int]]:
        """The same, per KV group (engine/kv_groups.py; one group: `[block_table]`)."""
        return self.request.block_tables


@dataclass
class Batch:
    seqs: list[ScheduledSeq]  # decodes first, then prefill chunks
    num_tokens: int
    preempted_ids: list[str] = field(default_factory=list)  # preempted during this schedule() call
    # Swap preemption, for the runner to do before this step's forward:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (block id, swap slot): device -> host
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap slot, block id): host -> device
    # Host cache tier: evicted cached blocks saved (block id, host slot), host hits restored (slot, block id).
    kv_offload: list[tuple[int, int]] = field(default_factory=list)
    kv_reload: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.swap_out or self.swap_in or self.kv_offload or self.kv_reload)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Any]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    error: str | None = None
    # the error is the request's own (its constraint allows no token from here): servers answer
    # INVALID_ARGUMENT (an HTTP 400), not a failure of theirs
    invalid_request: bool = False


@dataclass
class SchedulerStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int  # includes evictable cached blocks
    kv_blocks_cached: int  # blocks registered in the prefix cache, in use or evictable
    prefix_cache_queries: int  # tokens looked up at admission (cumulative)
    prefix_cache_hits: int  # of which found cached (cumulative)
    num_preemptions: int  # recompute and swap (cumulative)
    prompt_tokens_computed: int  # positions < prompt length run through the model (cumulative)
    decode_tokens: int  # positions >= prompt length run through the model (cumulative)
    waiting_for_kv: int = 0
    sending_kv: int = 0  # prefill role: SENDING_KV requests (blocks pinned for a transfer)
    imported_tokens: int = 0  # decode role: prompt tokens received by KV transfer (cumulative)
    swapped: int = 0  # swap preemption: requests whose KV waits in host swap slots
    swap_slots_free: int = 0
    swapped_out_blocks: int = 0  # cumulative
    swapped_in_blocks: int = 0  # cumulative
    host_cache_slots: int = 0  # host tier of the prefix cache: blocks it can hold
    host_cache_used: int = 0
    host_cache_hits: int = 0  # prompt tokens restored from the host tier (cumulative; in prefix_cache_hits too)
    offloaded_blocks: int = 0  # cached blocks saved to the host tier on eviction (cumulative)
    reloaded_blocks: int = 0  # blocks copied back from the host tier (cumulative)
    # speculative decoding (cumulative): verified drafts, their tokens, and how many were accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    prefill_chunk_tokens: int = 0  # the per-step cap on a prompt's tokens (long_prefill_chunk_tokens; 0: none)
    # model step times by kind: {kind: (counts per bucket, sum of seconds)} (engine/step_times.py; cumulative)
    step_times: dict = field(default_factory=dict)
    # filled by AsyncEngine from its KV connector: failed transfers by reason (cumulative)
    kv_transfer_failures: dict = field(default_factory=dict)

"""One generation request as the scheduler sees it.

Lifecycle (status per line; the scheduler owns every transition):

    WAITING         queued; holds no blocks (or, after a failed KV import falling back to local
                    prefill, the blocks it already had)
    WAITING_FOR_KV  decode role: blocks allocated, a KV transfer is filling them
    RUNNING         admitted; `num_computed_tokens` catches up with `num_tokens` step by step
    SENDING_KV      prefill role: first token sampled; its blocks stay pinned while the KV
                    connector finishes sending them (engine/kv_connector.py)
    PREEMPTED       blocks taken back (recompute): requeued, keeps its output tokens so far
    FINISHED_*      stopped (EOS / stop token / prefill done), length, aborted or error

A request's tokens are `prompt_token_ids + output_token_ids`; the KV cache holds the first
`num_computed_tokens` of them. When `num_computed_tokens == num_tokens - 1` the next step is a
decode (one token, whose logits give the next token).

A resumed request (a generation migrated from a failed worker) starts with the output tokens
its client already has (`resumed_output_token_ids`): they are computed like the prompt, and count
as outputs for max_tokens, penalties, seeded draws (position = output index) and stop checks, so
the continuation is what the first worker would have produced.
"""
from __future__ import annotations

import enum
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from engine.block_hash import CacheSalt
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # engine/kv_hooks.py imports this module
    from engine.kv_hooks import KVDestination, KVImportOutcome
from engine.structured_output import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    SENDING_KV = "sending_kv"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})

# finish_reason -> the status it ends in ("prefill_done": a prefill-role request after its first token)
FINISH_STATUS = MappingProxyType({
    "stop": RequestStatus.FINISHED_STOPPED,
    "prefill_done": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
})


class Request:
    """Request state shared by the scheduler, the block manager and the model runner.

    `priority`: a LOWER value is MORE important (0 is the default); equal priorities are served
    first-come-first-served by `arrival_time`.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: set[int] | frozenset[int] = frozenset(), priority: int = 0,
                 arrival_time: float | None = None, cache_salt: str | CacheSalt | None = None,
                 resumed_output_token_ids: list[int] = (), grammar: GrammarState | None = None,
                 kv_destination: KVDestination | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # One entry per output token (the runner's SampledToken: token_id, logprob, top_logprobs).
        self.output_logprobs: list[Any] = []
        # With sampling_params.prompt_logprobs: entry p for prompt token p (a TokenLogprob; None for
        # the first token, which nothing predicts), appended by the model runner as prefill goes.
        self.prompt_logprobs: list[Any] | None = None if sampling_params.prompt_logprobs is None else [None]
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # When it first became RUNNING (time.time(); None until then; an imported request's is when
        # its KV arrived): the workers' traces split a prompt's queue from its prefill.
        self.first_scheduled_time: float | None = None
        self.cache_salt = cache_salt  # what keys its blocks in prefix caches (engine/block_hash.py)

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit tokens at first admission
        self.num_preemptions = 0
        # owned by the block manager: one table per KV group (engine/kv_groups.py), most caches one
        self.block_tables: list[list[int]] = [[]]
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, filled lazily
        # Blocks from this index on are never registered in the prefix cache: an import left out
        # their sliding-window layers' KV (engine/kv_connector.py). None: every block may be.
        self.max_cached_blocks: int | None = None
        self.swap_slots: list[int] = []  # swap preemption: host slots holding its computed KV
        self.finish_reason: str | None = None
        self.error: str | None = None
        # Disaggregation (engine/kv_connector.py): where a prefill-role request's KV goes, and how
        # a decode-role request got its KV (once known).
        self.kv_destination = kv_destination
        self.kv_import: KVImportOutcome | None = None
        self._all_token_ids = list(self.prompt_token_ids)
        # Structured output: follows every output token (engine/structured_output.py).
        self.grammar = grammar
        self.num_resumed_tokens = len(resumed_output_token_ids)
        for token_id in resumed_output_token_ids:
            self.append_output(int(token_id))
        if grammar is not None and grammar.rejected_token is not None:
            raise ValueError(f"resumed output token {grammar.rejected_token} does not match the request's "
                             f"{sampling_params.structured_output.kind} constraint")

    @property
    def block_ids(self) -> list[int]:
        """The blocks of the first KV group (live list): a uniform cache's only table."""
        return self.block_tables[0]

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. The returned list is live: do not mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still missing (their tokens must be computed)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output(self, token_id: int, logprob: Any = None) -> None:
        if self.grammar is not None:
            self.grammar.accept(token_id)  # a refusal is kept in grammar.rejected_token
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self._all_token_ids.append(token_id)

    def set_finished(self, reason: str, error: str | None = None) -> None:
        self.status = FINISH_STATUS[reason]
        self.finish_reason = reason
        self.error = error

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")

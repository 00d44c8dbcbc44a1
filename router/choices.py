"""`n` > 1, `best_of` and batched prompts: several sequences per request, each prompt computed once.

A request for `n` choices (or `best_of` candidates, of which the `n` with the highest cumulative
logprob are returned) becomes that many Generations (router/dispatch.py), one per sequence,
each admitted as a request of its own. The first starts alone: its prompt is prefilled (on a
prefill worker, or on its decode worker) and lands in its decode worker's prefix cache. The
others then start beside it (`Generation.start(beside=...)`): on the same decode worker,
prefilled there, where the prompt's full blocks are found in the cache and shared by reference
count; each computes only the prompt's last partial block again (at most block_size - 1 tokens;
a prompt of whole blocks, its last token). So the prompt crosses the KV transport once and the
prefill worker computes it once. If that worker cannot take them, they are routed as usual.

A completions request may also carry a batch of prompts (OpenAI's list of strings or of token-id
lists): each prompt is a group of its own, started as above, all groups at once; the response's
choice `i * n + j` is prompt i's choice j.

Sampling: choice i draws with `seed + i` when the request has a seed, so the n seeded samples
differ from each other and come out the same on every run; without a seed each draws from its
worker's generator. Each choice is its own request on the workers: it aborts, fails or migrates
alone.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Iterable, Sequence

from engine.block_hash import CacheSalt
from engine.sampling_params import SamplingParams
from router.dispatch import Dispatcher, Generation
from router.metrics import RequestTimer

_INT64 = 2**63


def candidate_params(params: SamplingParams, count: int, keep: int) -> list[SamplingParams]:
    """Each sequence's SamplingParams: seed + index (wrapped within int64), and the sampled
    token's logprob when only `keep` of `count` are kept (best_of ranks by it)."""
    if count == 1:
        return [params]
    if keep < count and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)
    if params.seed is None:
        return [params] * count
    return [dataclasses.replace(params, seed=(params.seed + i + _INT64) % (2 * _INT64) - _INT64)
            for i in range(count)]


class Choices:
    """The Generations of one request's choices: per prompt, its sequences (one without `n`,
    `best_of` or a batch of prompts)."""

    def __init__(self, dispatcher: Dispatcher, request_id: str,
                 prompts: Sequence[tuple[Sequence[int], Sequence[SamplingParams]]], timer: RequestTimer,
                 cache_salt: CacheSalt | None, priority: int) -> None:
        """Admit every sequence of every prompt, given as (token ids, each sequence's params); a
        429 or 503 for any of them withdraws those already admitted."""
        self.groups: list[list[Generation]] = []
        try:
            for prompt_index, (prompt_token_ids, params) in enumerate(prompts):
                group: list[Generation] = []
                self.groups.append(group)
                for index, sequence_params in enumerate(params):
                    sequence_id = request_id + (f"-p{prompt_index}" if len(prompts) > 1 else "") + (
                        f"-{index}" if len(params) > 1 else "")
                    first = prompt_index == 0 and index == 0
                    sequence_timer = timer if first else RequestTimer(timer.metrics, timer.arrival)
                    group.append(dispatcher.generation(sequence_id, prompt_token_ids, sequence_params,
                                                       sequence_timer, cache_salt, priority))
        except BaseException:
            for generation in self.generations:
                generation.withdraw()
            raise

    @property
    def generations(self) -> list[Generation]:
        return [generation for group in self.groups for generation in group]

    async def start(self) -> list[list[Any]]:
        """Start every prompt's group at once; per group, each sequence's first TokenChunk."""
        if len(self.groups) == 1:
            return [await self._start_group(self.groups[0])]
        return await _all(self._start_group(group) for group in self.groups)

    @staticmethod
    async def _start_group(group: list[Generation]) -> list[Any]:
        """Start a prompt's first sequence, then the rest beside it."""
        first, rest = group[0], group[1:]
        chunks = [await first.start()]
        if rest:
            chunks += await _all(g.start(beside=first.decode_address) for g in rest)
        return chunks

    def cancel(self) -> None:
        """The client went away: cancel every sequence's stream."""
        for generation in self.generations:
            generation.cancel()

    def close(self, finish_reason: str) -> None:
        for generation in self.generations:
            generation.close(finish_reason)


async def _all(coroutines: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run them concurrently; the first failure cancels the others (and is raised once they end)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

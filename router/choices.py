"""`n` > 1 and `best_of`: several sequences from one prompt, the prompt computed once.

A request for `n` choices (or `best_of` candidates, of which the `n` with the highest cumulative
logprob are returned) becomes that many Generations (router/dispatch.py), one per sequence,
each admitted as a request of its own. The first starts alone: its prompt is prefilled (on a
prefill worker, or on its decode worker) and lands in its decode worker's prefix cache. The
others then start beside it (`Generation.start(beside=...)`): on the same decode worker,
prefilled there, where the prompt's full blocks are found in the cache and shared by reference
count; each computes only the prompt's last partial block again (at most block_size - 1 tokens;
a prompt of whole blocks, its last token). So the prompt crosses the KV transport once and the
prefill worker computes it once. If that worker cannot take them, they are routed as usual.

Sampling: choice i draws with `seed + i` when the request has a seed, so the n seeded samples
differ from each other and come out the same on every run; without a seed each draws from its
worker's generator. Each choice is its own request on the workers: it aborts, fails or migrates
alone.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Sequence

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
    """The Generations of one request's choices (one without `n` / `best_of`)."""

    def __init__(self, dispatcher: Dispatcher, request_id: str, prompt_token_ids: Sequence[int],
                 params: Sequence[SamplingParams], timer: RequestTimer, cache_salt: str | None,
                 priority: int) -> None:
        """Admit every sequence (a 429 or 503 for any of them closes those already admitted)."""
        self.generations: list[Generation] = []
        try:
            for index, sequence_params in enumerate(params):
                sequence_id = request_id if len(params) == 1 else f"{request_id}-{index}"
                sequence_timer = timer if index == 0 else RequestTimer(timer.metrics, timer.arrival)
                self.generations.append(dispatcher.generation(sequence_id, prompt_token_ids, sequence_params,
                                                              sequence_timer, cache_salt, priority))
        except BaseException:
            self.close("abort")
            raise

    async def start(self) -> list[Any]:
        """Start the first sequence, then the rest beside it; each one's first TokenChunk."""
        first, rest = self.generations[0], self.generations[1:]
        chunks = [await first.start()]
        if rest:
            tasks = [asyncio.ensure_future(g.start(beside=first.decode_address)) for g in rest]
            try:
                chunks += await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return chunks

    def cancel(self) -> None:
        """The client went away: cancel every sequence's stream."""
        for generation in self.generations:
            generation.cancel()

    def close(self, finish_reason: str) -> None:
        for generation in self.generations:
            generation.close(finish_reason)

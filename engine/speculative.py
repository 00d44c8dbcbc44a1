"""Speculative decoding: draft tokens proposed before a step, verified by that step.

Contract:
- A `Proposer` guesses, for decoding requests, up to k tokens that follow each one's tokens so
  far. The scheduler (engine/scheduler.py) asks it once per step for the decodes it scheduled,
  each with its own limit (budget, `max_tokens`, context), and appends the drafts to those decodes
  (`ScheduledSeq.draft_token_ids`); it allocates their KV slots, or drops a draft it cannot.
- The model runner computes a decode's last token and its draft in one forward, each position a
  one-query row of paged attention over the positions before it (so each row's attention is the
  one an ordinary decode at that position computes), and samples every row as the ordinary
  decode at that output position would: penalties, `min_tokens` and the seeded draw see the
  draft tokens before it as outputs. `accepted_length` keeps the draft's longest prefix equal to
  what was sampled, plus one: the first sampled token that differs, or the one after the whole
  draft. Each step of a request therefore yields 1 to k + 1 tokens.
- That is rejection sampling for a draft proposed with certainty (n-gram lookup): the draft token
  d is kept with probability p(d), and on a rejection the token is drawn from p without d,
  renormalized, by the same uniform number that drew the rejection. So the output is exactly what
  decoding without speculation gives: the same tokens for greedy and for seeded requests (up to the
  rounding of a larger batch's matmuls), the same distribution otherwise. A draft model (a
  distribution q per token) would need the general rule, min(1, p/q) and the residual max(0, p - q):
  it would return its q with its tokens.
- Rejected tokens' KV slots are never counted as computed; the next step writes over them. Blocks
  that held only rejected draft positions go back to the pool (`BlockManager.free_tail`).
- Who speculates: decodes on decode and colocated workers whose request allows it
  (`SamplingParams.speculative`) and has no structured output (its grammar would have to follow
  every draft token and roll back).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from engine.config import SpeculativeConfig
    from engine.request import Request


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        """For each request, at most `limits[i]` tokens guessed to follow `all_token_ids`
        (possibly none)."""


class NgramProposer:
    """Prompt lookup: find the longest suffix of the request's tokens (prompt and output, from
    `max_n` down to `min_n` tokens) that occurred before, take its most recent earlier
    occurrence, and propose the tokens that followed it there. Costs no model: it pays off where
    outputs copy their context (code edits, JSON echoes, quoting, summaries with names)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        return [self.lookup(r.all_token_ids, k) if k > 0 else [] for r, k in zip(requests, limits)]

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        tokens = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        length = len(tokens)
        # Where the last token occurred before (an occurrence at the end has no continuation),
        # then which of those the previous tokens extend, one suffix length at a time.
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
        matching = np.ones(ends.size, dtype=bool)
        best = int(ends[-1]) if ends.size and self.min_n <= 1 else None
        for back in range(1, min(self.max_n, length - 1)):
            matching &= (ends >= back) & (tokens[np.maximum(ends - back, 0)] == tokens[length - 1 - back])
            hits = np.flatnonzero(matching)
            if not hits.size:
                break
            if back + 1 >= self.min_n:
                best = int(ends[hits[-1]])  # the most recent occurrence of the longest suffix so far
        if best is None:
            return []
        return tokens[best + 1:best + 1 + k].tolist()


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.speculative_method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"unknown speculative method {config.speculative_method!r}")


def accepted_length(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many of `sampled` (one token per verified row: after the decode's last token, then
    after each draft token) the step yields: the draft's prefix that matches them, plus one."""
    for index, token in enumerate(draft):
        if sampled[index] != token:
            return index + 1
    return len(draft) + 1

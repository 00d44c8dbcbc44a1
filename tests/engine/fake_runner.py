"""A model runner without a model, for scheduler lifecycle tests.

`FakeModelRunner` simulates a paged KV cache: running a seq writes (token id, position) into the
slots its block table names, and every seq then reads its whole context back through its block
table, as attention would. A wrong block table, a prefix-cache hit on wrong content or a block
reused while still needed is an AssertionError naming the request. The next token is a
deterministic function of the context read from the cache, so `reference_generate` gives what an
unconstrained run must produce. Swap preemption's copies move slot contents to and from host
swap slots before the step runs, as the real runner does, and so do the host cache tier's
offloads (first) and reloads (last). A decode with a draft (speculative decoding) writes its
draft tokens too, samples every position and keeps what `engine.speculative.accepted_length`
accepts, as the real runner does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from engine.scheduler import Scheduler
from engine.step_types import Batch, SampledToken, StepOutput
from engine.speculative import accepted_length

VOCAB_SIZE = 1000


def next_token(context: list[int], vocab_size: int = VOCAB_SIZE) -> int:
    state = 17
    for token in context:
        state = (state * 1_000_003 + token + 1) % 2_147_483_647
    return state % vocab_size


def reference_generate(prompt: list[int], num_tokens: int, vocab_size: int = VOCAB_SIZE) -> list[int]:
    """What greedy decoding of `num_tokens` tokens gives, with no stop."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens, vocab_size))
    return tokens[len(prompt):]


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = VOCAB_SIZE) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.slots: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.swap_slots: dict[int, list[tuple[int, int] | None]] = {}
        self.host_slots: dict[int, list[tuple[int, int] | None]] = {}
        self.batches: list[Batch] = []
        self.broken: str | None = None

    def close(self) -> None:
        pass

    def _slot(self, block_table: list[int], position: int) -> tuple[int, int]:
        return block_table[position // self.block_size], position % self.block_size

    def write(self, block_table: list[int], tokens: list[int], start: int) -> None:
        for offset, token in enumerate(tokens):
            block, slot = self._slot(block_table, start + offset)
            self.slots[block][slot] = (token, start + offset)

    def read_context(self, request: Request, end: int, draft: list[int] = ()) -> list[int]:
        """The tokens at positions < end, read through the block table (positions past the
        request's tokens hold `draft`)."""
        expected = request.all_token_ids + list(draft)
        context = []
        for position in range(end):
            block, slot = self._slot(request.block_ids, position)
            entry = self.slots[block][slot]
            if entry is None or entry[1] != position or entry[0] != expected[position]:
                raise AssertionError(f"request {request.request_id}: KV at position {position} (block {block}) "
                                     f"is {entry}, expected token {expected[position]}")
            context.append(entry[0])
        return context

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        for block, slot in pairs:
            self.host_slots[slot] = list(self.slots[block])

    def reload(self, pairs: list[tuple[int, int]]) -> None:
        for slot, block in pairs:
            self.slots[block] = list(self.host_slots[slot])

    def import_kv(self, request: Request, blocks_to_fill: list[tuple[int, int]]) -> None:
        """What a successful KV transfer does: write the prompt's tokens into the given blocks."""
        for index, block_id in blocks_to_fill:
            start = index * self.block_size
            tokens = request.prompt_token_ids[start:start + self.block_size]
            table = [0] * index + [block_id]
            self.write(table, tokens, start)

    def execute(self, batch: Batch, on_layer_stored=None) -> dict[str, list[SampledToken]]:
        self.batches.append(batch)
        assert not (batch.swap_out and batch.swap_in), "swap-outs and swap-ins in one step"
        self.offload(batch.kv_offload)
        for block, slot in batch.swap_out:
            self.swap_slots[slot] = list(self.slots[block])  # the block keeps its content until reused
        for slot, block in batch.swap_in:
            self.slots[block] = self.swap_slots.pop(slot)
        self.reload(batch.kv_reload)
        ids = [seq.request.request_id for seq in batch.seqs]
        assert len(ids) == len(set(ids)), f"a request is scheduled twice: {ids}"
        assert batch.num_tokens == sum(seq.num_new_tokens for seq in batch.seqs)
        for seq in batch.seqs:
            request, end = seq.request, seq.start + seq.num_new_tokens
            draft = seq.draft_token_ids
            real_end = end - len(draft)
            assert seq.start == request.num_computed_tokens and seq.num_new_tokens >= 1
            assert real_end <= request.num_tokens and seq.sample == (real_end == request.num_tokens)
            assert not draft or real_end - seq.start == 1, "a draft follows anything but a decode"
            assert len(seq.block_table) * self.block_size >= end, f"{request.request_id}: block table too short"
            assert seq.token_ids == request.all_token_ids[seq.start:real_end] + draft
            self.write(seq.block_table, seq.token_ids, seq.start)
        sampled = {}
        for seq in batch.seqs:
            draft = seq.draft_token_ids
            context = self.read_context(seq.request, seq.start + seq.num_new_tokens, draft)
            if seq.sample:
                real_end = len(context) - len(draft)
                tokens = [next_token(context[:real_end + j], self.vocab_size) for j in range(len(draft) + 1)]
                keep = accepted_length(draft, tokens)
                sampled[seq.request.request_id] = [SampledToken(t, logprob=-1.0) for t in tokens[:keep]]
        return sampled


@dataclass
class FakeConnector:
    """The scheduler side of a KV connector (engine/kv_hooks.py) that records what it was told;
    `pin`: whether a finished prefill-role request's blocks wait for a send."""
    finished: list[tuple[str, list[int]]] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    pin: bool = True

    def request_finished(self, request: Request) -> bool:
        self.finished.append((request.request_id, list(request.block_ids)))
        return self.pin

    def request_ended(self, request: Request) -> None:
        self.ended.append(request.request_id)


def check_batch(batch: Batch, scheduler: Scheduler) -> None:
    """Per-step invariants: budget, running cap, decodes before prefill chunks."""
    assert batch.num_tokens <= scheduler.config.max_num_batched_tokens
    assert len(batch.seqs) <= scheduler.config.max_num_seqs
    assert scheduler.num_running <= scheduler.config.max_num_seqs
    kinds = [seq.is_plain_decode for seq in batch.seqs]
    assert kinds == sorted(kinds, reverse=True), "a prefill chunk is scheduled before a decode"


def step(scheduler: Scheduler, runner: FakeModelRunner) -> tuple[Batch, list[StepOutput]]:
    batch = scheduler.schedule()
    check_batch(batch, scheduler)
    outputs = scheduler.update(batch, runner.execute(batch))
    scheduler.check_integrity()
    return batch, outputs


def run_until_done(scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 10_000) -> dict[str, StepOutput]:
    """Step until nothing is unfinished; returns each request's final output, with all its tokens."""
    finals: dict[str, StepOutput] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finals
        batch, outputs = step(scheduler, runner)
        assert not batch.is_empty, "unfinished requests but nothing scheduled"
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = StepOutput(out.request_id, tokens[out.request_id], [], True,
                                                    out.finish_reason, out.num_cached_tokens, out.error)
    raise AssertionError(f"not done after {max_steps} steps")

"""Decode steps replayed as CUDA graphs.

Why: a small model's decode step is a thousand tiny kernels, and launching them one by one from
Python costs far more than running them (SmolLM2-135M on an H200: ~20 ms per step eager, against
a memory-bandwidth bound of ~0.1 ms). A graph launches them all with one call.

Contract. A step whose every sequence adds exactly one token (a decode-only batch) of `n`
sequences, the longest with context `L`, runs as the graph of (the smallest captured batch size
`B >= n`: 1, 2, 4, 8, then multiples of 16 up to `max_batch`; the smallest context bucket
`C >= L`: powers of two from 2048 up to `max_model_len`). Rows `n..B` are padding: slot -1
(nothing stored), context length 0 (no KV read); their logits are computed and never looked at.
Attention is planned for contexts up to `C` (the number of split-KV ranges, which is baked into
the graph, is the one eager mode would pick for `B` sequences of length `C`; the decode kernel
skips the ranges a shorter sequence does not reach), so one graph serves every batch of its
bucket without giving long-context models a single split per sequence.

The graphs' inputs are fixed device buffers that each step overwrites with two asynchronous
copies from pinned host buffers (token ids, positions, slots and context lengths in one; the
block tables, `[n, longest table]`, in the other); the next step waits for them before it
rewrites the host side. Every graph writes its logits into one shared `[max_batch, vocab]`
buffer, a view of which is returned (valid until the next step). Graphs of the smallest context
bucket are captured when the engine starts (`capture_all`, largest batch first: a second or two,
so no request pays for them); larger buckets are captured the first time a batch needs them.
Each capture follows one eager warm-up run, which compiles the Triton kernels outside the
capture. All graphs share one memory pool, which is safe because replays never overlap.

Steps with a multi-token chunk (prefill) run eagerly. `capture=False` runs the same padded
static-buffer path without graphs, which lets CPU tests check it.
"""
from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata

MIN_CONTEXT_BUCKET = 2048


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


def context_buckets(max_model_len: int) -> list[int]:
    buckets, bucket = [], MIN_CONTEXT_BUCKET
    while bucket < max_model_len:
        buckets.append(bucket)
        bucket *= 2
    return buckets + [max_model_len]


class DecodeGraphs:
    def __init__(self, model, kv_layers: list[torch.Tensor], backend, block_size: int, max_model_len: int,
                 max_batch: int, vocab_size: int, device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.backend = backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.contexts = context_buckets(max_model_len)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.capture = capture
        pinned = device.type == "cuda"
        # Pinned host staging (so the copies are asynchronous) and the device buffers the graphs
        # read. Rows of `_host`: token ids, positions, slots, context lengths. `_host_tables` is
        # filled as a contiguous [n, width] block at its start.
        self._host = torch.zeros(4, self.max_batch, dtype=torch.int64, pin_memory=pinned)
        self._host_tables = torch.zeros(self.max_batch * self.max_blocks, dtype=torch.int32, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self._host_tables_np = self._host_tables.numpy()
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._inputs = torch.zeros(4, self.max_batch, dtype=torch.int64, device=device)
        self._seq_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self._tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int32, device=device)
        self._query_start = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self._rows = torch.arange(self.max_batch, dtype=torch.int64, device=device)
        self._logits = torch.zeros(self.max_batch, vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self._pool = None
        self.num_replays = 0

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every batch size of the smallest context bucket, on padding rows alone."""
        self._stage_padding(0, self.max_batch)
        self._inputs.copy_(self._host)
        self._seq_lens.zero_()
        for size in reversed(self.sizes):
            self._graphs[(size, self.contexts[0])] = self._capture(size, self.contexts[0])

    def bucket(self, num_seqs: int, max_seq_len: int) -> tuple[int, int]:
        return (next(s for s in self.sizes if s >= num_seqs), next(c for c in self.contexts if c >= max_seq_len))

    def fits(self, query_lens: list[int], seq_lens: list[int]) -> bool:
        """Whether this batch can run as a graph: decode-only, at most `max_batch` sequences, every
        context within `max_model_len`."""
        return (0 < len(query_lens) <= self.max_batch and all(q == 1 for q in query_lens)
                and max(seq_lens) <= self.max_model_len)

    def _stage_padding(self, start: int, end: int) -> None:
        host = self._host_np
        host[0:2, start:end] = 0
        host[2, start:end] = -1
        host[3, start:end] = 0

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """fp32 logits `[n, vocab]` for the n single-token sequences (a view that the next call
        overwrites)."""
        n = len(input_ids)
        key = self.bucket(n, max(seq_lens))
        size = key[0]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the host buffers
        host = self._host_np
        host[0, :n], host[1, :n], host[2, :n], host[3, :n] = input_ids, positions, slots, seq_lens
        self._stage_padding(n, size)
        width = max(len(table) for table in block_tables)
        tables = self._host_tables_np[:n * width].reshape(n, width)
        for row, table in enumerate(block_tables):
            tables[row, :len(table)] = table
        self._inputs.copy_(self._host, non_blocking=True)
        self._tables[:n, :width].copy_(self._host_tables[:n * width].view(n, width), non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._seq_lens[:size].copy_(self._inputs[3, :size])
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        graph = self._graphs[key]
        if graph is None:
            self._logits[:size].copy_(self._forward(*key))
        else:
            graph.replay()
        self.num_replays += 1
        return self._logits[:n]

    def _meta(self, size: int, context: int) -> AttentionMetadata:
        # Host lengths say "decode-only, contexts up to `context`": the plan every batch of this
        # bucket can share (the kernels read the true lengths from `seq_lens`).
        return AttentionMetadata(
            slot_mapping=self._inputs[2, :size], query_start_loc=self._query_start[:size + 1],
            seq_lens=self._seq_lens[:size], block_tables=self._tables[:size], max_query_len=1,
            max_seq_len=context, query_lens_cpu=[1] * size, seq_lens_cpu=[context] * size)

    def _forward(self, size: int, context: int) -> torch.Tensor:
        return self.model(self._inputs[0, :size], self._inputs[1, :size], self.kv_layers, self._meta(size, context),
                          self.backend, self._rows[:size])

    def _capture(self, size: int, context: int):
        if not self.capture:
            return None
        self._forward(size, context)  # warm-up: compiles the kernels; capture must not
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._logits[:size].copy_(self._forward(size, context))
        self._pool = graph.pool()
        return graph

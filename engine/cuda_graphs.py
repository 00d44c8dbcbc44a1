"""Decode steps replayed as CUDA graphs.

Why: a small model's decode step is a thousand tiny kernels, and launching them one by one from
Python costs far more than running them (SmolLM2-135M on an H200: ~20 ms per step eager, against
a memory-bandwidth bound of ~0.1 ms). A graph launches them all with one call.

Contract. A step whose every sequence adds exactly one token (a decode-only batch) of `n`
sequences runs as the graph of the smallest captured batch size `B >= n` (1, 2, 4, 8, then
multiples of 16 up to `max_batch`). Rows `n..B` are padding: slot -1 (nothing stored), context
length 0 (no KV read); their logits are computed and never looked at. The graph's inputs are
fixed device buffers that each step overwrites with two host-to-device copies (token ids,
positions, slots and context lengths in one; the block tables in the other). Attention is planned
for the longest context the engine allows (`max_model_len`), so one graph is valid for every
batch of its size: the Triton decode kernel skips the context splits a sequence does not reach.
Every size is captured when the engine starts (`capture_all`, largest first, a second or two, so
no request pays for it), each after one eager warm-up run on padding rows alone (which compiles
the Triton kernels outside the capture). All graphs share one memory pool, which is safe because
replays never overlap and each replay's logits are consumed before the next one: the sampler
reads them back to the host, which also orders the pinned staging buffers' reuse.

Steps with a multi-token chunk (prefill) run eagerly. `capture=False` runs the same padded
static-buffer path without graphs, which lets CPU tests check it.
"""
from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model, kv_layers: list[torch.Tensor], backend, block_size: int, max_model_len: int,
                 max_batch: int, device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.backend = backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.capture = capture
        pinned = device.type == "cuda"
        # Host staging (pinned on CUDA, so the copies are asynchronous) and the device buffers the
        # graphs read. Rows of `_host`: token ids, positions, slots, context lengths.
        self._host = torch.zeros(4, self.max_batch, dtype=torch.int64, pin_memory=pinned)
        self._host_tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int32, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self._host_tables_np = self._host_tables.numpy()
        self._inputs = torch.zeros(4, self.max_batch, dtype=torch.int64, device=device)
        self._seq_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self._tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int32, device=device)
        self._query_start = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self._rows = torch.arange(self.max_batch, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = None
        self.num_replays = 0

    @torch.inference_mode()
    def capture_all(self) -> None:
        self._host_np[0:2] = 0
        self._host_np[2] = -1
        self._host_np[3] = 0
        self._inputs.copy_(self._host)
        self._seq_lens.zero_()
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture(size)

    def bucket(self, num_seqs: int) -> int | None:
        return next((size for size in self.sizes if size >= num_seqs), None)

    def fits(self, query_lens: list[int], seq_lens: list[int]) -> bool:
        """Whether this batch can run as a graph: decode-only, at most `max_batch` sequences, every
        context within `max_model_len`."""
        return (0 < len(query_lens) <= self.max_batch and all(q == 1 for q in query_lens)
                and max(seq_lens) <= self.max_model_len)

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """fp32 logits `[n, vocab]` for the n single-token sequences (a view that the next call
        overwrites)."""
        n = len(input_ids)
        size = self.bucket(n)
        host = self._host_np
        host[0, :n], host[1, :n], host[2, :n], host[3, :n] = input_ids, positions, slots, seq_lens
        host[0:2, n:size] = 0
        host[2, n:size] = -1
        host[3, n:size] = 0
        tables = self._host_tables_np
        for row, table in enumerate(block_tables):
            tables[row, :len(table)] = table
        self._inputs[:, :size].copy_(self._host[:, :size], non_blocking=True)
        self._seq_lens[:size].copy_(self._inputs[3, :size])
        self._tables[:n].copy_(self._host_tables[:n], non_blocking=True)
        if size not in self._graphs:
            self._graphs[size] = self._capture(size)
        graph, logits = self._graphs[size]
        if graph is None:
            logits = self._forward(size)
        else:
            graph.replay()
        self.num_replays += 1
        return logits[:n]

    def _meta(self, size: int) -> AttentionMetadata:
        # Host lengths say "decode-only, contexts up to max_model_len": the plan every batch of
        # this size can share (the kernels read the true lengths from `seq_lens`).
        return AttentionMetadata(
            slot_mapping=self._inputs[2, :size], query_start_loc=self._query_start[:size + 1],
            seq_lens=self._seq_lens[:size], block_tables=self._tables[:size], max_query_len=1,
            max_seq_len=self.max_model_len, query_lens_cpu=[1] * size, seq_lens_cpu=[self.max_model_len] * size)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self._inputs[0, :size], self._inputs[1, :size], self.kv_layers, self._meta(size),
                          self.backend, self._rows[:size])

    def _capture(self, size: int):
        if not self.capture:
            return None, None
        self._forward(size)  # warm-up: compiles the kernels; capture must not
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(size)
        self._pool = graph.pool()
        return graph, logits

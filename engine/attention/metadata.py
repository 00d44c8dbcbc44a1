"""What one forward pass tells attention about a flattened batch of sequences.

Tokens of all sequences are concatenated: `[num_tokens]`. Sequence `s` owns query tokens
`query_start_loc[s] : query_start_loc[s+1]`; its context is `seq_lens[s]` tokens, of which the
last `query_len = query_start_loc[s+1] - query_start_loc[s]` are the new ones. Query token `i` of
sequence `s` sits at position `seq_lens[s] - query_len + i` and attends causally to context
positions `0 ..= that position`, all of which are in the paged cache once the new keys are stored.

KV cache layout (one tensor per layer): `[num_blocks, 2, block_size, num_kv_heads, head_dim]`,
index 0 = K, 1 = V. A (layer, block) pair is one contiguous chunk, which is what kvtransfer moves.
Slot of a token = `block_id * block_size + offset_in_block`; a slot of -1 means "do not store".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = skip
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends can plan without device syncs.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        """The same metadata with its tensors on `device` (the host copies kept)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str) -> "AttentionMetadata":
        """Build from host lists: slot mapping covers every new token of every sequence."""
        assert len(query_lens) == len(seq_lens) == len(block_tables)
        slots: list[int] = []
        for q, n, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(n - q, n):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )


# ---- sub-batches: some sequences of a batch, for a kernel that takes only them

def _positions(indices: list[int], device: torch.device) -> slice | torch.Tensor:
    """`indices` (ascending) as a slice when consecutive, else an index tensor on `device`."""
    if indices[-1] - indices[0] + 1 == len(indices):
        return slice(indices[0], indices[-1] + 1)
    return torch.tensor(indices, dtype=torch.int64, device=device)


def take_rows(t: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def put_rows(out: torch.Tensor, rows: slice | torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = values
    else:
        out.index_copy_(0, rows, values)


def sub_batch(meta: AttentionMetadata, query_lens: list[int], seq_lens: list[int],
              seqs: list[int]) -> tuple[slice | torch.Tensor, AttentionMetadata]:
    """The query rows of sequences `seqs` (ascending, host-side) and the metadata of a batch of just
    them. Consecutive sequences (the scheduler places multi-token chunks after the decodes) give
    slices and views of `meta`'s tensors; others index tensors copied to the device (no sync)."""
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    device = meta.seq_lens.device
    rows = _positions([t for s in seqs for t in range(starts[s], starts[s + 1])], device)
    chosen = _positions(seqs, device)
    lens = [query_lens[s] for s in seqs]
    if isinstance(chosen, slice):
        query_start_loc = meta.query_start_loc[chosen.start:chosen.stop + 1]
        query_start_loc = query_start_loc - query_start_loc[:1]
    else:
        query_start_loc = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(meta.query_start_loc)
    return rows, AttentionMetadata(
        slot_mapping=take_rows(meta.slot_mapping, rows), query_start_loc=query_start_loc,
        seq_lens=take_rows(meta.seq_lens, chosen), block_tables=take_rows(meta.block_tables, chosen),
        max_query_len=max(lens), max_seq_len=max(seq_lens[s] for s in seqs),
        query_lens_cpu=lens, seq_lens_cpu=[seq_lens[s] for s in seqs])

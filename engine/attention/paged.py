"""The paged KV cache read and written in plain torch: `store_kv` (new keys and values into their
slots), `gather_kv` (whole blocks back) and `sequence_kv` (one sequence's context). Every backend
and latent attention (engine/attention/latent.py) build on these; the layout is engine/kv_cache.py's.
"""
from __future__ import annotations

import torch


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write `key[t]`/`value[t]` into `kv_cache` at slot `slot_mapping[t]`; slot -1 is skipped.

    key, value: `[num_tokens, num_kv_heads, head_dim]`; kv_cache:
    `[num_blocks, 2, block_size, num_kv_heads, head_dim]`; slot = block_id * block_size + offset.
    """
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if key.shape[0] == 0:
        return
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    if bool((slots < 0).any()):
        valid = slots >= 0
        slots = slots[valid]
        key, value = key[valid], value[valid]
    row_width = num_kv_heads * head_dim
    keys = key.reshape(-1, row_width).to(kv_cache.dtype)
    values = value.reshape(-1, row_width).to(kv_cache.dtype)
    # Row of slot s in the cache seen as [num_blocks * 2 * block_size, row]: K then V per block,
    # i.e. block * 2 * block_size + offset = slot + block * block_size.
    if block_size & (block_size - 1) == 0:
        key_rows = slots + (slots & ~(block_size - 1))
    else:
        key_rows = slots + (slots // block_size) * block_size
    if kv_cache.is_contiguous():
        rows = kv_cache.view(num_blocks * 2 * block_size, row_width)
        rows.index_copy_(0, key_rows, keys)
        rows.index_copy_(0, key_rows + block_size, values)
    else:
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[blocks, 0, offsets] = keys.view(-1, num_kv_heads, head_dim)
        kv_cache[blocks, 1, offsets] = values.view(-1, num_kv_heads, head_dim)


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks `block_ids` (any shape `[*B]`) as `[*B * block_size, heads, dim]`.

    The leading dims of `block_ids` are kept except the last, which is merged with the block
    size: `[S, n]` block ids give `[S, n * block_size, num_kv_heads, head_dim]`.
    """
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat_ids = block_ids.reshape(-1).to(torch.int64)
    shape = (*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_dim)
    keys = kv_cache[:, 0].index_select(0, flat_ids).view(shape)
    values = kv_cache[:, 1].index_select(0, flat_ids).view(shape)
    return keys, values


def sequence_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first `seq_len` positions, `[seq_len, heads, dim]` each."""
    block_size = kv_cache.shape[2]
    keys, values = gather_kv(kv_cache, block_table[: -(-seq_len // block_size)])
    return keys[:seq_len], values[:seq_len]

"""Attention with Triton kernels: the CUDA default; runs on CPU under `TRITON_INTERPRET=1`.

Per forward: one store-KV launch (8-bit KV: after a sort of the slots, shared by the layers),
then one decode launch for the single-token sequences (split-KV, plus a merge launch when split)
and one prefill launch for the multi-token chunks. A mixed batch gets both; each kernel skips
the other's sequences on the device, so planning needs only host-side lengths and no device sync.
Every `AttentionVariant` (sliding window, soft-cap, sinks; alone or together, over any cache
dtype or 8-bit format) runs in those same kernels, as constexpr-switched features.
Latent attention (DeepSeek's MLA, `latent_attention`): its decodes in one launch of
`triton_latent.py`'s kernel (split-KV, merged by the decode's combine kernel), its multi-token
chunks in latent.py's torch reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import check_shapes, host_lengths
from engine.attention.latent import latent_attention
from engine.attention.metadata import AttentionMetadata, put_rows, sub_batch, take_rows
from engine.attention import triton_kernels, triton_latent, triton_store
from engine.attention.variant import AttentionVariant, is_plain
from engine.kv_quant import KVQuantFormat


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass
class TritonAttentionConfig:
    """Tile sizes and split-KV policy of the Triton backend."""

    decode_tile_n: int = 64  # cached tokens per inner-loop step of the decode kernel
    prefill_block_m: int = 64  # rows (query tokens x heads of a group) per prefill program
    prefill_tile_n: int = 64  # cached tokens per inner-loop step of the prefill kernel
    # Splits of each decode sequence's context; None: enough to fill the GPU (1 on CPU).
    decode_num_splits: int | None = None
    max_decode_splits: int = 32
    min_tokens_per_split: int = 256
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("decode_tile_n", "prefill_block_m", "prefill_tile_n"):
            value = getattr(self, name)
            if not _is_pow2(value) or value < 16:
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.decode_num_splits is not None and not _is_pow2(self.decode_num_splits):
            raise ValueError(f"decode_num_splits must be a power of two, got {self.decode_num_splits}")
        if not _is_pow2(self.max_decode_splits):
            raise ValueError(f"max_decode_splits must be a power of two, got {self.max_decode_splits}")
        if self.min_tokens_per_split < 1:
            raise ValueError(f"min_tokens_per_split must be >= 1, got {self.min_tokens_per_split}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")


class TritonAttentionBackend:
    """`AttentionBackend` on Triton kernels (see `triton_kernels.py`).

    With an 8-bit KV cache (`kv_format`, engine/kv_quant.py) each layer's cache is that format's
    `[num_blocks, block_bytes]` bytes, which the attention kernels read in place, applying the
    scales per token. Its store is a Triton kernel that writes exactly the bytes
    `KVQuantFormat.store` writes (tests/engine/test_kv_quant_triton.py) rather than that method
    itself: the method syncs the device (`bool(...)`, `torch.unique`), which would cost a sync per
    layer and cannot be captured in the CUDA graphs that replay this backend's decode steps
    (engine/cuda_graphs.py). The kernel needs the slots sorted: once per slot-mapping tensor, so a
    forward pass's layers share the sort (a slot mapping must not change in place between calls)."""

    name = "triton"

    def __init__(self, config: TritonAttentionConfig | None = None, kv_format: KVQuantFormat | None = None) -> None:
        self.config = config or TritonAttentionConfig()
        self.kv_format = kv_format
        self._sm_counts: dict[int, int] = {}
        # 8-bit: `sort_slots` of the slot mapping last stored, shared by a forward pass's layers
        self._sorted_for: torch.Tensor | None = None
        self._sorted_slots: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                variant: AttentionVariant | None = None) -> torch.Tensor:
        variant = None if is_plain(variant) else variant
        triton_kernels.check_variant(variant, query.shape[1])  # before the store changes the cache
        fmt = self.kv_format
        check_shapes(query, key, value, kv_cache if fmt is None else fmt.split(kv_cache)[0], meta)
        self._check_runnable(query)
        block_size = kv_cache.shape[2] if fmt is None else fmt.block_size
        if not _is_pow2(block_size):
            raise ValueError(f"the triton backend needs a power-of-two block_size, got {block_size}")
        if fmt is None and kv_cache.dtype != query.dtype:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} differs from query dtype {query.dtype}")
        self.store_kv(key, value, kv_cache, meta.slot_mapping)

        query_lens, seq_lens = host_lengths(meta)
        num_tokens = query.shape[0]
        batch_tokens = sum(query_lens)
        if batch_tokens > num_tokens:
            raise ValueError(f"metadata covers {batch_tokens} query tokens but query has {num_tokens}")
        out = query.new_zeros(query.shape) if batch_tokens < num_tokens else torch.empty_like(query)
        if batch_tokens == 0:
            return out
        query = query if query.stride(-1) == 1 else query.contiguous()
        decode_seq_lens = [n for q, n in zip(query_lens, seq_lens) if q == 1]
        max_query_len = max(query_lens)
        cfg = self.config
        if decode_seq_lens:
            max_decode_len = max(decode_seq_lens)
            span = triton_kernels.decode_context_span(
                max_decode_len, None if variant is None else variant.sliding_window, cfg.decode_tile_n)
            triton_kernels.paged_decode_attention(
                out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                max_seq_len=max_decode_len,
                num_splits=self._decode_splits(query, len(decode_seq_lens), key.shape[1], span),
                tile_n=cfg.decode_tile_n, num_warps=cfg.num_warps, kv_format=fmt, variant=variant)
        if max_query_len > 1:
            triton_kernels.paged_prefill_attention(
                out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                max_query_len=max_query_len, block_m=cfg.prefill_block_m, tile_n=cfg.prefill_tile_n,
                skip_single_token=bool(decode_seq_lens), num_warps=cfg.num_warps, kv_format=fmt,
                variant=variant)
        return out

    def latent_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, value_dim: int) -> torch.Tensor:
        """Decodes (single-token sequences) in one launch of `triton_latent`'s kernel (plus its
        merge when split), which skips the other sequences on the device and reads an 8-bit
        cache in place; multi-token chunks in latent.py's torch reference, over the sub-batch of
        just them (slices of the batch's tensors when they are consecutive, as the scheduler
        places them; 8-bit: over their blocks dequantized). Planning reads only host-side
        lengths; nothing syncs the device."""
        fmt = self.kv_format
        triton_latent.check_latent_inputs(query, kv_cache, value_dim, fmt)
        self._check_runnable(query)
        query_lens, seq_lens = host_lengths(meta)
        num_tokens, num_heads, _ = query.shape
        batch_tokens = sum(query_lens)
        if batch_tokens > num_tokens:
            raise ValueError(f"metadata covers {batch_tokens} query tokens but query has {num_tokens}")
        shape = (num_tokens, num_heads, value_dim)
        out = query.new_zeros(shape) if batch_tokens < num_tokens else query.new_empty(shape)
        decodes = [n for q, n in zip(query_lens, seq_lens) if q == 1]
        if decodes:
            max_len = max(decodes)
            splits = self._decode_splits(query, len(decodes), triton_latent.head_blocks(num_heads), max_len)
            triton_latent.latent_decode_attention(out, query, kv_cache, meta.block_tables, meta.seq_lens,
                                                  meta.query_start_loc, scale, value_dim, max_seq_len=max_len,
                                                  num_splits=splits, kv_format=fmt)
        chunks = [s for s, q in enumerate(query_lens) if q > 1]
        if chunks:
            rows, chunk_meta = sub_batch(meta, query_lens, seq_lens, chunks)
            cache = kv_cache
            if fmt is not None:  # the torch reference over the chunks' blocks, dequantized
                cache, chunk_meta = triton_latent.dequantized_batch(kv_cache, fmt, chunk_meta, query.dtype)
            attended = latent_attention(take_rows(query, rows), cache, chunk_meta, scale, value_dim)
            put_rows(out, rows, attended)
        return out

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if self.kv_format is None:
            return triton_store.store_kv_triton(key, value, kv_cache, slot_mapping)
        if self._sorted_for is not slot_mapping:
            self._sorted_for, self._sorted_slots = slot_mapping, triton_store.sort_slots(slot_mapping)
        triton_store.store_kv_8bit_triton(key, value, kv_cache, slot_mapping, self.kv_format, self._sorted_slots)

    def _decode_splits(self, query: torch.Tensor, num_decodes: int, num_kv_heads: int,
                       max_seq_len: int) -> int:
        """`max_seq_len`: the most cached tokens a decode reads (a sliding window's, if shorter)."""
        cfg = self.config
        if cfg.decode_num_splits is not None:
            return cfg.decode_num_splits
        if query.device.type != "cuda":
            return 1
        index = query.device.index if query.device.index is not None else torch.cuda.current_device()
        if index not in self._sm_counts:
            self._sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
        wanted = -(-2 * self._sm_counts[index] // (num_decodes * num_kv_heads))
        by_length = max(1, max_seq_len // cfg.min_tokens_per_split)
        splits = max(1, min(wanted, by_length, cfg.max_decode_splits))
        return 1 << (splits.bit_length() - 1)

    @staticmethod
    def _check_runnable(query: torch.Tensor) -> None:
        if query.device.type == "cuda":
            if triton_kernels.kernels_interpreted():
                raise ValueError("the triton kernels were defined under TRITON_INTERPRET=1, which "
                                 "runs on CPU tensors only; unset it to run them on CUDA")
            return
        if not triton_kernels.kernels_interpreted():
            raise ValueError(f"the triton backend got {query.device.type} tensors but its kernels "
                             "were compiled for the GPU; set TRITON_INTERPRET=1 before the engine "
                             "imports triton, or use the torch backend on CPU")

"""The CPU default backend: the torch backend with decode attention, prefill attention and the KV
store in native kernels.

Decode (one query token per sequence) is memory-bound and dominates a serving step; the torch
path has to gather every sequence's K/V out of the paged cache into a padded copy before
`scaled_dot_product_attention`. The kernel in `engine/csrc/paged_decode_cpu.cpp` reads K/V in place
through the block tables instead (about 5-7x faster per layer on a 2-core AVX-512 machine).
Prefill chunks in bf16 on CPUs with AVX512-BF16 go to `engine/csrc/flash_prefill_cpu.cpp`, a flash-attention
forward whose matmuls are bf16 dot-product instructions (about 2x torch's CPU flash kernel at
256-1024 tokens); other dtypes and CPUs keep torch's flash attention. When the kernels cannot be
built, this backend behaves exactly like `TorchAttentionBackend` (`native` says which is in use).
An 8-bit cache (engine/kv_quant.py): a native store quantizes into it (`kv_store_cpu.cpp`), decodes
read it in place (the same decode kernel, one byte per cached value), and a prefill chunk attends
over its sequence's blocks dequantized (the copy the model dtype's path gathers anyway).

Variants (`AttentionVariant`: sliding window, logit soft-cap, sinks, alone or together) run in the
same native kernels: decodes of either cache kind read only the blocks inside the window, and the
bf16 flash prefill masks and skips by window; a prefill chunk after a cached prefix gathers only
the blocks its queries' windows reach. Where the native kernels do not apply (no kernels, other
devices, a prefill that is not bf16 on AVX512-BF16), the torch reference computes the variant.

Latent attention (DeepSeek's MLA, `latent_attention`): decodes in `latent_decode_cpu.cpp`, which
reads each sequence's latents in place (float or 8-bit) once for a group of heads; multi-token
chunks in latent.py's torch reference (engine/model/mla.py sends float-cache chunks expanded
instead, so those reach it only with an 8-bit cache).
"""
from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.attention.backend import host_lengths
from engine.attention.metadata import AttentionMetadata, put_rows, sub_batch, take_rows
from engine.attention.paged import sequence_kv, store_kv
from engine.attention.torch_backend import TorchAttentionBackend, causal_attention
from engine.attention.variant import AttentionVariant, is_plain
from engine.kv_quant import KVQuantFormat


def _variant_args(variant: AttentionVariant | None) -> tuple[int, float, torch.Tensor | None]:
    """The native kernels' (window, softcap, sinks): 0, 0.0 and None for "none"."""
    if variant is None:
        return 0, 0.0, None
    return variant.sliding_window or 0, variant.softcap or 0.0, variant.sinks


def _first_block(variant: AttentionVariant | None, context_len: int, block_size: int) -> int:
    """The first block a chunk whose first query sits at `context_len` reads: its window's first
    key's (0 without a window). Windows are relative, so its keys may start there."""
    window = None if variant is None else variant.sliding_window
    return 0 if window is None else max(0, context_len - window + 1) // block_size


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kv_format: KVQuantFormat | None = None) -> None:
        super().__init__(kv_format)
        self._kernels = cpu_kernels.load()
        self._flash_prefill = self._kernels is not None and self._kernels.has_flash_prefill()
        # latent attention's plan for the metadata it last saw (every layer of a pass shares it)
        self._latent_plan: tuple | None = None

    @property
    def native(self) -> bool:
        return self._kernels is not None

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if self.kv_format is not None:
            return self._store_8bit(key, value, kv_cache, slot_mapping)
        if (self._kernels is None or kv_cache.device.type != "cpu" or key.dtype != kv_cache.dtype
                or value.dtype != kv_cache.dtype or not kv_cache.is_contiguous()
                or key.shape[0] != slot_mapping.shape[0] or slot_mapping.dtype != torch.int64
                or any(t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (key, value))):
            return store_kv(key, value, kv_cache, slot_mapping)
        self._kernels.store_kv_cache_(key, value, kv_cache, slot_mapping)

    def _store_8bit(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
        fmt = self.kv_format
        if (self._kernels is None or kv_cache.device.type != "cpu" or key.dtype != value.dtype
                or key.dtype not in (torch.float32, torch.bfloat16, torch.float16)
                or slot_mapping.dtype != torch.int64 or not kv_cache.is_contiguous()):
            return fmt.store(key, value, kv_cache, slot_mapping)
        fmt.split(kv_cache)  # checks the layer's shape
        if key.shape[0] != slot_mapping.shape[0]:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
        self._kernels.store_kv_cache_8bit_(key, value, kv_cache, slot_mapping, fmt.block_size, fmt.name == "fp8_e4m3")

    def latent_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, value_dim: int) -> torch.Tensor:
        """Latent attention (DeepSeek's MLA): the decodes (single-token sequences) in the native
        kernel (`csrc/latent_decode_cpu.cpp`), which reads the latents in place from a float or
        8-bit cache; multi-token chunks in the torch backend's path (latent.py's reference; 8-bit:
        over their blocks dequantized), as one sub-batch of just them. Where the kernel does not
        apply (no kernels, another device, a dtype or cache layout it does not take), all of it
        goes to the torch backend's path. Planned from host-side lengths once per metadata (every
        layer of a forward pass shares it); rows past the batch come back as zeros."""
        kernels, fmt = self._kernels, self.kv_format
        fits = (kernels is not None and query.device.type == "cpu" and query.dim() == 3
                and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and kv_cache.device.type == "cpu" and kv_cache.is_contiguous() and 0 < value_dim <= query.shape[-1]
                and kernels.has_latent_decode())
        if fits and fmt is None:
            fits = (kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[3] == 1
                    and kv_cache.dtype == query.dtype and 2 * kv_cache.shape[4] == query.shape[-1])
        elif fits:
            fits = (kv_cache.dim() == 2 and kv_cache.dtype == torch.uint8 and fmt.num_kv_heads == 1
                    and 2 * fmt.head_dim == query.shape[-1])
        if not fits:
            return super().latent_attention(query, kv_cache, meta, scale, value_dim)

        plan = self._latent_plan
        if plan is None or plan[0] is not meta or plan[1] != query.shape[0]:
            # (meta, tokens, the decodes' rows (None: every row) and their block tables and lengths
            # (None: no decodes), the chunks' rows and metadata (None: no chunks))
            query_lens, seq_lens = host_lengths(meta)
            if sum(query_lens) > query.shape[0]:
                raise ValueError(f"metadata covers {sum(query_lens)} query tokens but query has {query.shape[0]}")
            decodes = [s for s, length in enumerate(query_lens) if length == 1]
            chunks = [s for s, length in enumerate(query_lens) if length > 1]
            decode_rows = tables = lens = chunk_rows = chunk_meta = None
            if decodes:
                decode_meta = meta
                if not len(decodes) == len(query_lens) == query.shape[0]:  # chunks or padding rows besides
                    decode_rows, decode_meta = sub_batch(meta, query_lens, seq_lens, decodes)
                tables = decode_meta.block_tables.to(torch.int32).contiguous()
                lens = decode_meta.seq_lens.to(torch.int32).contiguous()
            if chunks:
                chunk_rows, chunk_meta = sub_batch(meta, query_lens, seq_lens, chunks)
            plan = self._latent_plan = (meta, query.shape[0], decode_rows, tables, lens, chunk_rows, chunk_meta)
        _, _, decode_rows, tables, lens, chunk_rows, chunk_meta = plan
        if tables is None:  # no decodes
            return super().latent_attention(query, kv_cache, meta, scale, value_dim)

        def decode(rows: torch.Tensor) -> torch.Tensor:
            if fmt is None:
                return kernels.latent_decode_attention(rows, kv_cache, tables, lens, scale, value_dim)
            return kernels.latent_decode_attention_8bit(rows, kv_cache, tables, lens, scale, value_dim,
                                                        fmt.block_size, fmt.name == "fp8_e4m3")

        if decode_rows is None:  # decodes only, no padding rows
            return decode(query)
        out = query.new_zeros(query.shape[0], query.shape[1], value_dim)
        put_rows(out, decode_rows, decode(take_rows(query, decode_rows)))
        if chunk_rows is not None:
            put_rows(out, chunk_rows, super().latent_attention(take_rows(query, chunk_rows), kv_cache, chunk_meta,
                                                               scale, value_dim))
        return out

    def _forward_8bit(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      variant: AttentionVariant | None = None) -> torch.Tensor:
        """Store natively, then attend over the 8-bit blocks: decodes read them in place, prefill
        chunks over their sequence's blocks dequantized (the new tokens as stored)."""
        if self._kernels is None or query.device.type != "cpu":
            return super()._forward_8bit(query, key, value, kv_cache, meta, scale, variant)
        self._store_8bit(key, value, kv_cache, meta.slot_mapping)
        return self._attend(query, key, value, kv_cache, meta, scale, variant)

    # `_attend`'s two halves; a 2-D cache is the 8-bit format's [num_blocks, block_bytes] (a dense
    # copy of it, in the torch path's fallback, is 5-D like any other cache).
    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, seq_lens_host: list[int], scale: float,
                variant: AttentionVariant | None = None) -> torch.Tensor:
        if kv_cache.dim() == 2:
            fmt = self.kv_format
            return self._kernels.paged_decode_attention_8bit(query, kv_cache, block_tables.to(torch.int32),
                                                             seq_lens.to(torch.int32), scale, fmt.block_size,
                                                             fmt.num_kv_heads, fmt.name == "fp8_e4m3",
                                                             *_variant_args(variant))
        if self._kernels is None or query.device.type != "cpu" or kv_cache.dtype != query.dtype:
            return super()._decode(query, kv_cache, block_tables, seq_lens, seq_lens_host, scale, variant)
        return self._kernels.paged_decode_attention(query, kv_cache, block_tables.to(torch.int32),
                                                    seq_lens.to(torch.int32), scale, *_variant_args(variant))

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                 scale: float, variant: AttentionVariant | None = None) -> torch.Tensor:
        query_len = query.shape[0]
        if kv_cache.dim() == 2:
            fmt = self.kv_format
            first = _first_block(variant, seq_len - query_len, fmt.block_size)
            blocks = fmt.dequantize(kv_cache, block_table[first: -(-seq_len // fmt.block_size)], query.dtype)
            keys = blocks[:, 0].reshape(-1, fmt.num_kv_heads, fmt.head_dim)[:seq_len - first * fmt.block_size]
            values = blocks[:, 1].reshape(-1, fmt.num_kv_heads, fmt.head_dim)[:seq_len - first * fmt.block_size]
        elif seq_len == query_len:  # no cached prefix: this chunk's own K/V
            keys, values = key, value
        else:
            block_size = kv_cache.shape[2]
            first = _first_block(variant, seq_len - query_len, block_size)
            keys, values = sequence_kv(kv_cache, block_table[first:], seq_len - first * block_size)
        head_dim = query.shape[-1]
        if (self._flash_prefill and query.device.type == "cpu" and query.dtype == torch.bfloat16
                and keys.dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= 256):
            return self._kernels.flash_prefill_attention(query, keys, values, scale, *_variant_args(variant))
        return causal_attention(query, keys, values, scale, None if is_plain(variant) else variant)

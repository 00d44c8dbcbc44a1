"""The 8-bit KV cache format: fp8 (e4m3) or int8 values with a float32 scale per block, K/V half
and KV head, and a bf16 reference K row per block and head (K smoothing), stored inside the block.

One (layer, block) chunk is `block_bytes` bytes: the values `[2, block_size, num_kv_heads,
head_dim]` (K then V, one byte each), the scales `[2, num_kv_heads]` (float32), then the K
references `[num_kv_heads, head_dim]` (bfloat16). A value `x` is stored as `q = (x - ref) /
scale` rounded to the 8-bit type (int8: clamped to +-127; fp8 e4m3: to +-448) and read as
`q * scale + ref`, where `ref` is the block's reference row for K and 0 for V. Because scales
and references live in the block, a block stays self-contained: the prefix cache shares it, the
host tier, swap and every KV transfer copy its bytes as they are (half of bf16's, a quarter of
fp32's, plus 8 + 2 * head_dim bytes per head and block: 0.533x bf16 at head_dim 64 and 16-token
blocks), and the transfer's checksum covers them.

Why the K reference: K has channels whose values sit far from 0 with a small spread around a
per-channel centre (after RoPE, slowly rotating across a block's positions). A scale sized for
their magnitude wastes the 8 bits on that offset. The block's first K row is a good centre, so
the deviation from it is what gets quantized (fp8 e4m3 perplexity on the default model: +1.2%
without it, -0.2% with it; benchmarks/HISTORY.md). Attention adds `q . ref` to a block's
scores, exactly, so the reference costs one dot product per block and head.

Invariants (what `store` keeps):
- a write at offset 0 starts the block afresh (whatever it held belongs to an earlier owner):
  its K reference becomes that token's K, rounded to bf16; every later write to the block keeps
  the reference;
- a block's scale per (K/V, head) is the largest |x - ref| / QMAX of the values written to it
  since its first position was written; never 0 (a block of zeros gets `MIN_SCALE`);
- a write whose values need a larger scale for a (K/V, head) re-quantizes what the block holds
  there with the new scale first, so every stored value reads back within half a quantization
  step of the new scale of what was written (plus the earlier rounding). What it holds is the
  positions before the write's first offset in the block: a sequence fills its blocks in order,
  and a write at offset j replaces whatever sat at j and after (an earlier owner's values), which
  nothing reads before it is written again. The scale a write grew stays grown: that is why
  speculative decoding is refused with an 8-bit cache (a rejected draft's values would still have
  re-rounded the positions before it; engine/config.py);
- positions past what was written are never read (attention masks by sequence length).

Attention dequantizes: `dequantize(layer, block_ids)` gives the blocks' K/V in a float dtype
(the torch reference backend attends over that; engine/attention/torch_backend.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.config import KV_CACHE_DTYPES

QUANTIZED_KV_DTYPES = tuple(name for name in KV_CACHE_DTYPES if name != "auto")
_VALUE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
_QMAX = {"fp8_e4m3": 448.0, "int8": 127.0}
SCALE_DTYPE = torch.float32
REF_DTYPE = torch.bfloat16
MIN_SCALE = 1e-8


# where the KV head axis is in each of `BlockParts`' views
_HEAD_AXES = (3, 2, 1)


class BlockParts(NamedTuple):
    """Views of a layer's 8-bit cache, one row per block."""

    values: torch.Tensor  # [num_blocks, 2, block_size, heads, head_dim], the 8-bit type
    scales: torch.Tensor  # [num_blocks, 2, heads] float32
    refs: torch.Tensor  # [num_blocks, heads, head_dim] bfloat16: K's reference rows


@dataclass(frozen=True)
class KVQuantFormat:
    """One side's 8-bit block layout. A layer's cache is a `[num_blocks, block_bytes]` uint8 tensor."""

    name: str  # "fp8_e4m3" or "int8"
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.name not in QUANTIZED_KV_DTYPES:
            raise ValueError(f"8-bit KV dtype must be one of {', '.join(QUANTIZED_KV_DTYPES)}, got {self.name!r}")

    @property
    def value_dtype(self) -> torch.dtype:
        return _VALUE_DTYPES[self.name]

    @property
    def qmax(self) -> float:
        return _QMAX[self.name]

    @property
    def values_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def scales_bytes(self) -> int:
        return 2 * self.num_kv_heads * SCALE_DTYPE.itemsize

    @property
    def refs_offset(self) -> int:
        """Where a block's K references start (after its values and scales; even, so bf16 aligns)."""
        return self.values_bytes + self.scales_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one (layer, block): values, scales (at a multiple of 4, so they align), K references."""
        return self.refs_offset + self.num_kv_heads * self.head_dim * REF_DTYPE.itemsize

    def split(self, layer: torch.Tensor) -> BlockParts:
        """Views of a layer's cache (`[num_blocks, block_bytes]` uint8), the values in the 8-bit type."""
        if layer.dim() != 2 or layer.shape[1] != self.block_bytes or layer.dtype != torch.uint8:
            raise ValueError(f"an 8-bit KV layer must be [num_blocks, {self.block_bytes}] uint8, got "
                             f"{tuple(layer.shape)} {layer.dtype}")
        parts = self._split_bytes(layer)
        return parts._replace(values=parts.values.view(self.value_dtype))

    def _split_bytes(self, layer: torch.Tensor) -> BlockParts:
        # the values as uint8: indexing and copies work on bytes for every 8-bit type
        n, heads, dim = layer.shape[0], self.num_kv_heads, self.head_dim
        return BlockParts(layer[:, :self.values_bytes].view(n, 2, self.block_size, heads, dim),
                          layer[:, self.values_bytes:self.refs_offset].view(SCALE_DTYPE).view(n, 2, heads),
                          layer[:, self.refs_offset:].view(REF_DTYPE).view(n, heads, dim))

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`x / scale` as the 8-bit type (scale broadcast against x)."""
        y = (x.float() / scale).clamp_(-self.qmax, self.qmax)
        if self.value_dtype is torch.int8:
            y = y.round_()
        return y.to(self.value_dtype)

    def store(self, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Quantize `key[t]`/`value[t]` (`[tokens, heads, head_dim]`) into slot `slot_mapping[t]`
        (block * block_size + offset; -1: skipped), keeping the invariants above."""
        if key.shape[0] != slot_mapping.shape[0]:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
        slots = slot_mapping.to(device=layer.device, dtype=torch.int64)
        valid = slots >= 0
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
        if slots.numel() == 0:
            return
        self.split(layer)  # checks the layer's shape
        values, scales, refs = self._split_bytes(layer)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        # a write at offset 0 starts a block afresh: that token's K is its reference from now on
        starts = offsets == 0
        refs[blocks[starts]] = key[starts].to(REF_DTYPE)
        new = torch.stack((key.float() - refs.index_select(0, blocks).float(), value.float()), dim=1)  # [T, 2, heads, dim]
        touched, index = torch.unique(blocks, return_inverse=True)
        # the scale each block needs for this write: the largest |x - ref| / QMAX per (K/V, head)
        need = torch.zeros((touched.numel(), 2 * self.num_kv_heads), dtype=SCALE_DTYPE, device=layer.device)
        need.scatter_reduce_(0, index[:, None].expand(-1, 2 * self.num_kv_heads),
                             (new.abs().amax(dim=-1) / self.qmax).view(-1, 2 * self.num_kv_heads), "amax")
        need = need.view(-1, 2, self.num_kv_heads)
        # a block written at offset 0 starts afresh; otherwise it keeps (at least) its scale
        fresh = torch.zeros(touched.numel(), dtype=torch.bool, device=layer.device)
        fresh.index_fill_(0, index[starts], True)
        old = scales.index_select(0, touched)
        kept = torch.where(fresh[:, None, None], torch.zeros_like(old), old)
        scale = torch.maximum(torch.maximum(need, kept), torch.full_like(need, MIN_SCALE))
        grew = ~fresh[:, None, None] & (scale > old)  # [touched, 2, heads]
        grown = grew.any(dim=-1).any(dim=-1)
        if bool(grown.any()):  # re-quantize what those blocks hold (x - ref) where their scales grew
            ids = touched[grown]
            first = torch.full((touched.numel(),), self.block_size, dtype=torch.int64, device=layer.device)
            first = first.scatter_reduce_(0, index, offsets, "amin")[grown]  # the write's first offset per block
            held_bytes = values.index_select(0, ids)
            held = self._to_float(held_bytes) * old[grown][:, :, None, :, None]
            requantized = self.quantize(held, scale[grown][:, :, None, :, None]).view(torch.uint8)
            positions = torch.arange(self.block_size, device=layer.device)
            redo = grew[grown][:, :, None, :, None] & (positions[None, None, :, None, None] < first[:, None, None, None, None])
            values[ids] = torch.where(redo, requantized, held_bytes)
        scales[touched] = scale
        token_scale = scale.index_select(0, index)[:, :, :, None]  # [T, 2, heads, 1]
        quantized = self.quantize(new, token_scale).view(torch.uint8)
        values[blocks, 0, offsets] = quantized[:, 0]
        values[blocks, 1, offsets] = quantized[:, 1]

    def with_heads(self, num_kv_heads: int) -> "KVQuantFormat":
        """The same format over another number of KV heads (a tensor-parallel rank's share)."""
        return dataclasses.replace(self, num_kv_heads=num_kv_heads)

    def select_heads(self, blocks: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Blocks `[n, block_bytes]` of this format -> their KV heads [start, start + count) as
        blocks of `with_heads(count)` (values, scales and references: all are per head, so a
        rank's share of a block is a block of its own)."""
        n = blocks.shape[0]
        return torch.cat([part.narrow(axis, start, count).reshape(n, -1)
                          for part, axis in zip(self._head_parts(blocks), _HEAD_AXES)], dim=1)

    def join_heads(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of `select_heads`: blocks of consecutive head ranges, in head order, ->
        blocks of this format."""
        n = parts[0].shape[0]
        shares = [self._heads_in(part) for part in parts]
        if sum(shares) != self.num_kv_heads:
            raise ValueError(f"parts hold {sum(shares)} KV heads, the format has {self.num_kv_heads}")
        pieces = [self.with_heads(h)._head_parts(part) for part, h in zip(parts, shares)]
        return torch.cat([torch.cat([p[i] for p in pieces], dim=axis).reshape(n, -1)
                          for i, axis in enumerate(_HEAD_AXES)], dim=1)

    def _head_parts(self, blocks: torch.Tensor) -> BlockParts:
        """`_split_bytes` with every part as bytes (so heads slice and join alike)."""
        n, heads = blocks.shape[0], self.num_kv_heads
        return BlockParts(blocks[:, :self.values_bytes].view(n, 2, self.block_size, heads, self.head_dim),
                          blocks[:, self.values_bytes:self.refs_offset].view(n, 2, heads, SCALE_DTYPE.itemsize),
                          blocks[:, self.refs_offset:].view(n, heads, self.head_dim * REF_DTYPE.itemsize))

    def _heads_in(self, part: torch.Tensor) -> int:
        per_head = self.block_bytes // self.num_kv_heads
        if part.dim() != 2 or part.dtype != torch.uint8 or part.shape[1] % per_head:
            raise ValueError(f"a share of an {self.name} block is [n, heads * {per_head}] uint8, got "
                             f"{tuple(part.shape)} {part.dtype}")
        return part.shape[1] // per_head

    def _to_float(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.view(self.value_dtype).to(torch.float32)

    def dequantize(self, layer: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The blocks `block_ids` (1-D) as `[n, 2, block_size, heads, head_dim]` in `dtype`."""
        self.split(layer)
        values, scales, refs = self._split_bytes(layer)
        ids = block_ids.to(device=layer.device, dtype=torch.int64)
        out = self._to_float(values.index_select(0, ids))
        out.mul_(scales.index_select(0, ids)[:, :, None, :, None])
        out[:, 0].add_(refs.index_select(0, ids).float()[:, None])
        return out.to(dtype)


def kv_quant_format(kv_cache_dtype: str, block_size: int, num_kv_heads: int, head_dim: int) -> KVQuantFormat | None:
    """The 8-bit format `--kv-cache-dtype` names, or None for "auto" (the model's dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return None
    return KVQuantFormat(kv_cache_dtype, block_size, num_kv_heads, head_dim)

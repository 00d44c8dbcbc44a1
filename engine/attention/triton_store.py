"""Triton kernels that write the paged KV cache: `store_kv_triton` (the plain cache) and
`store_kv_8bit_triton` (the int8 / fp8 e4m3 cache of engine/kv_quant.py). A slot of -1 is skipped.

The layouts are triton_kernels.py's: the plain cache `[num_blocks, 2, block_size, num_kv_heads,
head_dim]`, the 8-bit one `[num_blocks, block_bytes]` bytes (values, a scale per K/V half and
head, a bf16 K reference row per head: engine/kv_quant.py), addressed through `_paged_cache`.

The 8-bit store writes exactly the bytes `KVQuantFormat.store` writes, in one launch and without
a device sync. Its tokens are taken in slot order (`sort_slots`: the same for a pass's layers),
and the first of each block's tokens does the whole block: the K reference (set by a write at
offset 0), the scales its write needs, a re-quantization of the slots the block already holds
when a scale grows, then its tokens' values. Quantizing (`_quantize`) and the fp8 and bf16
roundings (`_fp32_to_e4m3_bits`, `_fp32_to_bf16`) are integer ops that round as torch does, on
any GPU and in the interpreter; `_stored_to_f32` reads stored bytes back as torch does.

Importing this module defines the kernels, so `TRITON_INTERPRET=1` must be set before it is
imported for them to run on CPU (`get_attention_backend("triton")` does that without CUDA).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels import _e4m3_as_fp16, _paged_cache, _pow2
from engine.kv_quant import MIN_SCALE, KVQuantFormat

_MIN_SCALE = tl.constexpr(MIN_SCALE)  # kernels may read only constexpr globals


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_POW2: tl.constexpr, DIM_POW2: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_POW2)[:, None]
    dims = tl.arange(0, DIM_POW2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_key_token + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + token64 * stride_value_token + heads * stride_value_head + dims, mask=mask)
    dst = cache_ptr + block * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head + dims
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp32_to_e4m3_bits(y):
    """float32 within +-448 (or NaN) -> fp8 e4m3fn bits (uint8), rounded to nearest even exactly as
    torch converts (c10's fp8e4m3fn_from_fp32_value), in integer ops so it runs alike everywhere."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # below 2^-6, e4m3's smallest normal: adding 2^14 rounds to a multiple of 2^-9 (its subnormal
    # step) and leaves the count in the low bits
    small = (magnitude.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    normal = (magnitude + ((7 - 127) << 23) + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
    code = tl.where(magnitude < (121 << 23), small, normal)
    code = tl.where(magnitude > 0x7F800000, 0x7F, code)
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _fp32_to_bf16(x):
    """float32 (finite) -> bfloat16 rounded to nearest even, as torch converts, in integer ops (the
    interpreter's own conversion truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _quantize(x, scale, qmax, QUANT: tl.constexpr):
    """`KVQuantFormat.quantize` as torch computes it: x / scale (IEEE division), clamped to +-qmax
    (NaN kept); int8 rounded half to even, fp8 converted as torch does."""
    y = tl.clamp(tl.div_rn(x, scale), -qmax, qmax, propagate_nan=tl.PropagateNan.ALL)
    # one return per constexpr branch: a return after the `if` would be compiled for both
    # QUANTs, and the two return types differ
    if QUANT == 1:
        # |y| <= 127: adding 1.5 * 2^23 leaves no fraction bits, so the add rounds half to even
        q = ((y + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        q = _fp32_to_e4m3_bits(y)
    return q


@triton.jit
def _stored_to_f32(raw, QUANT: tl.constexpr):
    """Stored 8-bit values -> float32 as torch reads them; fp8 NaN bytes (which only an earlier
    owner's leftovers past the written positions can hold) as NaN of their sign, so re-quantizing
    them gives torch's bytes too."""
    if QUANT == 1:
        return raw.to(tl.float32)
    value = _e4m3_as_fp16(raw).to(tl.float32) * 256.0
    nan = ((raw.to(tl.int32) << 24) | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where((raw & 0x7F) == 0x7F, nan, value)


@triton.jit
def _requantize_half(half_ptr, old, scale, qmax, stride_slot, stride_head, heads, dims, mask, first,
                     QUANT: tl.constexpr):
    """One K/V half of a block, from scale `old` to `scale` (per head), where the scale grew: its
    slots before `first` (the write's first offset in the block; what it holds)."""
    mask = mask & (scale > old)[:, None]
    for offset in range(first):
        ptrs = half_ptr + offset * stride_slot + heads[:, None] * stride_head + dims[None, :]
        held = _stored_to_f32(tl.load(ptrs, mask=mask, other=0), QUANT) * old[:, None]
        tl.store(ptrs, _quantize(held, scale[:, None], qmax, QUANT), mask=mask)


@triton.jit
def _store_kv_8bit_kernel(
    key_ptr, value_ptr, values_ptr, scales_ptr, refs_ptr, sorted_slots_ptr, order_ptr, num_tokens,
    qmax, inv_qmax,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_values_block, stride_values_kv, stride_values_slot, stride_values_head,
    stride_scales_block, stride_scales_kv, stride_refs_block, stride_refs_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_POW2: tl.constexpr, DIM_POW2: tl.constexpr, QUANT: tl.constexpr,
    NEED_BY_RECIPROCAL: tl.constexpr,
):
    """`KVQuantFormat.store`, byte for byte. Program i takes the i-th token in slot order
    (`sorted_slots[i]` = `slot_mapping[order[i]]`, stable); the first of each block's tokens
    (they are contiguous in that order) does the whole block: its K reference (a write at offset
    0, which sorts first, sets it), the scale its write needs, a re-quantization of the block when
    a scale grows, the scales, then its tokens' values (K less the reference)."""
    i = tl.program_id(0)
    slot = tl.load(sorted_slots_ptr + i)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    previous = tl.load(sorted_slots_ptr + i - 1, mask=i > 0, other=-1)
    if (previous >= 0) & (previous // BLOCK_SIZE == block):
        return
    heads = tl.arange(0, HEADS_POW2)
    dims = tl.arange(0, DIM_POW2)
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    key_tile = heads[:, None] * stride_key_head + dims[None, :]
    value_tile = heads[:, None] * stride_value_head + dims[None, :]

    # a write at offset 0 (the block's smallest here) starts the block afresh, its K the reference
    fresh = slot % BLOCK_SIZE == 0
    ref_ptrs = refs_ptr + block * stride_refs_block + heads[:, None] * stride_refs_head + dims[None, :]
    if fresh:
        opener = tl.load(order_ptr + i)  # the token written at offset 0
        ref = _fp32_to_bf16(tl.load(key_ptr + opener * stride_key_token + key_tile, mask=mask, other=0.0).to(tl.float32))
        tl.store(ref_ptrs, ref, mask=mask)
    else:
        ref = tl.load(ref_ptrs, mask=mask, other=0.0)
    ref = ref.to(tl.float32)

    # the largest |x - ref| per (K/V, head) over the block's tokens (ref = 0 for V); their end in slot order
    amax_k = tl.zeros([HEADS_POW2], dtype=tl.float32)
    amax_v = tl.zeros([HEADS_POW2], dtype=tl.float32)
    end = i
    next_slot = slot
    while next_slot // BLOCK_SIZE == block:
        token = tl.load(order_ptr + end)
        k = tl.load(key_ptr + token * stride_key_token + key_tile, mask=mask, other=0.0).to(tl.float32) - ref
        v = tl.load(value_ptr + token * stride_value_token + value_tile, mask=mask, other=0.0).to(tl.float32)
        amax_k = tl.maximum(amax_k, tl.max(tl.abs(k), 1))
        amax_v = tl.maximum(amax_v, tl.max(tl.abs(v), 1))
        end += 1
        next_slot = tl.load(sorted_slots_ptr + end, mask=end < num_tokens, other=-BLOCK_SIZE)
    if NEED_BY_RECIPROCAL:  # torch on CUDA divides by a Python-float divisor as x * (1 / divisor)
        need_k = amax_k * inv_qmax
        need_v = amax_v * inv_qmax
    else:
        need_k = tl.div_rn(amax_k, qmax)
        need_v = tl.div_rn(amax_v, qmax)

    scale_ptrs = scales_ptr + block * stride_scales_block + heads
    old_k = tl.load(scale_ptrs, mask=head_mask, other=0.0)
    old_v = tl.load(scale_ptrs + stride_scales_kv, mask=head_mask, other=0.0)
    scale_k = tl.maximum(tl.maximum(need_k, tl.where(fresh, 0.0, old_k)), _MIN_SCALE)
    scale_v = tl.maximum(tl.maximum(need_v, tl.where(fresh, 0.0, old_v)), _MIN_SCALE)
    grew = tl.max((((scale_k > old_k) | (scale_v > old_v)) & head_mask).to(tl.int32), 0)
    block_ptr = values_ptr + block * stride_values_block
    if (grew > 0) & (slot % BLOCK_SIZE != 0):
        first = slot % BLOCK_SIZE  # this program's token is the block's first in slot order
        _requantize_half(block_ptr, old_k, scale_k, qmax, stride_values_slot, stride_values_head, heads, dims,
                         mask, first, QUANT)
        _requantize_half(block_ptr + stride_values_kv, old_v, scale_v, qmax, stride_values_slot,
                         stride_values_head, heads, dims, mask, first, QUANT)
        tl.debug_barrier()  # the re-quantized bytes land before this write's tokens overwrite theirs
    tl.store(scale_ptrs, scale_k, mask=head_mask)
    tl.store(scale_ptrs + stride_scales_kv, scale_v, mask=head_mask)

    for index in range(i, end):  # in slot order, stable: of two tokens for one slot the later one stays
        token = tl.load(order_ptr + index)
        dst = (block_ptr + (tl.load(sorted_slots_ptr + index) % BLOCK_SIZE) * stride_values_slot
               + heads[:, None] * stride_values_head + dims[None, :])
        k = tl.load(key_ptr + token * stride_key_token + key_tile, mask=mask, other=0.0).to(tl.float32) - ref
        v = tl.load(value_ptr + token * stride_value_token + value_tile, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, _quantize(k, scale_k[:, None], qmax, QUANT), mask=mask)
        tl.store(dst + stride_values_kv, _quantize(v, scale_v[:, None], qmax, QUANT), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Triton twin of `torch_backend.store_kv`: write key/value rows at their slots, -1 skipped."""
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_dim) dimension")
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_POW2=_pow2(num_kv_heads), DIM_POW2=max(16, _pow2(head_dim)),
    )


def sort_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots in ascending order, their token indices), a stable sort: what `store_kv_8bit_triton`
    needs, the same for every layer of a forward pass."""
    return torch.sort(slot_mapping.to(torch.int64), stable=True)


def store_kv_8bit_triton(key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, slot_mapping: torch.Tensor,
                         kv_format: KVQuantFormat, sorted_slots: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`kv_format.store(key, value, layer, slot_mapping)`, the same bytes, in one launch and without
    a device sync. `sorted_slots`: `sort_slots(slot_mapping)`."""
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    cache = _paged_cache(layer, kv_format)  # checks the layer's shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    slots, order = sorted_slots
    qmax = kv_format.qmax
    _store_kv_8bit_kernel[(num_tokens,)](
        key, value, cache.values, cache.scales, cache.refs, slots, order, num_tokens,
        qmax, float(np.float32(1) / np.float32(qmax)),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *cache.value_strides, *cache.scale_strides, *cache.ref_strides,
        BLOCK_SIZE=kv_format.block_size, NUM_KV_HEADS=kv_format.num_kv_heads, HEAD_DIM=kv_format.head_dim,
        HEADS_POW2=_pow2(kv_format.num_kv_heads), DIM_POW2=max(16, _pow2(kv_format.head_dim)),
        QUANT=cache.quant, NEED_BY_RECIPROCAL=layer.device.type == "cuda",
    )

"""The Llama block's elementwise ops as one Triton kernel each, for 16-bit activations on CUDA.

The GPU twin of `engine/csrc/fused_ops_cpu.cpp`, for the same reason: in eager torch, RMSNorm is
~8 kernels, RoPE ~12 and SiLU-and-mul 3, each a launch of a few microseconds on tiny tensors,
which for a small model costs more than its matmuls (and more graph nodes under CUDA graphs).
Each kernel computes in fp32 and rounds to the activation dtype exactly where the torch
expression in `fused_ops.py` rounds, so RoPE, the residual add and the products are the same
values; RMSNorm's mean is summed in another order and can move a value by one ulp
(tests/engine/test_triton_ops.py). Two GPU compiler defaults would break that, and are turned
off where they matter (found on an H200, where the tests first failed):
- multiply-add contraction: the compiler folds the rounded products of RoPE's `x*cos + x'*sin`
  into one fused multiply-add, which rounds once where torch rounds three times, so RoPE is
  launched with `enable_fp_fusion=False`;
- approximate `exp` and division: Triton's `tl.exp` and `/` are the fast approximate PTX
  instructions, torch's SiLU uses CUDA's `expf` and IEEE division, and the few-ulp difference in
  fp32 moved SiLU-and-mul outputs by two ulps of fp16; on the GPU the kernel calls libdevice's
  `exp` (the same `expf`) and `div_rn`. Called only through `fused_ops` (float32 keeps the torch
expressions); runs on CPU tensors under `TRITON_INTERPRET=1`, which is how CI tests it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_residual, stride_out,
                     n_cols, eps, ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Row r: [residual += x;] out = weight * (v * rsqrt(mean(v^2) + eps)), v = x or the new residual."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_residual + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, n_cols, BLOCK: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0)
    # torch's CUDA SiLU: x / (1 + expf(-x)) with IEEE division (the interpreter has no libdevice)
    if LIBDEVICE:
        exp_neg = libdevice.exp(-gate)
    else:
        exp_neg = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + exp_neg).to(out_ptr.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(src_ptr, dst_ptr, stride_src_token, stride_src_head, stride_dst_token, stride_dst_head,
            token, cos1, cos2, sin1, sin2, num_heads,
            HALF: tl.constexpr, HALF_POW2: tl.constexpr, HEADS_POW2: tl.constexpr):
    heads = tl.arange(0, HEADS_POW2)[:, None]
    dims = tl.arange(0, HALF_POW2)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    src = src_ptr + token * stride_src_token + heads * stride_src_head + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    ty = dst_ptr.dtype.element_ty
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], each product and the sum rounded.
    a1 = (x1.to(tl.float32) * cos1).to(ty).to(tl.float32)
    b1 = (-x2.to(tl.float32) * sin1).to(ty).to(tl.float32)
    a2 = (x2.to(tl.float32) * cos2).to(ty).to(tl.float32)
    b2 = (x1.to(tl.float32) * sin2).to(ty).to(tl.float32)
    dst = dst_ptr + token * stride_dst_token + heads * stride_dst_head + dims
    tl.store(dst, (a1 + b1).to(ty), mask=mask)
    tl.store(dst + HALF, (a2 + b2).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
                   stride_q_token, stride_q_head, stride_k_token, stride_k_head,
                   stride_qo_token, stride_qo_head, stride_ko_token, stride_ko_head, stride_cache,
                   num_q_heads, num_k_heads,
                   HALF: tl.constexpr, HALF_POW2: tl.constexpr, Q_HEADS_POW2: tl.constexpr,
                   K_HEADS_POW2: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_POW2)[None, :]
    dim_mask = dims < HALF
    ty = q_out_ptr.dtype.element_ty
    # The fp32 tables, rounded to the activation dtype first (as `.to(query.dtype)` does).
    row = position * stride_cache + dims
    cos1 = tl.load(cos_ptr + row, mask=dim_mask, other=0.0).to(ty).to(tl.float32)
    cos2 = tl.load(cos_ptr + row + HALF, mask=dim_mask, other=0.0).to(ty).to(tl.float32)
    sin1 = tl.load(sin_ptr + row, mask=dim_mask, other=0.0).to(ty).to(tl.float32)
    sin2 = tl.load(sin_ptr + row + HALF, mask=dim_mask, other=0.0).to(ty).to(tl.float32)
    _rotate(q_ptr, q_out_ptr, stride_q_token, stride_q_head, stride_qo_token, stride_qo_head, token,
            cos1, cos2, sin1, sin2, num_q_heads, HALF, HALF_POW2, Q_HEADS_POW2)
    _rotate(k_ptr, k_out_ptr, stride_k_token, stride_k_head, stride_ko_token, stride_ko_head, token,
            cos1, cos2, sin1, sin2, num_k_heads, HALF, HALF_POW2, K_HEADS_POW2)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] with unit stride in H."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, x.stride(0), x.stride(0), out.stride(0), x.shape[1], eps,
                                        ADD_RESIDUAL=False, BLOCK=_pow2(x.shape[1]))
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`residual += x` in place, then rms_norm(residual); x, residual: [T, H], unit stride in H."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0),
                                        x.shape[1], eps, ADD_RESIDUAL=True, BLOCK=_pow2(x.shape[1]))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] with unit stride in the last dim -> silu(gate) * up, [T, I]."""
    tokens, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty(tokens, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(n_cols))
    if tokens:
        _silu_and_mul_kernel[(tokens, triton.cdiv(n_cols, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                   n_cols, BLOCK=block,
                                                                   LIBDEVICE=gate_up.is_cuda)
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hk, D] (unit stride in D) -> rotated contiguous copies."""
    tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    half = head_dim // 2
    if tokens:
        _rotary_kernel[(tokens,)](
            positions, query, key, q_out, k_out, cos_cache, sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_cache.stride(0),
            num_q_heads, num_k_heads,
            HALF=half, HALF_POW2=_pow2(half), Q_HEADS_POW2=_pow2(num_q_heads), K_HEADS_POW2=_pow2(num_k_heads),
            enable_fp_fusion=False)  # every product rounded, as torch does (module docstring)
    return q_out, k_out

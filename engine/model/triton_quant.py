"""Weight-only quantized linear layers as Triton kernels: y = x @ W^T (+ bias) for the checkpoint
formats of engine/model/quant_formats.py, W dequantized in registers one [BLOCK_K, BLOCK_N] tile
at a time (never materialized), the product accumulated in fp32, y in x's dtype.

- `fp8_linear`: weight float8_e4m3fn [N, K] read as its bytes (uint8) and decoded with integer
  ops and a bitcast (`_e4m3_to_fp32`: sign bit 7, exponent bits 6..3 with bias 7, mantissa bits
  2..0; exponent 0 is the subnormal m * 2^-9), which runs alike under the interpreter and on every
  GPU (no fp8 hardware needed), then times its scale: with `block` (bn, bk),
  scale[n // bn, k // bk] of float32 [ceil(N / bn), ceil(K / bk)] (`weight_scale_inv`); without,
  one per output channel ([N] or [N, 1]) or one per tensor (one element).
- `int4_linear`: AWQ (`awq=True`: qweight int32 [K, N / 8] packed along N, nibble i holding
  column 8j + AWQ_ORDER[i], i.e. column c in nibble c // 2 + 4 (c % 2); qzeros [groups, N / 8]
  alike) or GPTQ (qweight int32 [K / 8, N] packed along K, nibble i holding row 8j + i; qzeros
  [groups, N / 8] packed along N in plain order); scales [groups, N]; group_index int32 [K] the
  scale / zero row of each input row (GPTQ's g_idx, or k // group_size). W[n, k] =
  (q[k, n] - (z[g, n] + zero_offset)) * s[g, n], g = group_index[k].

One kernel per format, a tiled GEMM: program (n, m) owns a BLOCK_M x BLOCK_N tile of y and walks
K; the dequantized W tile is rounded to x's dtype before `tl.dot` (16-bit: tensor cores with fp32
accumulation; fp32: exact fp32 products, `input_precision="ieee"`), so a 16-bit y differs from
F.linear(x.float(), W) by W's and y's roundings. Decode-sized M (<= 16) takes 16-row tiles and
narrow N tiles (more programs over N: a decode step is bound by reading W); larger M 64 x 64.
fp8 block scales are loaded as one [BLOCK_N] vector per K tile when BLOCK_K divides bk (the
wrapper picks the largest of 128, 64, 32, 16 up to its default that does), else per element. Runs on CPU tensors
under `TRITON_INTERPRET=1`, which is how CI tests it (tests/engine/test_triton_quant.py, against
`QuantFormat.dequantize`); tests/engine/triton_compile_check.py compiles the launches for sm_80/90.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _e4m3_to_fp32(raw):
    """fp8 e4m3fn bits (uint8) -> float32, exact for every pattern but NaN (0x7F / 0xFF read as
    +-480): a normal's fields moved into fp32's (exponent bias 7 -> 127), a subnormal m * 2^-9."""
    b = raw.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 0x80) != 0, -value, value)


@triton.jit
def _store_output(acc, out_ptr, bias_ptr, rows, cols, M, N, stride_out, HAS_BIAS: tl.constexpr):
    col_mask = cols < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_mask[None, :])


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
    scale_bn, scale_bk, stride_scale_n, stride_scale_k,
    HAS_BIAS: tl.constexpr, SCALE_PER_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * e4m3(w[n, k]) * scale[n // bn, k // bk]. SCALE_PER_TILE: every K
    tile lies in one scale column (BLOCK_K divides bk, or a scale per channel / tensor)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w + ks[:, None]  # [BLOCK_K, BLOCK_N]
    scale_rows = scale_ptr + (cols // scale_bn) * stride_scale_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = ks < K - k0
        x = tl.load(x_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        mask = k_mask[:, None] & col_mask[None, :]
        w = _e4m3_to_fp32(tl.load(w_ptrs + k0, mask=mask, other=0))
        if SCALE_PER_TILE:
            scale = tl.load(scale_rows + (k0 // scale_bk) * stride_scale_k, mask=col_mask, other=0.0)[None, :]
        else:
            scale = tl.load(scale_rows[None, :] + ((k0 + ks) // scale_bk)[:, None] * stride_scale_k,
                            mask=mask, other=0.0)
        acc = tl.dot(x, (w * scale).to(x_ptr.dtype.element_ty), acc, input_precision=DOT_PRECISION)
    _store_output(acc, out_ptr, bias_ptr, rows, cols, M, N, stride_out, HAS_BIAS)


@triton.jit
def _int4_linear_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, group_ptr, bias_ptr, out_ptr, M, N, K, zero_offset,
    stride_x, stride_qweight, stride_qzeros, stride_scales, stride_out,
    AWQ: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * (q[k, n] - (z[g, n] + zero_offset)) * s[g, n], g = group[k]."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    if AWQ:  # nibble of column c: c // 2 + 4 (c % 2) (AWQ_ORDER's inverse)
        col_shift = ((cols % 8) // 2 + 4 * (cols % 2)) * 4
    else:
        col_shift = (cols % 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        x = tl.load(x_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        mask = k_mask[:, None] & col_mask[None, :]
        if AWQ:  # [K, N / 8] along N
            words = tl.load(qweight_ptr + k.to(tl.int64)[:, None] * stride_qweight + (cols // 8)[None, :],
                            mask=mask, other=0)
            q = (words >> col_shift[None, :]) & 0xF
        else:  # [K / 8, N] along K
            words = tl.load(qweight_ptr + (k // 8).to(tl.int64)[:, None] * stride_qweight + cols[None, :],
                            mask=mask, other=0)
            q = (words >> ((k % 8) * 4)[:, None]) & 0xF
        group = tl.load(group_ptr + k, mask=k_mask, other=0).to(tl.int64)[:, None]
        zeros = tl.load(qzeros_ptr + group * stride_qzeros + (cols // 8)[None, :], mask=mask, other=0)
        zeros = ((zeros >> col_shift[None, :]) & 0xF) + zero_offset
        scales = tl.load(scales_ptr + group * stride_scales + cols[None, :], mask=mask, other=0.0)
        w = (q - zeros).to(tl.float32) * scales.to(tl.float32)
        acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc, input_precision=DOT_PRECISION)
    _store_output(acc, out_ptr, bias_ptr, rows, cols, M, N, stride_out, HAS_BIAS)


def _tiles(m: int, dtype: torch.dtype, k_tile: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 x 32 tiles for decode-sized M, 64 x 64 above; fp32 (no
    tensor cores, exact products) halves BLOCK_K."""
    block_k = k_tile if dtype != torch.float32 else k_tile // 2
    return (16, 32, 2 * block_k) if m <= 16 else (64, 64, block_k)


def _prepare(x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None):
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x {list(x.shape)} does not end in in_features {k}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias {list(bias.shape)} must be [out_features {n}]")
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    return x2, out, None if bias is None else bias.contiguous()


def _launch(kernel, x2, weights: tuple, bias, out, scalars: tuple, tiles: tuple[int, int, int], **constexprs) -> None:
    """kernel(x, *weights, bias, out, M, N, *scalars, ...) over (N tiles, M tiles); no bias: out stands in."""
    block_m, block_n, block_k = tiles
    grid = (triton.cdiv(out.shape[1], block_n), triton.cdiv(x2.shape[0], block_m))
    kernel[grid](x2, *weights, out if bias is None else bias, out, x2.shape[0], out.shape[1], *scalars,
                 HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x2.dtype == torch.float32 else None,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **constexprs)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) in x's dtype, W = weight (float8_e4m3fn [N, K]) times `scale`:
    float32 [ceil(N / bn), ceil(K / bk)] for `block` (bn, bk); without, [N], [N, 1] or one element."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-d float8_e4m3fn tensor, got {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    x2, out, bias = _prepare(x, k, n, bias)
    if not scale.is_floating_point():
        raise ValueError(f"scale must be floating point, got {scale.dtype}")
    scale = scale.to(torch.float32).contiguous()
    if block is not None:
        bn, bk = block
        if bn <= 0 or bk <= 0 or tuple(scale.shape) != (triton.cdiv(n, bn), triton.cdiv(k, bk)):
            raise ValueError(f"block scales {list(scale.shape)} do not fit weight [{n}, {k}] in blocks {block}")
        scale_strides = (scale.stride(0), scale.stride(1))
    elif scale.numel() in (1, n) and scale.dim() <= 2 and (scale.dim() < 2 or scale.shape[1] == 1):
        bn, bk = 1, max(k, 1)
        scale_strides = (0 if scale.numel() == 1 else 1, 0)
    else:
        raise ValueError(f"scale {list(scale.shape)} is neither per tensor nor per channel ([{n}] or [{n}, 1])")
    tiles = _tiles(x2.shape[0], x.dtype, 64)
    fits = [t for t in (128, 64, 32, 16) if t <= tiles[2] and bk % t == 0]
    per_tile = block is None or bool(fits)
    if block is not None and fits:
        tiles = (tiles[0], tiles[1], fits[0])
    if x2.shape[0]:
        _launch(_fp8_linear_kernel, x2, (weight.contiguous().view(torch.uint8), scale), bias, out,
                (k, x2.stride(0), k, out.stride(0), bn, bk, *scale_strides), tiles, SCALE_PER_TILE=per_tile)
    return out.view(*x.shape[:-1], n)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group_index: torch.Tensor, awq: bool, zero_offset: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) in x's dtype, W of an AWQ (`awq`) or GPTQ layer (module docstring).
    group_index's values must lie in [0, groups): not checked, which would wait on the device."""
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-d int32 tensor, got {t.dtype} {list(t.shape)}")
    k, n = (qweight.shape[0], qweight.shape[1] * 8) if awq else (qweight.shape[0] * 8, qweight.shape[1])
    groups = scales.shape[0] if scales.dim() == 2 else -1
    if not scales.is_floating_point() or tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"scales {scales.dtype} {list(scales.shape)} and qzeros {list(qzeros.shape)} must be a float "
                         f"[groups, {n}] and [groups, {n // 8}] for a {'AWQ' if awq else 'GPTQ'} weight [{n}, {k}]")
    if group_index.dtype not in (torch.int32, torch.int64) or tuple(group_index.shape) != (k,):
        raise ValueError(f"group_index must be an integer [{k}], got {group_index.dtype} {list(group_index.shape)}")
    x2, out, bias = _prepare(x, k, n, bias)
    qweight, qzeros, scales = qweight.contiguous(), qzeros.contiguous(), scales.contiguous()
    if x2.shape[0]:
        _launch(_int4_linear_kernel, x2, (qweight, qzeros, scales, group_index.to(torch.int32).contiguous()), bias,
                out, (k, int(zero_offset), x2.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0),
                      out.stride(0)), _tiles(x2.shape[0], x.dtype, 64), AWQ=bool(awq))
    return out.view(*x.shape[:-1], n)

"""The mixture-of-experts layer's experts as Triton kernels on CUDA: `fused_moe`, the GPU twin of
`moe.grouped_experts_torch` (same contract; `moe.run_experts` calls it for CUDA tensors).

Three steps, none of which waits on the GPU (no `.item()`, so a decode step can be captured in a
CUDA graph):
1. `moe_align_block_size` (torch): the `tokens * top_k` (token, slot) pairs, each named by its
   pair id `token * top_k + slot`, sorted by expert (stably: ascending pair ids within an
   expert) and padded so each expert's run is a multiple of `BLOCK_M`; the expert of each block
   of `BLOCK_M` sorted entries; the number of valid padded entries. Padding entries hold the
   pair id `tokens * top_k` (one past the last), which the kernel masks. The buffers are sized
   for the worst case (every chosen expert's run padded by `BLOCK_M - 1`), so their size depends
   only on the shapes; blocks past the valid end have expert -1 and their programs return.
2. `_moe_gemm_kernel`, a grouped GEMM: program (m, n) takes block m of the sorted pairs and
   `BLOCK_N` output columns, reads its A rows through the pair ids (row `pair // TOP_K`: the
   token for x, the pair itself for the intermediate), multiplies them by the block's expert's
   weight `[N, K]` (transposed), in fp32, adds the expert's bias, and writes the rows of its
   output indexed by pair id (every pair is in exactly one block, so every row is written once).
   It runs twice:
   - gate_up with the activation fused in its epilogue (`ACTIVATION`): each program multiplies
     the A tile by both the gate rows `[n, n + BLOCK_N)` and the up rows `inter + [n, ...)` of
     `W_gate_up[e]`, so the `[pairs, 2 * inter]` projection never reaches memory; out
     `[pairs, inter]`;
   - down (`MUL_WEIGHT`): `h @ W_down[e]^T + b`, times the pair's routing weight; out
     `[pairs, hidden]`.
3. each token's `top_k` rows summed (torch). The reference adds a token's experts in ascending
   expert id; this adds its slots in order, so float sums can differ in the last bits.

Rounding follows the reference where it is cheap: the projections (with bias) are rounded to the
activation dtype before the activation, the activation's first factor before its product (as
torch's `silu(gate) * up` does), the down projection before its routing weight, and the weight
itself to the activation dtype. fp32 inputs get exact fp32 products (`input_precision="ieee"`,
not TF32); 16-bit ones the tensor cores' fp32 accumulation. Runs on CPU tensors under
`TRITON_INTERPRET=1`, which is how CI tests it (tests/engine/test_triton_moe.py); the launches
are compiled for sm_80 and sm_90 by tests/engine/test_triton_compile.py.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.model.moe import ExpertWeights

# ExpertActivation.kind -> the kernel's ACTIVATION (0: none, the down projection)
ACTIVATIONS = {"silu": 1, "gelu_pytorch_tanh": 2, "clamped_swiglu": 3}
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # kernels may read only constexpr globals


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _activate(gate, up, alpha, limit, ty: tl.constexpr, ACTIVATION: tl.constexpr):
    """`ExpertActivation` on fp32 gate and up tiles (already rounded to `ty`): silu(gate) * up,
    gelu_tanh(gate) * up, or gpt-oss's (clamp(up) + 1) * (g * sigmoid(alpha * g)), g = min(gate,
    limit). One return per constexpr branch (their values' types differ between branches)."""
    if ACTIVATION == 1:
        out = (gate * _sigmoid(gate)).to(ty).to(tl.float32) * up
    elif ACTIVATION == 2:
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        tanh = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))  # +-1 at the extremes (exp: inf or 0)
        out = (0.5 * gate * (1.0 + tanh)).to(ty).to(tl.float32) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate * _sigmoid(gate * alpha))
    return out


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, bias_ptr, weights_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, num_m_blocks, N, K, alpha, limit,
    stride_a_row, stride_b_expert, stride_b_row, stride_bias_expert, stride_out_row,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[pair, n] = act(A[pair // TOP_K] @ B[e, n]^T + bias[e, n]) (* weight[pair]) over the
    sorted pairs of one block (module docstring). With ACTIVATION, B holds 2N rows (gate, then
    up) and both halves are multiplied; A and B have unit stride along K."""
    # block-grouped order (as Triton's matmul tutorial): GROUP_M consecutive m-blocks share
    # each N tile of their (often one) expert's weight while it is hot in L2
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n_blocks
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    rows = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a_row + ks[None, :]
    b_ptrs = b_ptr + expert * stride_b_expert + cols[None, :] * stride_b_row + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ACTIVATION != 0:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = ks < K - k * BLOCK_K
        a = tl.load(a_ptrs + k * BLOCK_K, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & col_mask[None, :]
        b = tl.load(b_ptrs + k * BLOCK_K, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if ACTIVATION != 0:
            b_up = tl.load(b_ptrs + N * stride_b_row + k * BLOCK_K, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)

    ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_expert + cols
        acc += tl.load(bias_row, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION != 0:
            acc_up += tl.load(bias_row + N, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION != 0:
        acc = _activate(acc.to(ty).to(tl.float32), acc_up.to(ty).to(tl.float32), alpha, limit, ty, ACTIVATION)
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(ty).to(tl.float32)
        acc = acc.to(ty).to(tl.float32) * weight[:, None]
    dst = out_ptr + pairs.to(tl.int64)[:, None] * stride_out_row + cols[None, :]
    tl.store(dst, acc.to(ty), mask=row_mask[:, None] & col_mask[None, :])


class MoEConfig(NamedTuple):
    """A launch's tiles: BLOCK_M sorted pairs (also the alignment's padding unit) x BLOCK_N output
    columns, BLOCK_K along the reduction; GROUP_M m-blocks per group of the program order."""

    block_m: int
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    group_m: int = 8


def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoEConfig:
    """Decode-sized batches (up to ~16 pairs per expert on average) take 16-row blocks, which pad
    an expert's few pairs least; more pairs take 64-row blocks, which read each expert's weight a
    quarter as often. fp32 (exact fp32 products, no tensor cores) keeps K tiles of 32."""
    block_k = 32 if dtype == torch.float32 else 64
    if num_pairs <= 16 * num_experts:
        return MoEConfig(block_m=16, block_n=64, block_k=block_k)
    return MoEConfig(block_m=64, block_n=64, block_k=block_k)


def moe_align_block_size(experts: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts `[tokens, top_k]` -> (sorted_ids int32 `[blocks * block_m]`: pair ids grouped by
    expert, ascending within one, each expert's run padded to a multiple of `block_m` with the
    id `tokens * top_k`; block_experts int32 `[blocks]`: each block's expert, -1 past the valid
    end; num_padded int32 `[1]`: the valid entries, padding included). `blocks` is the worst
    case's, a function of the shapes alone; nothing here waits on the device."""
    flat = experts.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    max_padded = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    num_blocks = triton.cdiv(max_padded, block_m)
    ids = flat.long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(ids, stable=True)
    sorted_experts = ids.index_select(0, order)
    # a pair's position: its expert's padded start + its rank among the expert's pairs
    position = (padded_end - padded - (counts.cumsum(0) - counts)).index_select(0, sorted_experts)
    position += torch.arange(num_pairs, device=device)
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, position, order.to(torch.int32))
    block_starts = torch.arange(0, num_blocks * block_m, block_m, device=device)
    num_padded = padded_end[-1:]
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = torch.where(block_starts < num_padded, block_experts, -1).to(torch.int32)
    return sorted_ids, block_experts, num_padded.to(torch.int32)


def _dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs get exact fp32 products (not TF32); 16-bit inputs the target's default."""
    return "ieee" if dtype == torch.float32 else None


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _moe_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor,
              out: torch.Tensor, aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_pairs: int,
              top_k: int, activation: int, alpha: float, limit: float, mul_weight: bool, config: MoEConfig) -> None:
    sorted_ids, block_experts, num_padded = aligned
    b, n_cols, k = _unit_last(b), out.shape[1], a.shape[1]
    bias = None if bias is None else _unit_last(bias)
    num_m_blocks = block_experts.shape[0]
    grid = (num_m_blocks * triton.cdiv(n_cols, config.block_n),)
    _moe_gemm_kernel[grid](
        a, b, b if bias is None else bias, weights, out, sorted_ids, block_experts, num_padded,
        num_pairs, num_m_blocks, n_cols, k, alpha, limit,
        a.stride(0), b.stride(0), b.stride(1), 0 if bias is None else bias.stride(0), out.stride(0),
        TOP_K=top_k, HAS_BIAS=bias is not None, MUL_WEIGHT=mul_weight, ACTIVATION=activation,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        DOT_PRECISION=_dot_precision(a.dtype), num_warps=config.num_warps,
    )


def fused_moe(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w: ExpertWeights,
              config: MoEConfig | None = None) -> torch.Tensor:
    """`moe.grouped_experts_torch`'s contract: x `[tokens, hidden]`, weights and experts
    `[tokens, top_k]` -> each token's `sum_k weights[t, k] * expert[experts[t, k]](x[t])`,
    `[tokens, hidden]` in x's dtype (the experts' weights and biases in it too). `config`
    overrides `moe_config`'s tiles (tests)."""
    tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_experts, two_inter, _ = w.gate_up.shape
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    kind = w.activation.kind
    if kind not in ACTIVATIONS:
        raise ValueError(f"no Triton MoE kernel for the activation {kind!r}")
    config = config or moe_config(num_pairs, num_experts, x.dtype)
    aligned = moe_align_block_size(experts, num_experts, config.block_m)
    x = _unit_last(x)
    weights = weights.reshape(-1)  # by pair id
    act = torch.empty(num_pairs, two_inter // 2, dtype=x.dtype, device=x.device)
    _moe_gemm(x, w.gate_up, w.gate_up_bias, weights, act, aligned, num_pairs, top_k, ACTIVATIONS[kind],
              float(w.activation.alpha), float(w.activation.limit), False, config)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm(act, w.down, w.down_bias, weights, out, aligned, num_pairs, 1, 0, 0.0, 0.0, True, config)
    return out.view(tokens, top_k, hidden).sum(dim=1)

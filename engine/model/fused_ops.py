"""The Llama block's elementwise ops, fused into one-pass kernels, and its linear layers on CPU
(a native kernel for decode steps; above, pre-blocked bf16 weights with AVX512-BF16, fp32
compute without it).

Each function here is the torch expression the model has always used (the same ones transformers
uses, rounding included), and takes the one-pass kernel from `engine/csrc/fused_ops_cpu.cpp`
when the activation is a bf16 or float32 CPU tensor and the kernels are built (AVX2 or AVX-512),
or from `engine/model/triton_ops.py` when it is a bf16/fp16 CUDA tensor. RoPE and the SiLU-and-mul
product are bit-identical to the torch path; RMSNorm's sum of squares and SiLU's exp are
evaluated differently and can move a value by one ulp of the dtype (tests/engine/test_fused_ops.py).
float32 linear layers take a native fp32 kernel up to 64 rows (decode steps: 1.4-4.7x MKL's sgemm
on 2 AVX2 cores, sums in another order, so a few float32 ulps from F.linear).
`PDSERVE_FUSED_OPS=0` keeps every torch expression (and F.linear) where the kernels would apply.
"""
from __future__ import annotations

import functools
import os

import torch
from torch.nn import functional as F

from engine import cpu_kernels


@functools.lru_cache(maxsize=1)
def _library():
    """The native CPU kernels, or None (not built here, or `PDSERVE_FUSED_OPS=0`)."""
    if os.environ.get("PDSERVE_FUSED_OPS", "1") == "0":
        return None
    return cpu_kernels.load()


@functools.lru_cache(maxsize=1)
def _kernels():
    """The library where its fused ops are compiled in (AVX2 or AVX-512), else None."""
    kernels = _library()
    return kernels if kernels is not None and kernels.has_fused_ops() else None


@functools.lru_cache(maxsize=1)
def _triton_kernels():
    if os.environ.get("PDSERVE_FUSED_OPS", "1") == "0":
        return None
    try:
        from engine.model import triton_ops
    except ImportError:  # a CUDA build of torch without Triton: the torch expressions
        return None
    return triton_ops


def native_for(x: torch.Tensor):
    """The kernels for activation `x` (native CPU ones for bf16 and float32 on CPU, Triton ones for
    bf16/fp16 on CUDA), or None: use the torch expression."""
    if x.device.type == "cpu":
        return _kernels() if x.dtype in (torch.bfloat16, torch.float32) else None
    if x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16):
        return _triton_kernels()
    return None


# Up to this many tokens a bf16 linear layer runs as the native small-batch kernel: decode steps,
# whose weights are cold in cache. Measured on a 2-core Zen 4, SmolLM2-135M decode steps at 512
# tokens of context: 1.15-1.5x faster at 1-16 sequences than the kernel's first version (1-4 rows,
# no prefetch) with oneDNN above, and 1.07-1.15x faster at 32-128 than oneDNN; per layer the kernel
# and oneDNN are even at 128-160 rows, and oneDNN is faster above (prefill chunks).
SMALL_LINEAR_MAX_ROWS = 128
# Where oneDNN's bf16 GEMM runs on AMX tiles it overtakes the kernel at a few rows. Measured on a
# 2-vCPU Xeon with AMX, 1 thread, one layer's four linear layers of SmolLM2-135M: the kernel
# 0.62x oneDNN's time at 1 row, 0.94x at 4, 1.9x at 8, 10.7x at 128. With 128 as the limit there,
# a 1024-token prefill in 128-token chunks took 3.0 s (0.95 s at 4) and decode steps at batch 16
# and 64 took 79 and 262 ms (56 and 115 ms at 4); batch 1 and 4 were the same either way.
SMALL_LINEAR_MAX_ROWS_AMX = 4


@functools.lru_cache(maxsize=1)
def small_linear_max_rows() -> int:
    """How many rows of a bf16 linear layer take the native kernel on a CPU with AVX512-BF16:
    SMALL_LINEAR_MAX_ROWS, or SMALL_LINEAR_MAX_ROWS_AMX where oneDNN can use AMX."""
    return SMALL_LINEAR_MAX_ROWS_AMX if _amx_usable() else SMALL_LINEAR_MAX_ROWS


def _amx_usable() -> bool:
    """Whether this process may run AMX tiles (the CPU has them and the OS grants them): then
    oneDNN's bf16 GEMM uses them."""
    try:
        return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
    except AttributeError:  # a torch without these (private) probes: trust the CPU's flags
        return "amx_bf16" in cpu_kernels.cpu_features()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear. For 1-64 float32 rows the native fp32 kernel (AVX2 or AVX-512; see
    SMALL_LINEAR_F32_MAX_ROWS), 1-16 when `packed` is given (PACKED_F32_MIN_ROWS), and oneDNN on the
    pre-blocked copy above. For 1-128 bf16 rows (a decode step; 1-4 with AMX: see
    `small_linear_max_rows`) the native kernel, which streams the weights, cold in cache at every
    decode step, with prefetching (1.1-1.8x oneDNN there) (engine/csrc/small_linear_cpu.cpp); for more rows, with
    `packed` (`prepack_linear_weight(weight)`), oneDNN on its pre-blocked copy of the weight. On CPUs
    without AVX512-BF16, bf16 is computed in fp32 (see BF16_WIDENED_KERNEL_MAX_ROWS)."""
    if (x.dtype is torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and 1 <= x.shape[0] < (PACKED_F32_MIN_ROWS if packed is not None else SMALL_LINEAR_F32_MAX_ROWS + 1)
            and x.shape[1] % 16 == 0 and x.stride(1) == 1
            and weight.dtype is torch.float32 and weight.is_contiguous()
            and (bias is None or bias.dtype is torch.float32) and _small_linear_f32()):
        return _library().small_batch_linear_f32(x, weight, bias)
    native = native_for(x) if x.device.type == "cpu" else None
    if (native is not None and x.dim() == 2 and x.shape[0] >= 1 and x.shape[1] % 32 == 0 and x.stride(1) == 1
            and weight.dtype is torch.bfloat16 and weight.is_contiguous()
            and (bias is None or bias.dtype is torch.bfloat16) and _small_linear()):
        widened = bf16_computed_in_fp32()
        if x.shape[0] <= (BF16_WIDENED_KERNEL_MAX_ROWS if widened else small_linear_max_rows()):
            return native.small_batch_linear(x, weight, bias)
        if widened:  # no bf16 arithmetic here: oneDNN's bf16 GEMM is the slowest way
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    if packed is not None and x.dtype is weight.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


# Batch size oneDNN picks the packed layout for; decode batches and prefill chunks both run near
# its best with this one (measured 8 to 2048 rows).
_PACK_BATCH_HINT = 128


def prepack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a bf16 or float32 CPU linear weight [N, K], for `linear(...,
    packed=)`; None where it does not apply (other devices and dtypes, no oneDNN, bf16 on a CPU
    without AVX512-BF16, `PDSERVE_PREPACK_WEIGHTS=0`).

    F.linear hands oneDNN the plain weight, which it re-blocks on every call: a full extra pass
    over weights that do not fit in cache. With the copy made once, a bf16 linear layer runs
    1.2-2x faster at 8-256 rows and ~5% faster at 2048 (2-core Zen 4), with bit-identical results
    (both are oneDNN's bf16 GEMM). In float32 oneDNN on the blocked copy is 1.13-1.15x MKL's sgemm
    (F.linear) at 64-2048 rows and ~1.15x the native kernel at 64 (see PACKED_F32_MIN_ROWS); its
    sums run in another order, a few ulps from F.linear. The cost is a second copy of the weights
    in memory (`DecoderForCausalLM.weight_bytes` counts it); the plain one stays for the small-batch
    kernel.
    """
    if (weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2
            or os.environ.get("PDSERVE_PREPACK_WEIGHTS", "1") == "0" or not torch.backends.mkldnn.is_available()):
        return None
    if weight.dtype is torch.bfloat16 and bf16_computed_in_fp32():  # linear() never uses oneDNN for bf16 here
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without the op: plain F.linear
        return None


# float32 rows up to this many take the native fp32 kernel (AVX2 or AVX-512). Measured on the
# 2-vCPU AMD EPYC (AVX2), weights cold in cache, SmolLM2-135M's gate|up, down and LM head: at 2
# threads 1.4-4.7x MKL's sgemm at 4-64 rows (sgemm moved the weights at 1.5-5 GB/s there); at 1
# thread 1.8-2.3x at 4 rows, 1.0-1.5x at 32, 0.8-1.2x at 64. Above 64 sgemm is the better one.
SMALL_LINEAR_F32_MAX_ROWS = 64
# With a pre-blocked float32 weight, oneDNN takes over from the native kernel at this many rows.
# Measured on the 2-vCPU Zen 4, SmolLM2-135M decode steps at 256-400 tokens of context, both ways
# interleaved in one process: 1 and 4 sequences 23 / 21 ms with the kernel, 33 / 26 ms with oneDNN;
# 16 even (52-56 ms); 64 sequences 138-154 ms with oneDNN from 9 or 17 rows, 150-189 ms without.
PACKED_F32_MIN_ROWS = 17


@functools.lru_cache(maxsize=1)
def _small_linear_f32() -> bool:
    kernels = _library()
    return kernels is not None and kernels.has_small_linear_f32()


@functools.lru_cache(maxsize=1)
def _small_linear() -> bool:
    kernels = _kernels()
    return kernels is not None and kernels.has_small_linear()


def bf16_computed_in_fp32() -> bool:
    """Whether bf16 linear layers on this CPU run through the native kernels that widen bf16 to
    fp32 (built, no AVX512-BF16): bf16 is then fast without native bf16 arithmetic."""
    return _small_linear() and not _bf16_dot()


@functools.lru_cache(maxsize=1)
def _bf16_dot() -> bool:
    """Whether the bf16 kernel multiplies in bf16 (AVX512-BF16); else it widens to fp32 (AVX2)."""
    return _small_linear() and _kernels().small_linear_bf16_dot()


# Without AVX512-BF16 (the bf16 kernel widens W to fp32 as it streams it) bf16 linear layers take
# the kernel up to this many rows and, above, an fp32 sgemm on widened copies of x and W; never
# oneDNN's bf16 GEMM, which there took 2.9x (1 row) to 5.1x (256 rows) the kernel's time, and
# 1.2-4.4x float32 sgemm's. Measured on the 2-vCPU AMD EPYC (AVX2), 2 threads, SmolLM2-135M's
# linear layers: the kernel ran at ~100 GFLOP/s at 64-1024 rows; widen + sgemm at 55 / 76 / 101 /
# 117 / 127 GFLOP/s at 64 / 128 / 256 / 512 / 1024 rows.
BF16_WIDENED_KERNEL_MAX_ROWS = 256


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalize(x), with fp32 statistics (as transformers computes them)."""
    native = native_for(x)
    if native is not None and weight.dtype is x.dtype and weight.is_contiguous() and x.dim() == 2 and x.stride(1) == 1:
        return native.rms_norm(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`residual += x` in place (the block's residual stream), then rms_norm of the sum."""
    native = native_for(x)
    if (native is not None and weight.dtype is x.dtype and residual.dtype is x.dtype and weight.is_contiguous()
            and x.dim() == 2 and x.stride(1) == 1 and residual.stride(1) == 1):
        return native.add_rms_norm_(x, residual, weight, eps)
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused gate|up projection's output [T, 2 * intermediate]."""
    native = native_for(gate_up)
    if native is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return native.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for the fused gate|up output (Gemma's GeGLU MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE: query [T, Hq, D], key [T, Hk, D] -> rotated copies (cos/sin: fp32 tables)."""
    native = native_for(query)
    if (native is not None and key.dtype is query.dtype and cos_cache.dtype is torch.float32
            and query.shape[-1] % (32 if query.device.type == "cpu" else 2) == 0
            and query.stride(-1) == 1 and key.stride(-1) == 1
            and positions.dtype is torch.int64 and positions.is_contiguous() and cos_cache.is_contiguous()
            and sin_cache.is_contiguous() and sin_cache.shape == cos_cache.shape):
        q, k = native.rotary_embedding(positions, query, key, cos_cache, sin_cache)
        return q, k
    cos = cos_cache.index_select(0, positions).to(query.dtype)[:, None, :]
    sin = sin_cache.index_select(0, positions).to(query.dtype)[:, None, :]
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

"""The Triton elementwise kernels (engine/model/triton_ops.py) against the torch expressions of
engine/model/fused_ops.py they replace on CUDA.

Without CUDA they run under `TRITON_INTERPRET=1` on CPU tensors, with CUDA on the GPU (where
`fused_ops` must dispatch 16-bit activations to them). RoPE and the residual add must be
bit-identical; RMSNorm and SiLU-and-mul within one ulp of the 16-bit dtype.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.model import fused_ops  # noqa: E402
from engine.model import triton_ops  # noqa: E402

DEVICES = ["cpu"] if not torch.cuda.is_available() else ["cuda"]
# The interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest even), so bf16 is
# only checked on a GPU; fp16 casts go through numpy, which rounds as the GPU does.
DTYPES = [torch.float16] if not torch.cuda.is_available() else [torch.bfloat16, torch.float16]


@pytest.fixture
def torch_expressions(monkeypatch):
    """fused_ops with every kernel turned off: the reference torch expressions."""
    monkeypatch.setattr(fused_ops, "native_for", lambda x: None)
    return fused_ops


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_ops_dispatch_16_bit_cuda_activations_here():
    for dtype in (torch.bfloat16, torch.float16):
        assert fused_ops.native_for(torch.empty(1, dtype=dtype, device="cuda")) is triton_ops
    assert fused_ops.native_for(torch.empty(1, dtype=torch.float32, device="cuda")) is None


def _rand(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _within_one_ulp(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    a, b = ours.float().cpu(), ref.float().cpu()
    ulp = torch.finfo(ref.dtype).eps * torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(ref.dtype).tiny)
    assert bool(((a - b).abs() <= ulp * 1.01).all()), (a - b).abs().max()
    assert (a == b).float().mean() > 0.95  # rarely off at all


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm(device, dtype, hidden, torch_expressions):
    x = _rand(7, hidden, dtype=dtype, device=device, seed=1, scale=3.0)
    weight = _rand(hidden, dtype=dtype, device=device, seed=2)
    ours = triton_ops.rms_norm(x, weight, 1e-5)
    _within_one_ulp(ours, torch_expressions.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_exactly(device, dtype, torch_expressions):
    x = _rand(5, 576, dtype=dtype, device=device, seed=3)
    residual = _rand(5, 576, dtype=dtype, device=device, seed=4, scale=2.0)
    weight = _rand(576, dtype=dtype, device=device, seed=5)
    ref_residual = residual.clone()
    ref = torch_expressions.add_rms_norm_(x, ref_residual, weight, 1e-5)
    ours = triton_ops.add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(residual, ref_residual)
    _within_one_ulp(ours, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [1536, 1000])
def test_silu_and_mul(device, dtype, intermediate, torch_expressions):
    gate_up = _rand(6, 2 * intermediate, dtype=dtype, device=device, seed=6, scale=2.0)
    _within_one_ulp(triton_ops.silu_and_mul(gate_up), torch_expressions.silu_and_mul(gate_up))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (5, 1, 80)])
def test_rotary_is_bit_identical_on_strided_views(device, dtype, heads, kv_heads, head_dim, torch_expressions):
    from engine.model.rope import RotaryEmbedding
    tokens = 11
    rope = RotaryEmbedding(head_dim, 4096, 100000.0, None).to(device)
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device, seed=7)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # strided views, as the model has them
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 512, 1000, 2047, 3000, 4095], device=device)
    q_ref, k_ref = torch_expressions.rotary(positions, q, k, rope.cos_cache, rope.sin_cache)
    q_ours, k_ours = triton_ops.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache)
    assert torch.equal(q_ours, q_ref) and torch.equal(k_ours, k_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches(device):
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    weight = torch.ones(64, dtype=torch.bfloat16, device=device)
    assert triton_ops.rms_norm(x, weight, 1e-5).shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128, dtype=torch.bfloat16, device=device)).shape == (0, 64)

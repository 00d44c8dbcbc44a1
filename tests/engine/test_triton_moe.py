"""The Triton fused-MoE kernel (engine/model/triton_moe.py `fused_moe`) against its reference,
`moe.grouped_experts_torch`, and its alignment step (`moe_align_block_size`) checked directly.

Routings: tokens spread over every expert, some experts chosen by no token, every token to one
expert (several blocks of one expert, the last one padded), a single token (a decode step); 16-
and 64-row blocks, token counts above the block and not a multiple of it, hidden and
intermediate sizes that leave partial K tiles; with and without biases; each activation.
Without CUDA the kernels run under `TRITON_INTERPRET=1` on CPU tensors, so the shapes are tiny
and the dtypes float32 (and fp16; the interpreter's bf16 is not the GPU's); with CUDA on the GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.model.moe import ExpertActivation, ExpertWeights, grouped_experts_torch, run_experts  # noqa: E402
from engine.model.triton_moe import MoEConfig, fused_moe, moe_align_block_size  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS, HIDDEN, INTER = 8, 48, 40  # 48 and 40: partial K tiles of 32 in both projections
SMALL, LARGE = MoEConfig(block_m=16, block_n=32, block_k=32), MoEConfig(block_m=64, block_n=64, block_k=32)
ACTIVATIONS = {"silu": ExpertActivation("silu"), "gelu_pytorch_tanh": ExpertActivation("gelu_pytorch_tanh"),
               "clamped_swiglu": ExpertActivation("clamped_swiglu", alpha=1.702, limit=0.6)}


def _routing(kind: str, tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [tokens, top_k] summing to 1, experts int64 [tokens, top_k], distinct per token)."""
    g = torch.Generator().manual_seed(seed)
    pool = {"spread": EXPERTS, "some-unused": 3, "all-to-one": EXPERTS}[kind]
    experts = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(tokens)])
    if kind == "some-unused":  # experts 1, 4, 6 only
        experts = torch.tensor([1, 4, 6])[experts]
    if kind == "all-to-one":  # expert 5 in every token's first slot, the others elsewhere
        experts = torch.where(experts == 5, experts[:, :1], experts)
        experts[:, 0] = 5
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return weights / weights.sum(dim=1, keepdim=True), experts


def _weights(activation: str, bias: bool, dtype: torch.dtype, seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    return ExpertWeights(rand(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN ** -0.5),
                         rand(EXPERTS, HIDDEN, INTER, scale=INTER ** -0.5),
                         rand(EXPERTS, 2 * INTER, scale=0.5) if bias else None,
                         rand(EXPERTS, HIDDEN, scale=0.5) if bias else None, ACTIVATIONS[activation])


def _check(tokens: int, top_k: int, routing: str, activation: str, bias: bool, config: MoEConfig | None,
           dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    weights, experts = _routing(routing, tokens, top_k, seed)
    if routing == "spread" and tokens * top_k >= EXPERTS:
        assert set(experts.flatten().tolist()) == set(range(EXPERTS))
    w = _weights(activation, bias, dtype, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype).to(DEVICE)
    weights, experts = weights.to(DEVICE), experts.to(DEVICE)
    ours = fused_moe(x, weights, experts, w, config)
    assert ours.shape == x.shape and ours.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(ours, grouped_experts_torch(x, weights, experts, w), rtol=1e-5, atol=1e-5)
    else:  # 16-bit: against the float32 reference over the same (rounded) inputs
        tensors = (w.gate_up, w.down, w.gate_up_bias, w.down_bias)
        w32 = ExpertWeights(*(None if t is None else t.float() for t in tensors), w.activation)
        reference = grouped_experts_torch(x.float(), weights, experts, w32)
        torch.testing.assert_close(ours.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens,block_m", [(1, 16), (37, 16), (37, 64), (100, 64)])
@pytest.mark.parametrize("routing", ["spread", "some-unused", "all-to-one"])
@pytest.mark.parametrize("top_k", [1, 3])
def test_alignment_groups_every_pair_once_in_single_expert_padded_blocks(tokens, block_m, routing, top_k):
    _, experts = _routing(routing, tokens, top_k, seed=tokens + top_k)
    sorted_ids, block_experts, num_padded = moe_align_block_size(experts.to(DEVICE), EXPERTS, block_m)
    sorted_ids, block_experts, valid = sorted_ids.cpu(), block_experts.cpu(), int(num_padded.item())
    pairs, flat = tokens * top_k, experts.flatten()
    counts = torch.bincount(flat, minlength=EXPERTS)
    assert sorted_ids.dtype == block_experts.dtype == num_padded.dtype == torch.int32
    # sized by the shapes alone: the worst case's blocks
    assert sorted_ids.numel() == block_experts.numel() * block_m >= pairs + min(pairs, EXPERTS) * (block_m - 1)
    assert valid == sum(-(-int(c) // block_m) * block_m for c in counts)
    assert valid % block_m == 0
    # every pair exactly once, in the valid part; everything else the padding id
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    assert bool((sorted_ids[valid:] == pairs).all()) and bool((sorted_ids[:valid] <= pairs).all())
    # blocks: one expert each, experts in ascending order, one run of ceil(count / block_m) blocks each
    blocks = block_experts[:valid // block_m]
    assert bool((block_experts[valid // block_m:] == -1).all())
    assert torch.equal(blocks, torch.repeat_interleave(torch.arange(EXPERTS), -(-counts // block_m)).to(torch.int32))
    for b, expert in enumerate(blocks.tolist()):
        ids = sorted_ids[b * block_m:(b + 1) * block_m]
        held = ids[ids < pairs].long()
        assert bool((flat[held] == expert).all())
        assert held.tolist() == sorted(held.tolist())  # stable: ascending pair ids
        # padding only at the end of an expert's last block
        assert bool((ids[:held.numel()] < pairs).all()) and bool((ids[held.numel():] == pairs).all())


@pytest.mark.parametrize("routing", ["spread", "some-unused", "all-to-one"])
@pytest.mark.parametrize("tokens,top_k,config", [(1, 2, SMALL), (37, 2, SMALL), (37, 1, SMALL), (37, 3, LARGE),
                                                 (100, 2, LARGE)])
def test_fused_moe_matches_the_reference(routing, tokens, top_k, config):
    _check(tokens, top_k, routing, "silu", bias=False, config=config)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [False, True])
def test_each_activation_with_and_without_biases(activation, bias):
    _check(21, 2, "spread", activation, bias, SMALL, seed=3)


@pytest.mark.parametrize("tokens", [1, 40])
def test_default_config(tokens):
    """`moe_config`'s choice (16-row blocks for both here: at most 16 pairs per expert)."""
    _check(tokens, 2, "spread", "clamped_swiglu", True, None, seed=tokens)


@pytest.mark.parametrize("activation", ["silu", "clamped_swiglu"])
def test_fp16(activation):
    _check(19, 2, "spread", activation, activation == "clamped_swiglu", SMALL, dtype=torch.float16, seed=5)


def test_no_tokens():
    w = _weights("silu", False, torch.float32, 0)
    out = fused_moe(torch.zeros(0, HIDDEN, device=DEVICE), torch.zeros(0, 2, device=DEVICE),
                    torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), w)
    assert out.shape == (0, HIDDEN)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_run_experts_takes_the_kernel_on_cuda(dtype, monkeypatch):
    from engine.model import triton_moe
    calls = []
    monkeypatch.setattr(triton_moe, "fused_moe", lambda *args: calls.append(1) or fused_moe(*args))
    weights, experts = _routing("spread", 24, 2, seed=7)
    w = _weights("silu", True, dtype, seed=8)
    x = torch.randn(24, HIDDEN).to(dtype).to(DEVICE)
    ours = run_experts(x, weights.to(DEVICE), experts.to(DEVICE), w)
    assert calls
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours, grouped_experts_torch(x, weights.to(DEVICE), experts.to(DEVICE), w),
                               rtol=tolerance, atol=tolerance)

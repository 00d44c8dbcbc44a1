"""The native mixture-of-experts kernel (engine/csrc/moe_cpu.cpp `moe_experts`) against the torch
reference `grouped_experts_torch`: tokens routed to every expert, to none of some, all to one, a
token naming one expert twice, batch 1 and the kernel's largest batch, with and without biases,
each activation, float32 and bf16; and `run_experts` taking it for a CPU decode batch (and the
reference above the kernel's bound)."""
from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from engine import cpu_kernels
from engine.model import fused_ops
from engine.model.moe import ExpertActivation, ExpertWeights, grouped_experts_torch, run_experts

BF16 = torch.bfloat16
ACTIVATIONS = {"silu": ExpertActivation("silu"), "gelu_pytorch_tanh": ExpertActivation("gelu_pytorch_tanh"),
               "clamped_swiglu": ExpertActivation("clamped_swiglu", alpha=1.702, limit=1.5)}


@pytest.fixture(scope="module")
def native():
    """The kernels module with `moe_experts`; it must have built wherever a C++ compiler exists
    (AVX-512 builds report it absent until their 16-lane path has run on an AVX-512 machine: there
    `make test`'s second run, PDSERVE_CPU_ISA=avx2, tests the 8-lane path)."""
    module = fused_ops._kernels()
    if module is None or not module.has_moe_experts():
        features = set(cpu_kernels.cpu_features())
        if module is not None and cpu_kernels.isa() == "native" and "avx512f" in features:
            pytest.skip("AVX-512 build: moe_experts reports itself absent (PDSERVE_CPU_ISA=avx2 tests it here)")
        simd = "avx512f" in features or {"avx2", "fma", "f16c"} <= features
        if shutil.which("c++") and importlib.util.find_spec("ninja") and simd:
            pytest.fail("the native MoE kernel did not build although a compiler and AVX2 + FMA are present")
        pytest.skip("no compiler or no AVX2 + FMA: run_experts keeps the torch reference")
    return module


def _experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, bias: bool, act: str,
             seed: int = 0) -> ExpertWeights:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    return ExpertWeights(randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5),
                         randn(num_experts, hidden, inter, scale=inter ** -0.5),
                         randn(num_experts, 2 * inter) if bias else None, randn(num_experts, hidden) if bias else None,
                         ACTIVATIONS[act])


def _routing(tokens: int, num_experts: int, top_k: int, kind: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] float32, experts [tokens, top_k] int64), as a softmax router gives them."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=generator)
    if kind == "none-to-some":  # only the first half of the experts can win
        logits[:, num_experts // 2:] = -30.0
    if kind == "all-to-one":  # expert 3 is every token's first
        logits[:, 3] = 30.0
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if kind == "repeated":  # a token naming one expert twice: both pairs count, as in the reference
        experts[:, 1] = experts[:, 0]
    return weights, experts


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within ~1e-5 of the outputs' scale (the activations' exp/tanh differ by ulps); bf16:
    within two bf16 rounding steps of the largest output (an intermediate rounded the other way)."""
    assert got.dtype is want.dtype and got.shape == want.shape
    scale = float(want.float().abs().max()) or 1.0
    step = 2.0 ** -7 if want.dtype is BF16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * step, atol=2 * step * scale)


def _kernel(native, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    return native.moe_experts(x, weights, experts, w.gate_up, w.down, w.gate_up_bias, w.down_bias,
                              w.activation.kind, w.activation.alpha, w.activation.limit)


CASES = [  # (routing, tokens, experts, top_k)
    ("spread", 24, 4, 2),          # every expert chosen
    ("none-to-some", 16, 8, 2),    # experts 4-7 chosen by no token
    ("all-to-one", 12, 4, 2),      # every token's first expert is expert 3
    ("one-token", 1, 8, 2),        # a decode step of one sequence
    ("max-batch", 64, 8, 4),       # the kernel's largest batch
    ("repeated", 5, 4, 2),         # a token naming one expert twice
]


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("routing,tokens,num_experts,top_k", CASES, ids=[case[0] for case in CASES])
def test_kernel_matches_the_reference(native, dtype, act, bias, routing, tokens, num_experts, top_k):
    hidden, inter = (44, 36) if routing == "spread" else (64, 32)  # spread: rows end in a partial vector
    w = _experts(num_experts, hidden, inter, dtype, bias, act)
    kind = "spread" if routing in ("one-token", "max-batch") else routing
    weights, experts = _routing(tokens, num_experts, top_k, kind)
    if routing == "spread":
        assert set(experts.flatten().tolist()) == set(range(num_experts))
    if routing == "none-to-some":
        assert experts.max() < num_experts // 2
    if routing == "all-to-one":
        assert (experts[:, 0] == 3).all()
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    _close(_kernel(native, x, weights, experts, w), grouped_experts_torch(x, weights, experts, w))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 64])
def test_kernel_matches_the_reference_on_threads(native, dtype, tokens):
    """Experts large enough that both phases split over threads (the small cases run on one)."""
    w = _experts(8, 256, 128, dtype, True, "clamped_swiglu")
    weights, experts = _routing(tokens, 8, 2, "spread")
    x = torch.randn(tokens, 256).to(dtype)
    _close(_kernel(native, x, weights, experts, w), grouped_experts_torch(x, weights, experts, w))


def test_float32_swiglu_is_bit_identical_to_the_reference(native):
    """With K a multiple of 16 the reference's linear layers run the native fp32 small-batch kernel,
    whose sums the MoE kernel takes in the same order; SwiGLU is the same expression and the
    outputs are added in the same (ascending expert) order."""
    w = _experts(8, 64, 48, torch.float32, True, "silu")
    weights, experts = _routing(16, 8, 2, "spread")
    x = torch.randn(16, 64)
    assert torch.equal(_kernel(native, x, weights, experts, w), grouped_experts_torch(x, weights, experts, w))


def _ops_run(fn) -> set[str]:
    """The names of the ATen ops that `fn()` ran (torch's profiler)."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {event.name for event in prof.function_events}


def test_run_experts_takes_the_native_kernel_for_a_decode_batch(native):
    """Up to `moe_experts_max_tokens()` CPU tokens, run_experts returns the kernel's output bit for
    bit and runs none of the reference's ops (its sort by expert, its per-expert index_add_);
    above, it is the reference."""
    bound = native.moe_experts_max_tokens()
    assert bound == 64
    w = _experts(8, 64, 48, torch.float32, False, "gelu_pytorch_tanh")
    for tokens in (1, 16, bound):
        weights, experts = _routing(tokens, 8, 2, "spread")
        x = torch.randn(tokens, 64)
        assert torch.equal(run_experts(x, weights, experts, w), _kernel(native, x, weights, experts, w))
        ops = _ops_run(lambda: run_experts(x, weights, experts, w))
        assert not ops & {"aten::argsort", "aten::index_add_"}, ops
    weights, experts = _routing(bound + 1, 8, 2, "spread")
    x = torch.randn(bound + 1, 64)
    assert torch.equal(run_experts(x, weights, experts, w), grouped_experts_torch(x, weights, experts, w))
    assert {"aten::argsort", "aten::index_add_"} <= _ops_run(lambda: run_experts(x, weights, experts, w))


def test_kernel_refuses_bad_inputs(native):
    w = _experts(4, 32, 16, torch.float32, False, "silu")
    x = torch.randn(2, 32)
    weights, experts = _routing(2, 4, 2, "spread")
    with pytest.raises(RuntimeError, match="out of range"):
        _kernel(native, x, weights, experts + 4, w)
    with pytest.raises(RuntimeError, match="tokens"):
        _kernel(native, torch.randn(65, 32), *_routing(65, 4, 2, "spread"), w)
    with pytest.raises(RuntimeError, match="dtype"):
        _kernel(native, x.to(BF16), weights, experts, w)
    with pytest.raises(RuntimeError, match="unknown activation"):
        native.moe_experts(x, weights, experts, w.gate_up, w.down, None, None, "relu", 0.0, 0.0)

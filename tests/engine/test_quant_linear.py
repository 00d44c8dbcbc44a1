"""GGUF-quantized linear layers (engine/model/quant_linear.py, engine/csrc/gguf_linear_cpu.cpp)
against their reference: W dequantized by the `gguf` package (ggml's formulas), then F.linear.

Weights are quantized by the `gguf` package too (llama.cpp's reference quantizer), from random
floats with an offset per row, so a scale, a minimum or a nibble read from the wrong place shows.
The package has no k-quant quantizer: Q4_K, Q5_K and Q6_K blocks are random bytes with sane fp16 scales
(every byte pattern is a valid block), so each packed scale, min and bit is exercised.
Shapes are odd on purpose: out_features not a multiple of the kernel's tiles, in_features a
multiple of 32 but not of 256, row counts around the kernel's groups of four and on both sides
of DECODE_ROWS. `make test` runs this file again with PDSERVE_CPU_ISA=avx2 (the portable path)."""
from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels
from engine.model import quant_linear
from engine.model.quant_linear import (BLOCK_BYTES, BLOCK_WEIGHTS, DECODE_ROWS, GGML_TYPES, ConcatLinear, GGUFLinear, quantize,
                                       reference_dequantize, reference_linear)

TYPES = list(GGML_TYPES.items())


def width(ggml_type: int, in_features: int) -> int:
    """`in_features` for the 32-weight formats; eight times as many for the k-quants (256-weight
    blocks), so their rows are a few blocks long too."""
    return in_features * BLOCK_WEIGHTS.get(ggml_type, 32) // 32


def native():
    module = cpu_kernels.load()
    if module is None or not module.has_gguf_linear():
        pytest.skip("no native CPU kernels with the GGUF linear here (the reference path serves)")
    return module


def weights(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randn(out_features, 1, generator=generator)
    return torch.randn(out_features, in_features, generator=generator) * 0.5 + offsets


K_QUANT_SCALES = {GGML_TYPES["Q4_K"]: (0, 2), GGML_TYPES["Q5_K"]: (0, 2), GGML_TYPES["Q6_K"]: (208,)}  # byte offsets of fp16 scales


def packed_weights(out_features: int, in_features: int, ggml_type: int, seed: int) -> torch.Tensor:
    if ggml_type not in K_QUANT_SCALES:
        return quantize(weights(out_features, in_features, seed), ggml_type)
    generator = torch.Generator().manual_seed(seed)
    blocks = in_features // 256 * out_features
    packed = torch.randint(0, 256, (blocks, BLOCK_BYTES[ggml_type]), dtype=torch.uint8, generator=generator)
    for offset in K_QUANT_SCALES[ggml_type]:
        scale = (torch.rand(blocks, generator=generator) * 0.02 + 0.001).to(torch.float16)
        packed[:, offset:offset + 2] = scale.view(torch.uint8).reshape(blocks, 2)
    return packed.reshape(out_features, -1)


def within_sum_order(y: torch.Tensor, reference: torch.Tensor, x: torch.Tensor, dequantized: torch.Tensor,
                     bias: torch.Tensor | None = None) -> None:
    """Equal up to the order of fp32 sums: |error| <= 2 (K + 1) eps (sum_k |x_k w_k| + |bias|),
    the sum of both sides' bounds."""
    magnitude = x.abs() @ dequantized.abs().T + (bias.abs() if bias is not None else 0)
    bound = 2 * (x.shape[-1] + 1) * torch.finfo(torch.float32).eps * magnitude + 1e-30
    excess = (y - reference).abs() - bound
    assert excess.max() <= 0, f"max error over the bound: {excess.max().item():.3g}"


@pytest.mark.parametrize("name, ggml_type", TYPES)
@pytest.mark.parametrize("out_features, in_features", [(1, 32), (37, 96), (130, 288)])
def test_the_native_dequantize_is_the_references_bit_for_bit(name, ggml_type, out_features, in_features):
    kernels = native()
    in_features = width(ggml_type, in_features)
    packed = packed_weights(out_features, in_features, ggml_type, seed=out_features)
    assert packed.shape == (out_features, in_features // BLOCK_WEIGHTS.get(ggml_type, 32) * BLOCK_BYTES[ggml_type])
    assert torch.equal(kernels.gguf_dequantize(packed, ggml_type, in_features), reference_dequantize(packed, ggml_type))


@pytest.mark.parametrize("name, ggml_type", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, DECODE_ROWS, DECODE_ROWS + 3])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_the_linear_matches_its_reference(name, ggml_type, rows, with_bias):
    native()
    out_features, in_features = 45, width(ggml_type, 160)
    packed = packed_weights(out_features, in_features, ggml_type, seed=rows)
    bias = torch.randn(out_features) if with_bias else None
    layer = GGUFLinear(packed, ggml_type, in_features, bias)
    x = torch.randn(rows, in_features)
    y = layer(x)
    reference = reference_linear(x, packed, ggml_type, bias)
    dequantized = reference_dequantize(packed, ggml_type)
    within_sum_order(y, reference, x, dequantized, bias)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32


def test_leading_dimensions_and_the_reference_path_without_kernels(monkeypatch):
    packed = quantize(weights(8, 64, seed=1), GGML_TYPES["Q4_1"])
    layer = GGUFLinear(packed, GGML_TYPES["Q4_1"], 64)
    x = torch.randn(2, 3, 64)
    monkeypatch.setattr(quant_linear, "_kernels", lambda: None)  # as where the kernels cannot be built
    y = layer(x)
    assert y.shape == (2, 3, 8)
    assert torch.equal(y, reference_linear(x.reshape(6, 64), packed, GGML_TYPES["Q4_1"]).reshape(2, 3, 8))
    # the weight held is the file's bytes: 20 per 32 weights for Q4_1
    assert layer.weight_bytes == 8 * 64 // 32 * 20


def test_a_wrong_shape_or_format_is_refused_with_what_is_supported():
    packed = quantize(weights(4, 64, seed=2), GGML_TYPES["Q8_0"])
    with pytest.raises(ValueError, match=r"a Q4_0 weight \[4, 64\] is uint8 \[4, 36\], got torch.uint8 \[4, 68\]"):
        GGUFLinear(packed, GGML_TYPES["Q4_0"], 64)
    with pytest.raises(ValueError, match="supported: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"):
        GGUFLinear(packed, 10, 64)  # Q2_K: not (yet) kept quantized
    with pytest.raises(ValueError, match="multiple of 256 for Q4_K"):
        GGUFLinear(packed_weights(4, 256, GGML_TYPES["Q4_K"], seed=3), GGML_TYPES["Q4_K"], 128)
    with pytest.raises(ValueError, match="multiple of 32 for Q8_0"):
        GGUFLinear(packed, GGML_TYPES["Q8_0"], 48)


def test_a_fused_projection_of_parts_in_different_formats():
    native()
    parts = [(GGML_TYPES["Q5_0"], 24), (GGML_TYPES["Q5_0"], 8), (GGML_TYPES["Q8_0"], 8)]  # Gemma 3's q, k, v
    packed = [quantize(weights(rows, 96, seed=rows + kind), kind) for kind, rows in parts]
    bias = torch.randn(40)
    layer = ConcatLinear([GGUFLinear(p, kind, 96) for p, (kind, _) in zip(packed, parts)], bias)
    x = torch.randn(3, 96)
    dequantized = torch.cat([reference_dequantize(p, kind) for p, (kind, _) in zip(packed, parts)])
    reference = torch.cat([reference_linear(x, p, kind) for p, (kind, _) in zip(packed, parts)], dim=-1) + bias
    within_sum_order(layer(x), reference, x, dequantized, bias)


@pytest.mark.parametrize("name, ggml_type", TYPES)
def test_a_tensor_parallel_piece_is_the_same_slice_of_the_weights(name, ggml_type):
    in_features = width(ggml_type, 128)
    per_block = BLOCK_WEIGHTS.get(ggml_type, 32)
    packed = packed_weights(24, in_features, ggml_type, seed=5)
    whole = reference_dequantize(packed, ggml_type)
    rows = quant_linear.shard_packed("w", packed, ggml_type, (0, 8, 8))
    assert torch.equal(reference_dequantize(rows, ggml_type), whole[8:16])
    columns = quant_linear.shard_packed("w", packed, ggml_type, (1, per_block, 2 * per_block))
    assert torch.equal(reference_dequantize(columns, ggml_type), whole[:, per_block:3 * per_block])
    with pytest.raises(ValueError, match=f"splitting its {name} blocks of {per_block}"):
        quant_linear.shard_packed("w", packed, ggml_type, (1, per_block // 2, per_block))

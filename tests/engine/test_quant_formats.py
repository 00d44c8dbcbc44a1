"""The checkpoint formats' reference dequantization (engine/model/quant_formats.py) against each
format's definition written out element by element here (vLLM's AWQ shift table, AutoGPTQ's
row packing and v1 zero offset, DeepSeek-V3's block scales), and the test quantizer's error within
half a quantization step. Every kernel (engine/model/triton_quant.py) is tested against this
reference, so the reference is tested against the formats' own formulas."""
from __future__ import annotations

import pytest
import torch

from engine.model.quant_formats import AWQ_ORDER, QuantFormat, pack_int4, read_quant_format, unpack_int4

AWQ_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)  # vLLM's: column c of eight sits at bit AWQ_SHIFTS[c]


def _int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def test_int4_packing_is_each_formats_bit_layout():
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (3, 16), generator=g, dtype=torch.int32)
    awq = pack_int4(values, 1, AWQ_ORDER)
    for r in range(3):
        for j in range(2):
            assert awq[r, j].item() == _int32(sum(values[r, 8 * j + c].item() << AWQ_SHIFTS[c] for c in range(8)))
    rows = values.t().contiguous()  # [16, 3], packed along rows (GPTQ's qweight)
    gptq = pack_int4(rows, 0)
    for j in range(2):
        for n in range(3):
            assert gptq[j, n].item() == _int32(sum(rows[8 * j + i, n].item() << (4 * i) for i in range(8)))
    assert torch.equal(unpack_int4(awq, 1, AWQ_ORDER), values) and torch.equal(unpack_int4(gptq, 0), rows)


def test_int4_dequantize_is_the_formula_with_groups_act_order_and_zero_offsets():
    g = torch.Generator().manual_seed(1)
    out_features, in_features, group = 16, 32, 8
    weight = torch.randn(out_features, in_features, generator=g)
    for fmt, act_order in ((QuantFormat("awq", group_size=group), False),
                           (QuantFormat("gptq", group_size=group, zero_offset=1), True)):
        parts = fmt.quantize(weight, generator=g, act_order=act_order)
        q = unpack_int4(parts["qweight"], *fmt.qweight_packing)
        zeros = unpack_int4(parts["qzeros"], 1, fmt.order)
        index = parts["g_idx"].long() if "g_idx" in parts else torch.arange(in_features) // group
        if act_order:
            assert not torch.equal(index, torch.arange(in_features) // group)
        w = fmt.dequantize(parts)
        for n in range(out_features):
            for k in range(in_features):
                expected = (q[k, n] - zeros[index[k], n] - fmt.zero_offset) * parts["scales"][index[k], n].float()
                assert w[n, k] == expected
        step = parts["scales"].float()[index].t()  # [N, K]: each weight's quantization step
        assert ((w - weight).abs() <= step / 2 + 1e-6).all()


def test_fp8_dequantize_is_the_block_and_channel_formula():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 70, generator=g)
    block = QuantFormat("fp8", block=(16, 32))
    parts = block.quantize(weight)
    assert parts["weight_scale_inv"].shape == (3, 3)
    w = block.dequantize(parts)
    for n in range(40):
        for k in range(70):
            assert w[n, k] == parts["weight"][n, k].float() * parts["weight_scale_inv"][n // 16, k // 32]
    assert ((w - weight).abs() <= weight.abs() * 2 ** -4 + 1e-6).all()  # e4m3: 3 mantissa bits, round to nearest
    channel = QuantFormat("fp8").quantize(weight)
    assert torch.equal(QuantFormat("fp8").dequantize(channel), channel["weight"].float() * channel["weight_scale"])
    per_tensor = {"weight": channel["weight"], "weight_scale": torch.tensor(0.5)}
    assert torch.equal(QuantFormat("fp8").dequantize(per_tensor), channel["weight"].float() * 0.5)


@pytest.mark.parametrize("config, expected", [
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     QuantFormat("fp8", block=(128, 128))),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, QuantFormat("fp8")),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"},
     QuantFormat("awq", group_size=128)),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
     QuantFormat("gptq", group_size=128, zero_offset=1)),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"},
     QuantFormat("gptq", group_size=-1)),
])
def test_quantization_configs_as_checkpoints_write_them(config, expected):
    assert read_quant_format({"quantization_config": config}) == expected
    assert read_quant_format({}) is None


@pytest.mark.parametrize("fmt, act_order", [(QuantFormat("fp8", block=(16, 32)), False), (QuantFormat("fp8"), False),
                                            (QuantFormat("awq", group_size=16), False),
                                            (QuantFormat("gptq", group_size=16, zero_offset=1), True),
                                            (QuantFormat("gptq", group_size=-1), False)])
@pytest.mark.parametrize("piece", [(0, 16, 32), (0, 32, 32), (1, 32, 64), (1, 64, 32), (1, 16, 32)])
def test_a_tensor_parallel_piece_is_the_same_slice_of_the_weights(fmt, act_order, piece):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 96, generator=g)
    parts = fmt.quantize(weight, generator=g, act_order=act_order)
    dim, start, length = piece
    if fmt.block is not None and start % fmt.block[dim]:
        with pytest.raises(ValueError, match="splitting its scale blocks of 32: use a tensor_parallel_size"):
            fmt.shard("layer", parts, piece)
        return
    shard = fmt.shard("layer", parts, piece)
    assert fmt.check("layer", shard) == ((length, 96) if dim == 0 else (64, length))
    assert torch.equal(fmt.dequantize(shard), fmt.dequantize(parts).narrow(dim, start, length))
    assert fmt.shard("layer", parts, None) is parts


def test_a_piece_that_splits_an_awq_group_or_an_int32_is_refused():
    parts = QuantFormat("awq", group_size=32).quantize(torch.randn(64, 96))
    with pytest.raises(ValueError, match="cuts layer at 16..48 of its 96 input columns, splitting its quantization "
                                         "groups of 32"):
        QuantFormat("awq", group_size=32).shard("layer", parts, (1, 16, 32))
    with pytest.raises(ValueError, match="splitting its int32 packs of 8"):
        QuantFormat("awq", group_size=32).shard("layer", parts, (0, 4, 16))

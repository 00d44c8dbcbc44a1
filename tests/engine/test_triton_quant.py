"""The Triton weight-only quantized linear kernels (engine/model/triton_quant.py `fp8_linear`,
`int4_linear`) against the reference `F.linear(x.float(), QuantFormat.dequantize(parts), bias)`,
the weights made by `QuantFormat.quantize` (engine/model/quant_formats.py).

Formats: fp8 with block scales (128 x 128, and 16 x 32 and 16 x 24 so tiny shapes cross several
scale tiles; 24 is divided by no K tile, so its scales are looked up per element), per output
channel ([N, 1] and [N]) and per tensor (one element); AWQ with groups of 32 and one group (-1);
GPTQ with groups of 32, act-order and not, zero offset 1 (AutoGPTQ's "gptq") and 0 ("gptq_v2").
Shapes leave partial tiles: N not a multiple of BLOCK_N or of the fp8 block (40, 200), K not a
multiple of BLOCK_K (96, 160, 300), M of 1 and 5 (16-row decode tiles) and 33 (64-row tiles);
with and without bias. The e4m3 decode is checked exact over every byte but the NaNs.
Tolerances, on the largest error relative to max |y|: fp32 x 1e-4 (exact fp32 products, only the
order of the sums differs); fp16 x 4e-3 (W's tile and y are rounded to fp16, 2^-11 each).
Without CUDA the kernels run under `TRITON_INTERPRET=1` on CPU tensors, so the shapes are tiny
and the dtypes float32 and float16 (the interpreter's bf16 `tl.dot` is not the GPU's).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.model.quant_formats import FP8_MAX, QuantFormat  # noqa: E402
from engine.model.triton_quant import fp8_linear, int4_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3}
ROWS = [1, 5, 33]

# name -> (format, N, K); per-tensor is made here (quantize writes a scale per channel)
FP8 = {"block128": (QuantFormat("fp8", block=(128, 128)), 200, 300),
       "block16x32": (QuantFormat("fp8", block=(16, 32)), 40, 160),
       "block16x24": (QuantFormat("fp8", block=(16, 24)), 40, 96),
       "per-channel": (QuantFormat("fp8"), 40, 96),
       "per-channel-1d": (QuantFormat("fp8"), 200, 96),
       "per-tensor": (QuantFormat("fp8"), 40, 160)}
# name -> (format, act_order, N, K)
INT4 = {"awq-g32": (QuantFormat("awq", group_size=32), False, 40, 96),
        "awq-g-1": (QuantFormat("awq", group_size=-1), False, 200, 120),
        "gptq-g32-actorder-v1": (QuantFormat("gptq", group_size=32, zero_offset=1), True, 40, 160),
        "gptq-g32-v1": (QuantFormat("gptq", group_size=32, zero_offset=1), False, 200, 96),
        "gptq-g32-actorder-v2": (QuantFormat("gptq", group_size=32, zero_offset=0), True, 200, 96),
        "gptq-g32-v2": (QuantFormat("gptq", group_size=32, zero_offset=0), False, 40, 160)}


def _inputs(n: int, k: int, m: int, dtype: torch.dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.1
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    return g, weight, x, b


def _check(ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    reference = F.linear(x.float(), w, bias)
    assert ours.shape == reference.shape and ours.dtype == x.dtype
    error = (ours.float().cpu() - reference).abs().max().item()
    assert error <= TOLERANCE[x.dtype] * reference.abs().max().item(), error


def _dev(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(FP8))
def test_fp8_linear_matches_the_reference(name, m, bias, dtype):
    fmt, n, k = FP8[name]
    g, weight, x, b = _inputs(n, k, m, dtype, bias, seed=m + 7 * len(name))
    if name == "per-tensor":
        scale = (weight.abs().amax() / FP8_MAX).reshape(1)
        parts = {"weight": (weight / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
    else:
        parts = fmt.quantize(weight, g)
    if name == "per-channel-1d":
        parts["weight_scale"] = parts["weight_scale"].reshape(-1)
    ours = fp8_linear(x.to(DEVICE), _dev(parts["weight"]), _dev(parts[fmt.scale_name]), fmt.block, _dev(b))
    _check(ours, x, fmt.dequantize(parts), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(INT4))
def test_int4_linear_matches_the_reference(name, m, bias, dtype):
    fmt, act_order, n, k = INT4[name]
    g, weight, x, b = _inputs(n, k, m, dtype, bias, seed=m + 7 * len(name))
    parts = fmt.quantize(weight, g, act_order=act_order)
    group_index = fmt.group_index(parts, k).to(torch.int32)
    ours = int4_linear(x.to(DEVICE), _dev(parts["qweight"]), _dev(parts["qzeros"]), _dev(parts["scales"]),
                       _dev(group_index), fmt.method == "awq", fmt.zero_offset, _dev(b))
    _check(ours, x, fmt.dequantize(parts), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_e4m3_decode_is_exact_for_every_byte(dtype):
    """W [16, 16] holds every byte (NaN codes 0x7F / 0xFF zeroed), scale 1; x = identity rows, so
    y = W^T exactly (one nonzero product per output; every e4m3 value is exact in fp16)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    weight = codes.view(torch.float8_e4m3fn).view(16, 16)
    x = torch.eye(16, dtype=dtype)
    ours = fp8_linear(x.to(DEVICE), weight.to(DEVICE), torch.ones(1, device=DEVICE), None).cpu()
    expected = codes.view(torch.float8_e4m3fn).float().view(16, 16).t()
    assert torch.equal(ours.float(), expected)


def test_leading_dims_and_strided_x():
    fmt, n, k = FP8["block16x32"]
    g, weight, x, _ = _inputs(n, k, 6, torch.float32, False, seed=1)
    parts = fmt.quantize(weight, g)
    strided = torch.randn(k, 6, generator=g).t()  # [6, K], stride along K of 6
    ours = fp8_linear(strided.reshape(2, 3, k).to(DEVICE), _dev(parts["weight"]), _dev(parts["weight_scale_inv"]),
                      fmt.block)
    assert ours.shape == (2, 3, n)
    _check(ours.reshape(6, n), strided, fmt.dequantize(parts), None)
    assert fp8_linear(torch.zeros(0, k, device=DEVICE), _dev(parts["weight"]), _dev(parts["weight_scale_inv"]),
                      fmt.block).shape == (0, n)


def test_invalid_inputs_are_refused():
    fmt, n, k = FP8["block16x32"]
    g, weight, x, _ = _inputs(n, k, 2, torch.float32, False, seed=2)
    parts = fmt.quantize(weight, g)
    w8, scale = parts["weight"], parts["weight_scale_inv"]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, w8.float(), scale, fmt.block)
    with pytest.raises(ValueError, match="in_features"):
        fp8_linear(x[:, 1:], w8, scale, fmt.block)
    with pytest.raises(ValueError, match="block scales"):
        fp8_linear(x, w8, scale, (16, 16))
    with pytest.raises(ValueError, match="per channel"):
        fp8_linear(x, w8, torch.ones(n, 2), None)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(x, w8, scale, fmt.block, torch.zeros(n + 1))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fp8_linear(x.to(torch.int32), w8, scale, fmt.block)
    awq = QuantFormat("awq", group_size=32).quantize(weight, g)
    group_index = torch.arange(k, dtype=torch.int32) // 32
    with pytest.raises(ValueError, match="int32"):
        int4_linear(x, awq["qweight"].to(torch.int64), awq["qzeros"], awq["scales"], group_index, True, 0)
    with pytest.raises(ValueError, match="scales"):
        int4_linear(x, awq["qweight"], awq["qzeros"], awq["scales"][:, :8], group_index, True, 0)
    with pytest.raises(ValueError, match="group_index"):
        int4_linear(x, awq["qweight"], awq["qzeros"], awq["scales"], group_index[:-1], True, 0)

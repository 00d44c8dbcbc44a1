"""Linear layers whose weights stay quantized as stored: GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
Q6_K blocks.

A `GGUFLinear` holds W as a GGUF file stores it, uint8 [out_features, in_features / 32 blocks of
`BLOCK_BYTES[type]` bytes] (256-weight blocks for the k-quants), and computes y = x W^T (+ bias) in
float32:

- the reference path, that every kernel is tested against: W dequantized by the `gguf` package
  (ggml's own formulas, in numpy), then `F.linear`;
- on CPU with the native kernels (engine/csrc/gguf_linear_cpu.cpp): up to `DECODE_ROWS` rows, W
  dequantized in registers and multiplied in fp32 (a decode step is bound by reading W: 4.5 to
  8.5 bits a weight instead of 32); more rows, W dequantized to fp32 once per call, then the fast
  GEMM (a prefill is bound by compute).

Both native paths dequantize exactly as the reference does, so an output differs from the
reference's only by the order of its fp32 sums. Without the kernels, the reference path runs.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# ggml's type ids (gguf.GGMLQuantizationType) of the formats kept as stored, and their block sizes
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 12: 144, 13: 176, 14: 210}
BLOCK = 32  # weights per block along in_features; the k-quants' blocks hold 256 (BLOCK_WEIGHTS)
BLOCK_WEIGHTS = {12: 256, 13: 256, 14: 256}
# Rows of x up to which the register kernel beats dequantize + GEMM (decode-sized batches).
DECODE_ROWS = 16


def type_name(ggml_type: int) -> str:
    return next((name for name, number in GGML_TYPES.items() if number == ggml_type), str(ggml_type))


def check_shape(ggml_type: int, out_features: int, in_features: int, packed: torch.Tensor) -> None:
    """ValueError unless `packed` is W [out_features, in_features] in `ggml_type`'s blocks."""
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"GGML type {type_name(ggml_type)} is not kept quantized; supported: "
                         f"{', '.join(GGML_TYPES)}")
    per_block = BLOCK_WEIGHTS.get(ggml_type, BLOCK)
    if in_features <= 0 or in_features % per_block:
        raise ValueError(f"in_features ({in_features}) must be a positive multiple of {per_block} for "
                         f"{type_name(ggml_type)}")
    expected = (out_features, in_features // per_block * BLOCK_BYTES[ggml_type])
    if packed.dtype != torch.uint8 or tuple(packed.shape) != expected:
        raise ValueError(f"a {type_name(ggml_type)} weight [{out_features}, {in_features}] is uint8 {list(expected)}, "
                         f"got {packed.dtype} {list(packed.shape)}")


def shard_packed(name: str, packed: torch.Tensor, ggml_type: int,
                 piece: tuple[int, int, int] | None) -> torch.Tensor:
    """A tensor-parallel rank's rows (dim 0) or input columns (dim 1) [start, start + length) of
    W in `ggml_type`'s blocks (`DecoderForCausalLM.projection_slice`; None: all of it); ValueError
    where the columns split a block."""
    if piece is None:
        return packed
    dim, start, length = piece
    if dim == 0:
        return packed[start:start + length]
    per_block = BLOCK_WEIGHTS.get(ggml_type, BLOCK)
    if start % per_block or length % per_block:
        raise ValueError(f"tensor parallelism cuts {name} at input columns {start}..{start + length}, splitting its "
                         f"{type_name(ggml_type)} blocks of {per_block}: use a tensor_parallel_size that keeps them "
                         "whole, or quantization 'none'")
    width = BLOCK_BYTES[ggml_type]
    return packed[:, start // per_block * width:(start + length) // per_block * width].contiguous()


def reference_dequantize(packed: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """W as float32 [out_features, in_features], by the `gguf` package (the reference)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    weights = dequantize(packed.cpu().numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))


def quantize(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """A float weight [out_features, in_features] in `ggml_type`'s blocks, by the `gguf` package
    (llama.cpp's reference quantizer): what a GGUF file of that type would store."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize
    array = weight.detach().to(torch.float32).cpu().numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf_quantize(array, GGMLQuantizationType(ggml_type))))


def reference_linear(x: torch.Tensor, packed: torch.Tensor, ggml_type: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.to(torch.float32), reference_dequantize(packed, ggml_type).to(x.device), bias)


class GGUFLinear(nn.Module):
    """y = x W^T (+ bias) with W kept in a GGUF block format, computed in float32 (the result in
    x's dtype). `packed` is a parameter (uint8, never trained), so the model's parameters count
    its bytes and a tied embedding that shares it counts them once."""

    def __init__(self, packed: torch.Tensor, ggml_type: int, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        check_shape(ggml_type, packed.shape[0], in_features, packed)
        self.ggml_type = ggml_type
        self.in_features = in_features
        self.out_features = packed.shape[0]
        self.packed = nn.Parameter(packed.contiguous(), requires_grad=False)
        self.bias = nn.Parameter(bias.to(torch.float32), requires_grad=False) if bias is not None else None

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() + (self.bias.numel() * 4 if self.bias is not None else 0)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={type_name(self.ggml_type)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        bias = self.bias.to(torch.float32) if self.bias is not None else None
        kernels = _kernels() if rows.device.type == "cpu" else None
        if kernels is None:
            y = reference_linear(rows, self.packed, self.ggml_type, bias)
        elif rows.shape[0] <= DECODE_ROWS:
            y = kernels.gguf_linear(rows, self.packed, self.ggml_type)
            if bias is not None:
                y += bias
        else:
            y = F.linear(rows, kernels.gguf_dequantize(self.packed, self.ggml_type, self.in_features), bias)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows `indices` of W as float32 [*indices.shape, in_features] (an embedding lookup)."""
        selected = self.packed[indices.reshape(-1)]
        kernels = _kernels() if selected.device.type == "cpu" else None
        weights = (kernels.gguf_dequantize(selected, self.ggml_type, self.in_features) if kernels is not None
                   else reference_dequantize(selected, self.ggml_type).to(selected.device))
        return weights.reshape(*indices.shape, self.in_features)


class ConcatLinear(nn.Module):
    """A fused projection (q | k | v, gate | up) whose parts are held apart (a GGUF's parts in
    different formats, quantized parts whose scales do not line up): each part's quantized
    linear (`in_features`, `out_features`, no bias of its own), their outputs side by side, then
    the fused bias."""

    def __init__(self, parts: list[GGUFLinear], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if len({part.in_features for part in parts}) != 1 or any(part.bias is not None for part in parts):
            raise ValueError("the parts of a fused projection share in_features and carry no bias of their own")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.bias = nn.Parameter(bias.to(torch.float32), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)


@functools.lru_cache(maxsize=1)
def _kernels():
    """The native kernels when they have the GGUF linear (x86-64-v3 builds), else None (asked once:
    a layer's call is a few microseconds of Python around the kernel)."""
    from engine import cpu_kernels
    module = cpu_kernels.load()
    return module if module is not None and module.has_gguf_linear() else None

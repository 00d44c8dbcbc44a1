"""The quantized Hugging Face checkpoints pdserve reads (`quantization_config` in config.json): what
each stores per linear layer, how that becomes float weights (the reference every kernel is
tested against), and how a float weight is quantized into it (what tests and docs write).

A linear layer `X` [out_features N, in_features K] of a quantized checkpoint stores, instead of
`X.weight` in a float dtype:

- **fp8** (`quant_method` "fp8", e4m3): `X.weight` float8_e4m3fn [N, K] and
  - with `weight_block_size` [bn, bk] (DeepSeek-V3, Qwen3 FP8): `X.weight_scale_inv` float32
    [ceil(N / bn), ceil(K / bk)], W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk];
  - without: `X.weight_scale`, one scale (per tensor) or [N] / [N, 1] (per output channel, also
    `quant_method` "fbgemm_fp8"), W[n, k] = weight[n, k] * weight_scale[n].
  An `X.input_scale` (static activation scales) is read and not used: the activations stay in
  the model's dtype (W8A16), which loses nothing the checkpoint has.
- **awq** (4 bits, `version` "gemm", with zero points): `X.qweight` int32 [K, N / 8],
  `X.qzeros` int32 [K / G, N / 8], `X.scales` float16 [K / G, N], G = `group_size`. Eight 4-bit
  values per int32 along N, nibble i holding column 8 * j + AWQ_ORDER[i];
  W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n].
- **gptq** (4 bits): `X.qweight` int32 [K / 8, N], eight values per int32 along K, nibble i
  holding row 8 * j + i; `X.qzeros` int32 [K / G, N / 8] packed like AWQ's but in plain order,
  stored as zero - 1 (`checkpoint_format` "gptq", AutoGPTQ's) or as is ("gptq_v2"); `X.scales`
  float16 [K / G, N]; `X.g_idx` int32 [K], the group of each input row (act-order, `desc_act`,
  permutes it; without, k // G). W[n, k] = (q[k, n] - z[g, n]) * s[g, n], g = g_idx[k].
  `group_size` -1 means one group of all K.

Layers a checkpoint leaves in float (`modules_to_not_convert`, usually the LM head) simply store
a float `X.weight`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.config import HF_QUANT_METHODS  # the --quantization values these formats are served under

# quant_method names in config.json -> the format they are
_METHOD_ALIASES = {"fp8": "fp8", "fbgemm_fp8": "fp8", "awq": "awq", "gptq": "gptq"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its eight
FP8_MAX = 448.0  # largest float8_e4m3fn
PACK = 8  # 4-bit values per int32
PLAIN_ORDER = tuple(range(PACK))
_INT4_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}


@dataclass(frozen=True)
class QuantFormat:
    """One checkpoint's quantization. `method`: "fp8" | "awq" | "gptq"; fp8: `block` (rows, cols)
    per scale, None for a scale per output channel (or per tensor); int4: `group_size` input rows
    per scale (-1: all), `zero_offset` added to a stored zero (1 for GPTQ's v1 format)."""

    method: str
    block: tuple[int, int] | None = None
    group_size: int = 128
    zero_offset: int = 0

    def __post_init__(self) -> None:
        if self.method not in HF_QUANT_METHODS:
            raise ValueError(f"quantization method {self.method!r} is not one of {', '.join(HF_QUANT_METHODS)}")

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.block is not None else "weight_scale"

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors (suffixes after `X.`) that hold one quantized linear layer."""
        return ("weight", self.scale_name) if self.method == "fp8" else _INT4_PARTS[self.method]

    @property
    def ignored_parts(self) -> tuple[str, ...]:
        """Suffixes a checkpoint may carry that nothing reads (fp8's static activation scales)."""
        return ("input_scale",) if self.method == "fp8" else ()

    def stored_dtypes(self) -> dict[str, tuple[str, ...]]:
        """safetensors dtype names each part may have."""
        if self.method == "fp8":
            return {"weight": ("F8_E4M3",), self.scale_name: ("F32", "BF16", "F16")}
        dtypes = {"qweight": ("I32",), "qzeros": ("I32",), "scales": ("F16", "BF16", "F32")}
        return dtypes | ({"g_idx": ("I32", "I64")} if self.method == "gptq" else {})

    @property
    def order(self) -> tuple[int, ...]:
        """Which of its eight values each nibble of an int32 holds."""
        return AWQ_ORDER if self.method == "awq" else PLAIN_ORDER

    @property
    def qweight_packing(self) -> tuple[int, tuple[int, ...]]:
        """(axis, order) of qweight's packing: AWQ along out_features, GPTQ along in_features."""
        return (1, AWQ_ORDER) if self.method == "awq" else (0, PLAIN_ORDER)

    def is_quantized(self, suffix: str, dtype: str) -> bool:
        """Whether a tensor `X.<suffix>` of safetensors `dtype` is part of a quantized layer (an
        fp8 `X.weight` is; a float one is a layer left in float)."""
        return suffix in self.parts and (suffix != "weight" or dtype == "F8_E4M3")

    def weight_shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
        """(out_features, in_features) of a layer from its parts' shapes."""
        if self.method == "fp8":
            return tuple(shapes["weight"])
        rows, cols = shapes["qweight"]
        return (cols * PACK, rows) if self.method == "awq" else (cols, rows * PACK)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def check(self, name: str, parts: dict[str, torch.Tensor]) -> tuple[int, int]:
        """ValueError naming the tensor unless `parts` hold one layer of this format; its (N, K)."""
        out_features, in_features = self.weight_shape({key: tuple(t.shape) for key, t in parts.items()})
        if self.method == "fp8":
            scale = parts[self.scale_name]
            if self.block is not None:
                expected = (-(-out_features // self.block[0]), -(-in_features // self.block[1]))
                ok = tuple(scale.shape) == expected
            else:
                expected = f"one scale, [{out_features}] or [{out_features}, 1]"
                ok = scale.numel() in (1, out_features)
            if not ok:
                raise ValueError(f"tensor {name}.{self.scale_name} has shape {list(scale.shape)}, expected {expected} "
                                 f"for a weight [{out_features}, {in_features}]")
            return out_features, in_features
        groups, packed = self.groups(in_features), out_features // PACK
        if self.method == "gptq" and parts["scales"].dim() == 2 and parts["scales"].shape[0] >= groups:
            groups = parts["scales"].shape[0]  # a rank's input columns index the whole layer's groups (`shard`)
        expected = {"qzeros": (groups, packed), "scales": (groups, out_features), "g_idx": (in_features,)}
        for part, shape in expected.items():
            if part in parts and tuple(parts[part].shape) != shape:
                raise ValueError(f"tensor {name}.{part} has shape {list(parts[part].shape)}, expected {list(shape)} "
                                 f"for {self.method} with group_size {self.group_size}")
        return out_features, in_features

    def shard(self, name: str, parts: dict[str, torch.Tensor],
              piece: tuple[int, int, int] | None) -> dict[str, torch.Tensor]:
        """A tensor-parallel rank's part of a layer: rows (dim 0) or input columns (dim 1)
        [start, start + length) of W (`DecoderForCausalLM.projection_slice`; None: all), each
        tensor cut with it. A GPTQ rank's input columns keep every group's scales and zeros (g_idx
        points into them, act-order or not). ValueError where the cut splits a scale block, an
        int32's eight values or an AWQ group."""
        if piece is None:
            return parts
        dim, start, length = piece
        out_features, in_features = self.weight_shape({key: tuple(t.shape) for key, t in parts.items()})
        end, whole = start + length, (out_features, in_features)[dim]

        def unit(size: int, what: str) -> int:
            if start % size or (end % size and end != whole):
                raise ValueError(f"tensor parallelism cuts {name} at {start}..{end} of its {whole} "
                                 f"{('rows', 'input columns')[dim]}, splitting its {what} of {size}: use a "
                                 "tensor_parallel_size that keeps them whole, or quantization 'none'")
            return size

        def cut(tensor: torch.Tensor, axis: int, size: int = 1) -> torch.Tensor:
            first = start // size
            return tensor.narrow(axis, first, -(-end // size) - first).contiguous()

        if self.method == "fp8":
            scale = parts[self.scale_name]
            if self.block is not None:
                scale = cut(scale, dim, unit(self.block[dim], "scale blocks"))
            elif dim == 0 and scale.numel() == out_features:  # per channel
                scale = cut(scale.reshape(out_features, 1), 0)
            return {"weight": cut(parts["weight"], dim), self.scale_name: scale}
        if dim == 0:  # output columns of the [K, N] layouts
            unit(PACK, "int32 packs")
            qweight = cut(parts["qweight"], 1, PACK if self.method == "awq" else 1)
            return parts | {"qweight": qweight, "qzeros": cut(parts["qzeros"], 1, PACK),
                            "scales": cut(parts["scales"], 1)}
        if self.method == "gptq":
            return parts | {"qweight": cut(parts["qweight"], 0, unit(PACK, "int32 packs")),
                            "g_idx": cut(parts["g_idx"], 0)}
        if self.group_size == -1:
            return parts | {"qweight": cut(parts["qweight"], 0)}
        size = unit(self.group_size, "quantization groups")
        return {"qweight": cut(parts["qweight"], 0), "qzeros": cut(parts["qzeros"], 0, size),
                "scales": cut(parts["scales"], 0, size)}

    def group_index(self, parts: dict[str, torch.Tensor], in_features: int) -> torch.Tensor:
        """int64 [K]: the scale / zero row of each input row."""
        if "g_idx" in parts:
            return parts["g_idx"].to(torch.int64)
        rows = torch.arange(in_features, device=parts["qweight"].device)
        return rows * 0 if self.group_size == -1 else rows // self.group_size

    def dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference: W float32 [out_features, in_features]."""
        out_features, in_features = self.weight_shape({key: tuple(t.shape) for key, t in parts.items()})
        if self.method == "fp8":
            weight, scale = parts["weight"].to(torch.float32), parts[self.scale_name].to(torch.float32)
            if self.block is not None:
                rows, cols = self.block
                scale = scale.repeat_interleave(rows, 0)[:out_features].repeat_interleave(cols, 1)[:, :in_features]
                return weight * scale
            return weight * scale.reshape(-1, 1)
        q = unpack_int4(parts["qweight"], *self.qweight_packing)  # [K, N]
        zeros = unpack_int4(parts["qzeros"], 1, self.order) + self.zero_offset  # [groups, N]
        group = self.group_index(parts, in_features)
        w = (q - zeros[group]).to(torch.float32) * parts["scales"].to(torch.float32)[group]
        return w.t().contiguous()

    def quantize(self, weight: torch.Tensor, generator: torch.Generator | None = None,
                 act_order: bool = False) -> dict[str, torch.Tensor]:
        """What a checkpoint of this format stores for the float `weight` [N, K] (round to nearest,
        min/max scales: a test's and a doc's quantizer, not a calibrated one). GPTQ's `act_order`
        assigns groups by a random permutation of the input rows, as desc_act checkpoints do."""
        weight = weight.detach().to(torch.float32).cpu()
        out_features, in_features = weight.shape
        if self.method == "fp8":
            return self._quantize_fp8(weight)
        if out_features % PACK or (self.method == "gptq" and in_features % PACK):
            raise ValueError(f"{self.method} packs 8 values per int32: [{out_features}, {in_features}] does not divide")
        groups = self.groups(in_features)
        size = in_features if self.group_size == -1 else self.group_size
        order = torch.randperm(in_features, generator=generator) if act_order else torch.arange(in_features)
        group = torch.empty(in_features, dtype=torch.int64)
        group[order] = torch.arange(in_features) // size
        w = weight.t()  # [K, N]
        low = torch.full((groups, out_features), float("inf")).scatter_reduce(0, group[:, None].expand_as(w), w, "amin")
        high = torch.full((groups, out_features), -float("inf")).scatter_reduce(0, group[:, None].expand_as(w), w, "amax")
        low, high = low.clamp(max=0), high.clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-8).to(torch.float16)
        zeros = torch.round(-low / scales.float()).clamp(0, 15).to(torch.int32)
        q = torch.clamp(torch.round(w / scales.float()[group]) + zeros[group], 0, 15).to(torch.int32)
        stored = {"qweight": pack_int4(q, *self.qweight_packing),
                  "qzeros": pack_int4(zeros - self.zero_offset, 1, self.order),
                  "scales": scales}
        if self.method == "gptq":
            stored["g_idx"] = group.to(torch.int32)
        return stored

    def _quantize_fp8(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        out_features, in_features = weight.shape
        if self.block is None:
            scale = (weight.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            return {"weight": (weight / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
        rows, cols = self.block
        padded = torch.zeros(-(-out_features // rows) * rows, -(-in_features // cols) * cols)
        padded[:out_features, :in_features] = weight
        tiles = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
        scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
        q = (tiles / scale[:, None, :, None]).reshape(padded.shape)[:out_features, :in_features]
        return {"weight": q.to(torch.float8_e4m3fn).contiguous(), "weight_scale_inv": scale}

    def config(self) -> dict[str, Any]:
        """The `quantization_config` of a checkpoint in this format (what `read_quant_format` reads)."""
        if self.method == "fp8":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"} | (
                {"weight_block_size": list(self.block)} if self.block is not None else {})
        config = {"quant_method": self.method, "bits": 4, "group_size": self.group_size}
        if self.method == "awq":
            return config | {"zero_point": True, "version": "gemm"}
        return config | {"sym": False, "desc_act": False,
                         "checkpoint_format": "gptq" if self.zero_offset else "gptq_v2"}


def read_quant_format(config: dict) -> QuantFormat | None:
    """The format a config.json's `quantization_config` names (None without one); ValueError
    naming what is supported for anything else."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    supported = ("supported: fp8 (e4m3; block or per-channel scales), fbgemm_fp8, awq (4-bit, version gemm) and "
                 "gptq (4-bit)")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in _METHOD_ALIASES:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported ({supported})")
    method = _METHOD_ALIASES[method]
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 format {quant.get('fmt')!r} is not supported (e4m3 only)")
        block = quant.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2
                                  or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"fp8 weight_block_size must be [rows, cols] of positive integers, got {block!r}")
        return QuantFormat("fp8", block=tuple(block) if block is not None else None)
    bits, group_size = quant.get("bits", quant.get("w_bit")), quant.get("group_size", quant.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"{method} with {bits} bits is not supported (4-bit only)")
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0 and group_size % PACK == 0):
        raise ValueError(f"{method} group_size must be -1 or a positive multiple of 8, got {group_size!r}")
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm" or not quant.get("zero_point", True):
            raise ValueError(f"awq version {version!r} (zero_point {quant.get('zero_point')}) is not supported: "
                             "version gemm with zero points only")
        return QuantFormat("awq", group_size=group_size)
    checkpoint_format = quant.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {checkpoint_format!r} is not supported (gptq, gptq_v2)")
    return QuantFormat("gptq", group_size=group_size, zero_offset=1 if checkpoint_format == "gptq" else 0)


def unpack_int4(packed: torch.Tensor, axis: int, order: tuple[int, ...] = PLAIN_ORDER) -> torch.Tensor:
    """int32 [R, C] of eight 4-bit values each -> int32 [R, 8C] (axis 1) or [8R, C] (axis 0);
    nibble i holds value `order[i]` of its eight."""
    shifts = torch.arange(PACK, dtype=torch.int32, device=packed.device) * 4
    nibbles = (packed[..., None] >> shifts) & 0xF  # [R, C, nibble]
    values = torch.empty_like(nibbles)
    values[..., list(order)] = nibbles
    if axis == 1:
        return values.reshape(packed.shape[0], -1)
    return values.permute(0, 2, 1).reshape(-1, packed.shape[1])


def pack_int4(values: torch.Tensor, axis: int, order: tuple[int, ...] = PLAIN_ORDER) -> torch.Tensor:
    """The inverse of `unpack_int4`: values 0..15, int32 [R, 8C] (axis 1) or [8R, C] (axis 0)."""
    v = values.to(torch.int64).numpy().astype(np.uint32)
    if axis == 1:
        v = v.reshape(v.shape[0], -1, PACK)
    else:
        v = v.reshape(-1, PACK, v.shape[1]).transpose(0, 2, 1)
    v = v[:, :, list(order)]  # nibble i <- value order[i]
    packed = sum(v[:, :, i] << np.uint32(4 * i) for i in range(PACK))
    return torch.from_numpy(np.ascontiguousarray(packed.astype(np.uint32).view(np.int32)))


QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_quantized_copy(source: str, folder: str, fmt: QuantFormat, seed: int = 0, act_order: bool = False) -> str:
    """A copy of the Hugging Face folder `source` (one model.safetensors) as a checkpoint of `fmt`:
    every dense projection's weight quantized by `fmt.quantize`, the rest (embedding, norms,
    biases, a separate LM head) kept, and its `quantization_config` in config.json. What the tests
    and benchmarks serve; round-to-nearest, so a real checkpoint's calibrated weights do better."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(source):
        if name != "model.safetensors" and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(folder, name))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in load_file(os.path.join(source, "model.safetensors")).items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == "weight" and prefix.rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS:
            parts = fmt.quantize(tensor, generator=generator, act_order=act_order)
            tensors.update({f"{prefix}.{part}": value for part, value in parts.items()})
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = fmt.config()
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return str(folder)

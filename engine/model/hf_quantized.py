"""`--quantization fp8|awq|gptq` (and `auto` on GPUs): a quantized Hugging Face checkpoint's
linear layers served as stored (engine/model/quant_formats.py says what each format stores).

The model is built on the meta device and given memory (`allocate_all_but_kept`) for everything
but the weights of the layers to keep: every dense projection (`DecoderForCausalLM.
dense_projections`) and the LM head whose checkpoint tensors are quantized. The float load
(`LoadedModel.iter_weights`) passes those as meta placeholders, so no float copy of them is ever
made or held (an fp8 checkpoint loads in about its own size); then `keep_hf_quantized` puts a
`QuantizedLinear` over the stored tensors in each one's place. A fused projection (q | k | v, gate | up)
holds its parts' tensors end to end where their scales line up (int4 with one group index, fp8
per channel, or fp8 blocks that no part splits), else a `ConcatLinear` of one layer per part.
Mixture-of-experts and latent-attention layers stay dequantized (logged with the count). Under
tensor parallelism each rank keeps its rows or input columns of each layer with their scales.

A `QuantizedLinear` computes with the Triton kernels (engine/model/triton_quant.py: the weight
dequantized tile by tile in registers, the activations in the model's dtype) when the engine's
attention backend is Triton: on CUDA, or on CPU under Triton's interpreter, which is how CI runs
them. Otherwise (a CPU engine) it takes the reference path, dequantize then matmul, at every call:
correct and slow, which is why `auto` dequantizes at load on CPU instead.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.decoder import DecoderForCausalLM
from engine.model.layers import replace_linear
from engine.model.loader import LoadedModel
from engine.model.quant_formats import QuantFormat
from engine.model.quant_linear import ConcatLinear

logger = logging.getLogger(__name__)
KERNELS = ("triton", "reference")


class QuantizedLinear(nn.Module):
    """y = x W^T (+ bias), W held as `fmt` stores it (`parts`, checked by `fmt.check`). The stored
    tensors are parameters (never trained) so the model's weight bytes count them."""

    def __init__(self, fmt: QuantFormat, parts: dict[str, torch.Tensor], kernel: str,
                 bias: torch.Tensor | None = None, name: str = "layer") -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.out_features, self.in_features = fmt.check(name, parts)
        self.fmt, self.kernel = fmt, kernel
        if fmt.method != "fp8":  # the group of each input row, for either int4 layout
            parts = {key: value for key, value in parts.items() if key != "g_idx"} | {
                "group_index": fmt.group_index(parts, self.in_features).to(torch.int32)}
        self.stored = nn.ParameterDict({key: nn.Parameter(value.contiguous(), requires_grad=False)
                                        for key, value in parts.items()})
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.method}"

    def dequantized(self) -> torch.Tensor:
        """W float32 [out_features, in_features] (the reference)."""
        parts = dict(self.stored.items())
        if self.fmt.method != "fp8":
            parts["g_idx"] = parts.pop("group_index")
        return self.fmt.dequantize(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(rows.dtype)
        if self.kernel == "reference":
            y = F.linear(rows, self.dequantized().to(rows.dtype), bias)
        elif self.fmt.method == "fp8":
            y = _triton().fp8_linear(rows, self.stored["weight"], self.stored[self.fmt.scale_name], self.fmt.block, bias)
        else:
            s = self.stored
            y = _triton().int4_linear(rows, s["qweight"], s["qzeros"], s["scales"], s["group_index"],
                                      self.fmt.method == "awq", self.fmt.zero_offset, bias)
        return y.reshape(*shape[:-1], self.out_features)


def fuse_parts(fmt: QuantFormat, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """One layer's tensors holding `parts`' output rows end to end, or None where their scales do
    not line up (int4 parts with different group indices, fp8 blocks that a part boundary splits)."""
    if len(parts) == 1:
        return parts[0]
    if fmt.method == "fp8":
        if fmt.block is not None and any(part["weight"].shape[0] % fmt.block[0] for part in parts[:-1]):
            return None
        scales = [part[fmt.scale_name].reshape(-1, 1) if fmt.block is None else part[fmt.scale_name] for part in parts]
        if fmt.block is None and any(scale.numel() == 1 for scale in scales):  # per tensor: each part's own
            scales = [scale.expand(part["weight"].shape[0], 1) for scale, part in zip(scales, parts)]
        return {"weight": torch.cat([part["weight"] for part in parts]), fmt.scale_name: torch.cat(scales)}
    if "g_idx" in parts[0] and any(not torch.equal(part["g_idx"], parts[0]["g_idx"]) for part in parts[1:]):
        return None
    fused = {key: torch.cat([part[key] for part in parts], dim=1) for key in ("qweight", "qzeros", "scales")}
    return fused | ({"g_idx": parts[0]["g_idx"]} if "g_idx" in parts[0] else {})


def _kept(model: DecoderForCausalLM, quantized: set[str]) -> list[tuple[nn.Module, str, list[str]]]:
    """(module, attribute, [Hugging Face layers]) of each projection to keep as stored: a dense
    projection whose every part is in `quantized` (the checkpoint's quantized layers), and an
    untied LM head that is."""
    kept = [(owner, attribute, names) for owner, attribute, names in model.dense_projections()
            if all(name in quantized for name in names)]
    if "lm_head" in quantized and model.lm_head is not None:
        kept.append((model, "lm_head", ["lm_head"]))
    return kept


def allocate_all_but_kept(model: DecoderForCausalLM, loaded: LoadedModel, device: torch.device) -> set[str]:
    """`model.to_empty(device)` (a model built on the meta device) except the weights of the
    layers `keep_hf_quantized` will replace, which stay on meta (their biases get memory: they are
    loaded as float). Returns those layers' names: `LoadedModel.iter_weights`'s placeholders."""
    kept = _kept(model, loaded.quantized_layers())
    skipped = {id(getattr(owner, attribute)) for owner, attribute, _ in kept}
    for module in model.modules():
        if id(module) not in skipped:
            module.to_empty(device=device, recurse=False)
        elif module.bias is not None:
            module.bias = nn.Parameter(torch.empty_like(module.bias, device=device), requires_grad=False)
    return {name for _, _, names in kept for name in names}


def keep_hf_quantized(model: DecoderForCausalLM, loaded: LoadedModel, kernel: str,
                      device: torch.device) -> dict[str, int]:
    """Replace `model`'s dense projections and LM head by `QuantizedLinear`s on `device` over
    `loaded`'s stored tensors where they are quantized (under tensor parallelism, this rank's part
    of each, cut with its scales: `QuantFormat.shard`; a row-parallel one keeps its all-reduce).
    Returns {"kept": n, "float": m} layers (float: quantized in the checkpoint, dequantized here:
    an expert's or latent attention's)."""
    fmt = loaded.quant_format
    quantized = loaded.quantized_layers()
    kept = _kept(model, quantized)
    names = {name for _, _, layer_names in kept for name in layer_names}
    stored = {name: fmt.shard(name, parts, model.projection_slice(name))  # this rank's cut, in host memory
              for name, parts in loaded.iter_quantized(skip=quantized - names)}
    for owner, attribute, layer_names in kept:
        parts = [{part: tensor.to(device) for part, tensor in stored.pop(name).items()} for name in layer_names]
        fused = fuse_parts(fmt, parts)

        def make(bias: torch.Tensor | None, parts=parts, fused=fused, names=layer_names) -> nn.Module:
            if fused is not None:
                return QuantizedLinear(fmt, fused, kernel, bias, names[0])
            return ConcatLinear([QuantizedLinear(fmt, part, kernel, name=name) for part, name in zip(parts, names)],
                                bias)

        replace_linear(owner, attribute, make)
    counts = {"kept": len(kept), "float": len(quantized - names)}
    logger.info("%s weights kept as stored: %d layers (%s kernels); %d quantized layers dequantized (experts, "
                "latent attention)", fmt.method, counts["kept"], kernel, counts["float"])
    return counts


@functools.cache
def _triton():
    """engine.model.triton_quant, imported on first use: the interpreter's switch
    (`TRITON_INTERPRET`) is set by then, by the Triton attention backend."""
    from engine.model import triton_quant
    return triton_quant

"""`--quantization gguf` (and `auto` for a .gguf model): a GGUF model's linear weights kept in the
file's own blocks; `--quantization int8`: any float model's quantized at load to GGUF's Q8_0
(`quantize_to_q8_0`), served by the same kernels.

The model is first built and loaded as usual, from the converted (dequantized) folder; then every
projection whose GGUF tensors are in a kept format (`quant_linear.GGML_TYPES`: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is replaced by a `GGUFLinear` over the file's bytes, and so is the token
embedding (its rows dequantized as they are looked up) and the LM head (a tied one shares the
embedding's bytes). A layer with a tensor in another format (Q2_K, Q3_K, IQ4_XS, ...) keeps its float
weights, and the count of each is logged. (The float load first is a cost, of load time and peak
memory, that loading only the float layers would save.) A fused projection (q | k | v, gate | up) is the file's tensors' rows end to end
when they share a format, else a `ConcatLinear` of one `GGUFLinear` per tensor; llama's permuted
Q/K rows are put back in Hugging Face order as the converter does (whole rows move: the blocks
run along a row).

What the dequantized model computes and what this one computes differ only by the order of fp32
sums (the kernels dequantize exactly as the reference does); the weights held are the file's bytes.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.model.decoder import DecoderForCausalLM
from engine.model.gguf_index import read_gguf_index
from engine.model.gguf_loader import PERMUTED_QK_ARCHITECTURES, unpermute_qk
from engine.model.layers import replace_linear
from engine.model.quant_linear import BLOCK, BLOCK_BYTES, GGML_TYPES, ConcatLinear, GGUFLinear, quantize, shard_packed

logger = logging.getLogger(__name__)


class GGUFEmbedding(nn.Module):
    """nn.Embedding over a GGUF-quantized table: the rows looked up are dequantized (float32)."""

    def __init__(self, linear: GGUFLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = linear  # shared with a tied LM head: one copy of the bytes
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(input_ids).to(self.dtype)


def keep_gguf_quantized(model: DecoderForCausalLM, gguf_path: str) -> dict[str, int]:
    """Replace `model`'s linear layers by `GGUFLinear`s over `gguf_path`'s tensors where their
    format is kept (under tensor parallelism, this rank's rows or input columns of each).
    Returns {"kept": n, "float": m} layers."""
    index = read_gguf_index(gguf_path)
    tensors = index.tensors
    permuted = index.architecture in PERMUTED_QK_ARCHITECTURES
    arch = model.arch
    dtype = model.embed_tokens.weight.dtype
    counts = {"kept": 0, "float": 0}

    def packed(name: str, heads: int | None = None, piece=None) -> tuple[int, torch.Tensor] | None:
        tensor = tensors.get(name)
        if tensor is None or int(tensor.tensor_type) not in BLOCK_BYTES:
            return None
        rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)
        if heads is not None and permuted:
            rows = unpermute_qk(rows, heads)
        ggml_type = int(tensor.tensor_type)
        rows = torch.from_numpy(np.array(rows))  # a copy: the file is closed after
        return ggml_type, shard_packed(name, rows, ggml_type, piece)

    def replace(owner: nn.Module, attribute: str, parts: list[tuple[int, torch.Tensor] | None]) -> None:
        if None in parts:
            counts["float"] += 1
            return
        in_features = getattr(owner, attribute).in_features
        types = {part[0] for part in parts}

        def make(bias: torch.Tensor | None) -> nn.Module:
            if len(types) == 1:  # one matmul over the parts' rows end to end
                return GGUFLinear(torch.cat([part[1] for part in parts]), next(iter(types)), in_features, bias)
            # e.g. Q5_0 q and k beside a Q8_0 v: one matmul per part
            return ConcatLinear([GGUFLinear(rows, kind, in_features) for kind, rows in parts], bias)

        replace_linear(owner, attribute, make)
        counts["kept"] += 1

    for owner, attribute, names in _projections(model):
        replace(owner, attribute, [packed(name, heads, piece) for name, heads, piece in names])
    embedding = packed("token_embd.weight")
    if embedding is not None:
        table = GGUFLinear(embedding[1], embedding[0], arch.hidden_size)
        model.embed_tokens = GGUFEmbedding(table, dtype)
        counts["kept"] += 1
        if model.lm_head is None:  # tied: the same bytes
            model.lm_head = table
    if model.lm_head is not None and not isinstance(model.lm_head, GGUFLinear):
        head = packed("output.weight")
        if head is not None:
            model.lm_head = GGUFLinear(head[1], head[0], arch.hidden_size)
            counts["kept"] += 1
    logger.info("GGUF weights kept as stored: %d layers; %d left in float (formats not kept: %s)",
                counts["kept"], counts["float"], ", ".join(sorted(_other_formats(tensors))) or "none")
    return counts


# A Hugging Face projection's GGUF tensor, and the heads whose rows llama's converter permuted
_GGUF_NAMES = {"self_attn.q_proj": ("attn_q", lambda arch: arch.num_attention_heads),
               "self_attn.k_proj": ("attn_k", lambda arch: arch.num_key_value_heads),
               "self_attn.v_proj": ("attn_v", None), "self_attn.o_proj": ("attn_output", None),
               "mlp.gate_proj": ("ffn_gate", None), "mlp.up_proj": ("ffn_up", None), "mlp.down_proj": ("ffn_down", None)}


def _projections(model: DecoderForCausalLM):
    """`model.dense_projections()` with each part's (GGUF tensor name, heads to unpermute or None,
    this rank's piece of it: `model.projection_slice`)."""
    for owner, attribute, names in model.dense_projections():
        parts = []
        for name in names:
            _, index, projection = re.match(r"model\.layers\.(\d+)\.(.+)$", name).group(0, 1, 2)
            gguf_name, heads = _GGUF_NAMES[projection]
            parts.append((f"blk.{index}.{gguf_name}.weight", None if heads is None else heads(model.arch),
                          model.projection_slice(name)))
        yield owner, attribute, parts


def quantize_to_q8_0(model: DecoderForCausalLM) -> dict[str, int]:
    """`--quantization int8`: every dense projection, the token embedding and the LM head of a
    float model (this rank's part of each under tensor parallelism) quantized at load to Q8_0
    (int8 weights with an fp16 scale per 32, llama.cpp's quantizer, `quant_linear.quantize`) and
    served by `GGUFLinear`. A weight whose
    in_features is not a multiple of 32 stays float. Returns {"kept": n, "float": m} layers."""
    q8_0 = GGML_TYPES["Q8_0"]
    counts = {"kept": 0, "float": 0}

    def quantized(weight: torch.Tensor, bias: torch.Tensor | None) -> GGUFLinear:
        return GGUFLinear(quantize(weight, q8_0), q8_0, weight.shape[1], bias)

    for owner, attribute, _ in _projections(model):
        weight = getattr(owner, attribute).weight  # this rank's: already cut by the float load
        if weight.shape[1] % BLOCK:
            counts["float"] += 1
            continue
        replace_linear(owner, attribute, lambda bias, weight=weight: quantized(weight, bias))
        counts["kept"] += 1
    if model.arch.hidden_size % BLOCK == 0:  # the embedding and LM head (whole on every rank)
        table = quantized(model.embed_tokens.weight, None)
        model.embed_tokens = GGUFEmbedding(table, model.embed_tokens.weight.dtype)
        counts["kept"] += 1
        if model.lm_head is None:  # tied: the same bytes
            model.lm_head = table
        else:
            model.lm_head = quantized(model.lm_head.weight, None)
            counts["kept"] += 1
    else:
        counts["float"] += 1 + (model.lm_head is not None)
    logger.info("int8 (Q8_0) weights: %d layers; %d left in float", counts["kept"], counts["float"])
    return counts


def _other_formats(tensors: dict[str, Any]) -> set[str]:
    return {tensor.tensor_type.name for tensor in tensors.values()
            if len(tensor.shape) == 2 and int(tensor.tensor_type) not in BLOCK_BYTES
            and tensor.tensor_type.name not in ("F32", "F16", "BF16")}

"""The decoder every model family runs, over a flattened token batch.

One configurable decoder for every family (engine/model/families/ reads each config.json into
an `engine.model.arch.ModelArchConfig`): Llama 2/3 (llama3 RoPE scaling), SmolLM2, Mistral and
Qwen2-style qkv bias, GQA and tied embeddings are the plain case; the fields of the config add
per-head or whole-projection q/k norms (Qwen3, Gemma 3, OLMo 2), norms on the attention and MLP
outputs (Gemma, OLMo 2), norms that multiply by 1 + w and scaled embeddings (Gemma), GeGLU MLPs,
attention scales, soft-caps of attention scores and logits, sliding-window layers (each layer's
`AttentionVariant`) with their own RoPE base, and partial rotary dims. Inputs are all scheduled
tokens of all sequences concatenated (`[num_tokens]`); each layer stores its new keys/values in
the paged KV cache and attends through the attention backend (see `engine.attention.metadata`
for the batch contract). Weights arrive in Hugging Face naming and layout; Q/K/V and gate/up are
fused into one matmul each (a checkpoint that holds them fused, Phi-3's, is split at load).

A layer's norms have roles (`arch.layer_norms`): `input` (before attention), `attn_out` (on the
attention's output, before the residual add), `mlp_in`, `mlp_out`; each is a module under its
Hugging Face name. Llama has input and mlp_in; Gemma all four; OLMo 2 the two output norms.

Tensor parallelism (`tp`, an `engine.parallel.TensorParallelGroup`; None: one process, today's
code exactly), Megatron-style: the fused QKV and gate/up projections are column-parallel (each
rank computes its query heads, its KV heads and its slice of the MLP's intermediate columns), and
o_proj and down_proj are row-parallel (each rank multiplies its slice of the inputs; the partial
sums are all-reduced, then the bias, if any, is added once). With fewer KV heads than ranks each
KV head is replicated: a rank holds the one KV head its query heads read. The embedding, the
norms and the LM head are replicated, so every rank computes the same residual stream and rank 0
has the full logits (followers skip the LM head: `compute_logits=False`). A norm over the whole
q / k projection (OLMo 2) all-reduces each row's sum of squares. `TensorParallelShard` says what
a rank holds; `load_weights` cuts it out of the Hugging Face tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import dataclasses
import re

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.attention.variant import AttentionVariant
from engine.model import fused_ops
from engine.model.arch import NORM_ROLES, ModelArchConfig, canonical_weights
from engine.model.layers import GatedMLP, Linear, RMSNorm, RowParallelLinear
from engine.model.mla import LatentAttention
from engine.model.moe import SparseMoE
from engine.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from engine.parallel import TensorParallelGroup


def check_tensor_parallel(arch: ModelArchConfig, size: int) -> None:
    """ValueError naming the numbers unless `size` ranks can split this model's heads and MLP."""
    heads, kv_heads, inter = arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads ({heads}) is not divisible by it")
    if kv_heads % size and size % kv_heads:
        problems.append(f"num_key_value_heads ({kv_heads}) neither divides it nor is divisible by it")
    if inter % size:
        problems.append(f"intermediate_size ({inter}) is not divisible by it")
    if arch.num_experts and arch.moe_intermediate_size % size:
        problems.append(f"the experts' intermediate size ({arch.moe_intermediate_size}) is not divisible by it")
    if arch.num_experts and arch.moe_shared_intermediate_size % size:
        problems.append(f"the shared experts' intermediate size ({arch.moe_shared_intermediate_size}) is not "
                        "divisible by it")
    if problems:
        valid = [n for n in range(1, heads + 1)
                 if heads % n == 0 and inter % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)
                 and not (arch.num_experts and (arch.moe_intermediate_size % n or arch.moe_shared_intermediate_size % n))]
        raise ValueError(f"tensor_parallel_size {size} cannot split {arch.architecture}: "
                         f"{'; '.join(problems)} (sizes that can: {', '.join(map(str, valid))})")


@dataclass(frozen=True)
class TensorParallelShard:
    """What one rank holds: query heads `[head_start, head_start + num_heads)`, KV heads
    `[kv_head_start, kv_head_start + num_kv_heads)` (one replicated head when the model has fewer
    KV heads than ranks) and the MLP's intermediate columns `[inter_start, inter_start +
    intermediate_size)`. Rank 0 of 1 holds the whole model."""

    rank: int
    size: int
    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    inter_start: int

    @classmethod
    def of(cls, arch: ModelArchConfig, rank: int = 0, size: int = 1) -> "TensorParallelShard":
        check_tensor_parallel(arch, size)
        heads = arch.num_attention_heads // size
        if arch.num_key_value_heads >= size:
            kv_heads, kv_start = arch.num_key_value_heads // size, rank * (arch.num_key_value_heads // size)
        else:  # replicated: rank r's query heads all read KV head r // (size / num_kv_heads)
            kv_heads, kv_start = 1, rank // (size // arch.num_key_value_heads)
        inter = arch.intermediate_size // size
        return cls(rank, size, heads, rank * heads, kv_heads, kv_start, inter, rank * inter)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_index: int, shard: TensorParallelShard,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = shard.num_heads  # this rank's (all of them without tensor parallelism)
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = arch.attention_scale or self.head_dim ** -0.5
        self.tp = tp
        sliding = arch.is_sliding(layer_index)
        self.local_rope = sliding and arch.rope_local_theta is not None  # the model's `rotary_local`
        self.variant = AttentionVariant(sliding_window=arch.sliding_window if sliding else None,
                                        softcap=arch.attn_logit_softcap)
        # gpt-oss: this rank's heads' learned sink logits, joined into the variant at each call
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if arch.attention_sinks else None
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = RowParallelLinear(self.q_size, arch.hidden_size, arch.o_proj_bias, tp)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm is not None:
            per_head = arch.qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else self.q_size, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else self.kv_size, arch.rms_norm_eps)
            # a whole-projection norm's width, and how many ranks hold each KV head (under TP)
            self._norm_widths = (arch.q_size, arch.kv_size)
            self._kv_replicas = max(1, shard.size // arch.num_key_value_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: torch.Tensor, meta: AttentionMetadata, backend, rows: torch.Tensor | None = None,
                rows_meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Attention output of every token, or with `rows` only of those tokens (each the last of
        its sequence, described by `rows_meta`); every token's K/V is stored either way."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "projection":
            q = self._projection_norm(q, self.q_norm, self._norm_widths[0], 1)
            k = self._projection_norm(k, self.k_norm, self._norm_widths[1], self._kv_replicas)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        variant = self.variant if self.sinks is None else dataclasses.replace(self.variant, sinks=self.sinks)
        if rows is None:
            out = backend.forward(q, k, v.contiguous(), kv_cache, meta, self.scale, variant)
            return self.o_proj(out.reshape(num_tokens, self.q_size))
        backend.store_kv(k, v, kv_cache, meta.slot_mapping)
        # The backend stores the rows' K/V again (the same values) and attends one query each.
        q, k, v = (x.index_select(0, rows) for x in (q, k, v))
        out = backend.forward(q, k, v, kv_cache, rows_meta, self.scale, variant)
        return self.o_proj(out.reshape(rows.shape[0], self.q_size))

    def _projection_norm(self, x: torch.Tensor, norm: RMSNorm, width: int, replicas: int) -> torch.Tensor:
        """RMSNorm over a whole projection of `width` values of which this rank holds its heads'
        (each held by `replicas` ranks): the sum of squares is all-reduced under TP."""
        if self.tp is None:
            return norm(x.contiguous())
        x32 = x.float()
        squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / replicas
        return norm.weight * (x32 * torch.rsqrt(squares / width + norm.eps)).to(x.dtype)


class DecoderLayer(nn.Module):
    """Attention and MLP with the norms `arch.layer_norms` names, each a module under its Hugging
    Face name; `norms` holds them by role (None where the family has none)."""

    def __init__(self, arch: ModelArchConfig, layer_index: int, shard: TensorParallelShard,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.self_attn = (LatentAttention if arch.is_mla else Attention)(arch, layer_index, shard, tp)
        self.mlp = SparseMoE(arch, shard, tp) if arch.is_moe(layer_index) else GatedMLP(arch, shard, tp)
        by_role = {}
        for role, name in arch.layer_norms:
            setattr(self, name, RMSNorm(arch.hidden_size, arch.rms_norm_eps))
            by_role[role] = getattr(self, name)
        # a plain tuple, not registered a second time as submodules
        self.norms: tuple[RMSNorm | None, ...] = tuple(by_role.get(role) for role in NORM_ROLES)


def _add_then_norm(norm: RMSNorm | None, pending: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """`residual += pending` in place (none before the first layer), then the norm of the sum, or
    the sum itself for a family without that norm."""
    if pending is None:
        return residual if norm is None else norm(residual)
    if norm is None:
        return residual.add_(pending)
    return norm.add_forward(pending, residual)


class DecoderForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, max_model_len: int | None = None,
                 tp: TensorParallelGroup | None = None) -> None:
        """`tp`: this rank's tensor-parallel group (None: the whole model in this process);
        ValueError if its size cannot split the model (`check_tensor_parallel`)."""
        super().__init__()
        self.arch = arch
        rank, size = (tp.rank, tp.world_size) if tp is not None else (0, 1)
        self.shard = TensorParallelShard.of(arch, rank, size)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, self.shard, tp) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.lm_head_packed: torch.Tensor | None = None  # tied: the embedding's pre-blocked copy
        self.init_rotary(max_model_len or arch.max_position_embeddings)

    def init_rotary(self, max_position: int, device: torch.device | str | None = None) -> None:
        """The RoPE tables for `max_position` positions: `rotary` (full layers, and every layer
        unless sliding ones have their own base) and `rotary_local` (Gemma 3's sliding layers)."""
        arch = self.arch
        partial = {} if arch.rotary_dim is None else {"rotary_dim": arch.rotary_dim}
        self.rotary = RotaryEmbedding(arch.rope_dim, max_position, arch.rope_theta, arch.rope_scaling,
                                      **partial).to(device)
        self.rotary_local = None if arch.rope_local_theta is None else RotaryEmbedding(
            arch.rope_dim, max_position, arch.rope_local_theta, None, **partial).to(device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata | list[AttentionMetadata], backend, logits_indices: torch.Tensor | None = None,
                logits_meta: AttentionMetadata | list[AttentionMetadata] | None = None,
                on_layer_stored: Callable[[int], None] | None = None,
                compute_logits: bool = True) -> torch.Tensor | None:
        """Returns fp32 logits for the tokens at `logits_indices` (all tokens when None); None
        with `compute_logits=False` (a tensor-parallel follower: every layer, no LM head).

        With `logits_meta` (one query token per sequence that samples: the last token of each, as
        `logits_indices` lists them), the last layer stores every token's K/V but computes its
        attention output and MLP only for those rows: nothing else reads them (llama.cpp does
        the same). A prefill step of N tokens that samples one saves ~1/num_layers of its work.
        `on_layer_stored(i)`: called right after layer i stored its K/V, before its MLP (the KV
        connector pushes finished layers while the next ones compute).
        `meta` and `logits_meta` may be lists, one per layer: a grouped KV cache's layers read
        their own groups' block tables (engine/kv_groups.py).
        """
        # `residual` is the block's residual stream, updated in place by each add (+ norm);
        # `pending` the output of the last attention or MLP (after its output norm, if any), not
        # yet added to it.
        residual = self.embed_tokens(input_ids)
        if self.arch.embed_scale is not None:
            residual = residual * torch.tensor(self.arch.embed_scale, dtype=residual.dtype)
        pending = None
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            input_norm, attn_out_norm, mlp_in_norm, mlp_out_norm = layer.norms
            attn = layer.self_attn
            rotary = self.rotary_local if attn.local_rope else self.rotary
            normed = _add_then_norm(input_norm, pending, residual)
            layer_meta = meta[index] if isinstance(meta, list) else meta
            if index == last and logits_meta is not None and logits_indices is not None:
                hidden = attn(positions, normed, rotary, kv_cache, layer_meta, backend, rows=logits_indices,
                              rows_meta=logits_meta[index] if isinstance(logits_meta, list) else logits_meta)
                residual = residual.index_select(0, logits_indices)
                logits_indices = None  # the rows are selected already
            else:
                hidden = attn(positions, normed, rotary, kv_cache, layer_meta, backend)
            if on_layer_stored is not None:
                on_layer_stored(index)
            pending = hidden if attn_out_norm is None else attn_out_norm(hidden)
            hidden = layer.mlp(_add_then_norm(mlp_in_norm, pending, residual))
            pending = hidden if mlp_out_norm is None else mlp_out_norm(hidden)
        if not compute_logits:
            return None
        hidden = residual + pending if pending is not None else residual
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        hidden = self.norm(hidden)
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = fused_ops.linear(hidden, self.embed_tokens.weight, packed=self.lm_head_packed)
        cap = self.arch.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def prepack_linear_weights(self) -> bool:
        """Give every linear layer (and a tied LM head) a pre-blocked copy of its weight where
        `fused_ops.prepack_linear_weight` applies (bf16 with AVX512-BF16, and float32, on CPU); call
        after the weights are loaded. Returns whether it applied."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for module in linears:
            module.packed = fused_ops.prepack_linear_weight(module.weight)
        if self.lm_head is None:
            self.lm_head_packed = fused_ops.prepack_linear_weight(self.embed_tokens.weight)
        return all(m.packed is not None for m in linears)

    def dense_projections(self) -> Iterator[tuple[nn.Module, str, list[str]]]:
        """(module, attribute, [Hugging Face layer names]) of each dense projection a quantized
        checkpoint may keep as stored: attention's qkv and output (not latent attention's), a dense
        MLP's gate|up and down (not a mixture of experts'), in the fused projection's row order."""
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            if isinstance(layer.self_attn, Attention):
                yield layer.self_attn, "qkv_proj", [prefix + f"self_attn.{p}_proj" for p in "qkv"]
                yield layer.self_attn, "o_proj", [prefix + "self_attn.o_proj"]
            if isinstance(layer.mlp, GatedMLP):
                yield layer.mlp, "gate_up_proj", [prefix + "mlp.gate_proj", prefix + "mlp.up_proj"]
                yield layer.mlp, "down_proj", [prefix + "mlp.down_proj"]

    def projection_slice(self, hf_layer: str) -> tuple[int, int, int] | None:
        """The part of a dense projection's Hugging Face weight [out, in] this rank holds, as
        (dim, start, length): rows (dim 0) of the column-parallel q / k / v (by heads) and gate / up
        (by intermediate columns), input columns (dim 1) of the row-parallel o_proj and down_proj;
        None on one process (the whole weight). For weights that are not loaded as float tensors
        (quantized ones, cut with their scales)."""
        shard = self.shard
        if shard.size == 1:
            return None
        head_dim = self.arch.head_dim
        heads = (0, shard.head_start * head_dim, shard.num_heads * head_dim)
        kv_heads = (0, shard.kv_head_start * head_dim, shard.num_kv_heads * head_dim)
        inter = (0, shard.inter_start, shard.intermediate_size)
        slices = {"q_proj": heads, "k_proj": kv_heads, "v_proj": kv_heads, "o_proj": (1, *heads[1:]),
                  "gate_proj": inter, "up_proj": inter, "down_proj": (1, *inter[1:])}
        return slices[hf_layer.rsplit(".", 1)[-1]]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this process holds: the parameters and their pre-blocked copies."""
        packed = [m.packed for m in self.modules() if isinstance(m, Linear)] + [self.lm_head_packed]
        return (sum(p.numel() * p.element_size() for p in self.parameters())
                + sum(p.numel() * p.element_size() for p in packed if p is not None))

    # ---- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter must be set.
        A tensor-parallel rank copies only its shard (`_shard_of`) of each.

        Missing or misshapen tensors raise ValueError naming the tensor and both shapes.
        """
        params = dict(self.named_parameters())
        pending = {name: _expected_sources(name, self.arch) for name in params}
        full_shapes = self.arch.expected_weight_shapes() if self.shard.size > 1 else None
        # Gemma's norms multiply by 1 + w: the parameter holds 1 + w, added in float32
        norm_params = {f"{name}.weight" for name, module in self.named_modules() if isinstance(module, RMSNorm)}
        offset = self.arch.norm_weight_offset
        if self.arch.fused_checkpoint:
            weights = _split_fused(weights, self.arch)
        seen: set[str] = set()
        for hf_name, tensor in canonical_weights(weights, self.arch.expert_layout):
            if self.arch.is_skipped_weight(hf_name):
                continue
            expert = _EXPERT.match(hf_name)
            if expert is not None:
                self._load_expert(expert, tensor, params, full_shapes)
                seen.add(hf_name)
                continue
            param_name, part = _hf_to_param(hf_name)
            if part is not None and hf_name.removeprefix("model.") in params:  # MLA's own q_proj
                param_name, part = hf_name.removeprefix("model."), None
            if param_name not in params:
                if param_name == "lm_head.weight" and self.lm_head is None:
                    continue  # tied: the checkpoint may still carry a copy
                raise ValueError(f"unexpected tensor {hf_name!r} for {self.arch.architecture}")
            if full_shapes is not None:
                _check_shape(hf_name, tensor, full_shapes.get(hf_name, tuple(tensor.shape)), self.arch)
                tensor = self._shard_of(hf_name, part, tensor, params[param_name])
            param = params[param_name]
            dest = param.data if part is None else param.data.narrow(0, *self._fused_rows(part, param))
            _check_shape(hf_name, tensor, tuple(dest.shape), self.arch)
            if offset and param_name in norm_params:
                tensor = tensor.float() + offset
            dest.copy_(tensor.to(dest.dtype))
            seen.add(hf_name)
        missing = sorted(src for sources in pending.values() for src in sources if src not in seen)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing tensors: {shown}")

    def _load_expert(self, match: re.Match, tensor: torch.Tensor, params: dict, full_shapes: dict | None) -> None:
        """One expert's gate, up or down projection into its rows of the layer's expert tensors
        (this rank's intermediate slice under TP)."""
        hf_name, (layer, expert, proj, kind) = match.group(0), match.groups()
        moe = self.layers[int(layer)].mlp
        if not isinstance(moe, SparseMoE) or f"layers.{layer}.mlp.experts_gate_up{'_bias' * (kind == 'bias')}" not in params:
            raise ValueError(f"unexpected tensor {hf_name!r} for {self.arch.architecture}")
        inter, suffix = moe.intermediate_size, "_bias" if kind == "bias" else ""
        if full_shapes is not None:
            _check_shape(hf_name, tensor, full_shapes[hf_name], self.arch)
            if proj != "down":
                tensor = tensor.narrow(0, moe.inter_start, inter)
            elif kind == "weight":
                tensor = tensor.narrow(1, moe.inter_start, inter)
        if proj == "down":
            dest = params[f"layers.{layer}.mlp.experts_down{suffix}"].data[int(expert)]
        else:
            dest = params[f"layers.{layer}.mlp.experts_gate_up{suffix}"].data[int(expert)].narrow(
                0, 0 if proj == "gate" else inter, inter)
        _check_shape(hf_name, tensor, tuple(dest.shape), self.arch)
        dest.copy_(tensor.to(dest.dtype))

    def _fused_rows(self, part: str, param: torch.Tensor) -> tuple[int, int]:
        """(first row, rows) of a Hugging Face projection in its fused parameter, on this rank
        (an MLP's gate|up halves from the parameter: dense and shared MLPs differ in width)."""
        head_dim, shard = self.arch.head_dim, self.shard
        q, kv, inter = shard.num_heads * head_dim, shard.num_kv_heads * head_dim, param.shape[0] // 2
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (0, inter), "up": (inter, inter)}[part]

    def _shard_of(self, hf_name: str, part: str | None, tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole Hugging Face tensor: rows of the column-parallel
        projections (q/k/v by heads, gate/up by intermediate columns), input columns of the
        row-parallel ones (o_proj, down_proj); the rest (and o_proj's bias) whole. An MLP's
        slice is as wide as this rank's `param` (the dense and the shared MLPs differ)."""
        head_dim, shard = self.arch.head_dim, self.shard
        if part == "q":
            return tensor.narrow(0, shard.head_start * head_dim, shard.num_heads * head_dim)
        if part in ("k", "v"):
            return tensor.narrow(0, shard.kv_head_start * head_dim, shard.num_kv_heads * head_dim)
        if part in ("gate", "up"):
            inter = param.shape[0] // 2
            return tensor.narrow(0, shard.rank * inter, inter)
        if self.arch.qk_norm == "projection" and hf_name.endswith((".q_norm.weight", ".k_norm.weight")):
            heads, start = ((shard.num_heads, shard.head_start) if hf_name.endswith(".q_norm.weight")
                            else (shard.num_kv_heads, shard.kv_head_start))
            return tensor.narrow(0, start * head_dim, heads * head_dim)
        if hf_name.endswith(".self_attn.sinks"):
            return tensor.narrow(0, shard.head_start, shard.num_heads)
        # the rest is whole, or this rank's equal slice along the one dimension that is split
        # (rows by heads or intermediate columns; o_proj's and down_proj's input columns)
        split = [d for d in range(tensor.dim()) if tensor.shape[d] != param.shape[d]]
        if not split:
            return tensor
        return tensor.narrow(split[0], shard.rank * param.shape[split[0]], param.shape[split[0]])


def _check_shape(hf_name: str, tensor: torch.Tensor, expected: tuple[int, ...], arch: ModelArchConfig) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)} "
                         f"for {arch.architecture} with this config.json")


_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


def _split_fused(weights: Iterable[tuple[str, torch.Tensor]], arch: ModelArchConfig):
    """A checkpoint's fused `qkv_proj` / `gate_up_proj` (Phi-3) as the q/k/v and gate/up tensors
    a Llama checkpoint holds, so sharding and fusing read one layout."""
    for name, tensor in weights:
        if name.endswith(".self_attn.qkv_proj.weight"):
            _check_shape(name, tensor, (arch.q_size + 2 * arch.kv_size, arch.hidden_size), arch)
            prefix = name.removesuffix("qkv_proj.weight")
            q, k, v = tensor.split([arch.q_size, arch.kv_size, arch.kv_size])
            yield from ((prefix + "q_proj.weight", q), (prefix + "k_proj.weight", k), (prefix + "v_proj.weight", v))
        elif name.endswith(".mlp.gate_up_proj.weight"):
            _check_shape(name, tensor, (2 * arch.intermediate_size, arch.hidden_size), arch)
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            yield from ((prefix + "gate_proj.weight", gate), (prefix + "up_proj.weight", up))
        else:
            yield name, tensor


def _hf_to_param(hf_name: str) -> tuple[str, str | None]:
    """HF tensor name -> (our parameter name, its part of a fused parameter or None for a whole
    one)."""
    name = hf_name.removeprefix("model.")
    for hf_part, (fused, part) in _FUSED.items():
        marker = f".{hf_part}."
        if marker in name:
            return name.replace(marker, f".{fused}."), part
    return name, None


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")


def _expected_sources(param_name: str, arch: ModelArchConfig) -> list[str]:
    """The HF tensor names (in `canonical_weights`' naming) that together fill one of our parameters."""
    experts = re.match(r"^(layers\.\d+\.mlp)\.experts_(gate_up|down)(_bias)?$", param_name)
    if experts is not None:
        prefix, kind = "model." + experts.group(1), "bias" if experts.group(3) else "weight"
        projs = ("down",) if experts.group(2) == "down" else ("gate", "up")
        return [f"{prefix}.experts.{e}.{proj}_proj.{kind}" for e in range(arch.num_experts) for proj in projs]
    if param_name == "lm_head.weight":
        return ["lm_head.weight"]
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in param_name:
            return ["model." + param_name.replace(f".{fused}.", f".{p}.") for p in parts]
    return ["model." + param_name]


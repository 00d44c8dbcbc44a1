"""The mixture-of-experts layer: a `Router` that picks each token's experts and their weights, and
`SparseMoE`, whose experts run grouped (`run_experts`).

`run_experts` is the one seam every expert kernel sits behind: given the tokens, their routing
(weights and expert ids, `[tokens, top_k]`) and the stacked expert weights, it returns the
weighted sum of each token's experts' outputs. Its reference, `grouped_experts_torch`, sorts the
(token, expert) pairs by expert and runs one matmul pair per expert that any token chose; the
kernels are tested against it (tests/engine/test_moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model import fused_ops
from engine.model.arch import ModelArchConfig
from engine.model.layers import GATED_ACTS, GatedMLP

if TYPE_CHECKING:
    from engine.model.decoder import TensorParallelShard
    from engine.parallel import TensorParallelGroup


@dataclass(frozen=True)
class ExpertActivation:
    """The experts' activation over a `[gate | up]` row: "silu" (SwiGLU), "gelu_pytorch_tanh"
    (GeGLU), or "clamped_swiglu" (gpt-oss: `(up + 1) * gate * sigmoid(alpha * gate)`, gate
    clamped above at `limit`, up to `[-limit, limit]`)."""

    kind: str
    alpha: float = 0.0
    limit: float = 0.0

    @classmethod
    def of(cls, arch: ModelArchConfig) -> "ExpertActivation":
        if arch.swiglu_limit is not None:
            return cls("clamped_swiglu", arch.swiglu_alpha, arch.swiglu_limit)
        return cls(arch.hidden_act)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kind != "clamped_swiglu":
            return GATED_ACTS[self.kind](gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass
class ExpertWeights:
    """A layer's stacked experts as this rank holds them: `gate_up` `[experts, 2 * inter, hidden]`
    (each expert's gate rows, then its up rows), `down` `[experts, hidden, inter]`, optional
    biases (`down_bias` None on the ranks that must not add it) and the activation."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    activation: ExpertActivation


def grouped_experts_torch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                          w: ExpertWeights) -> torch.Tensor:
    """The reference: (token, expert) pairs sorted by expert, one matmul pair per chosen expert,
    outputs scaled by the routing weight and added per token in expert order (as transformers
    sums them)."""
    top_k = experts.shape[1]
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k  # the token of each (token, expert) pair, sorted by expert
    pair_weights = weights.to(x.dtype).flatten().index_select(0, order)[:, None]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=w.gate_up.shape[0]).tolist()):
        if count:
            rows = tokens[start:start + count]
            gate_up_bias = None if w.gate_up_bias is None else w.gate_up_bias[expert]
            down_bias = None if w.down_bias is None else w.down_bias[expert]
            hidden = w.activation(fused_ops.linear(x.index_select(0, rows), w.gate_up[expert], gate_up_bias))
            out.index_add_(0, rows, fused_ops.linear(hidden, w.down[expert], down_bias) * pair_weights[start:start + count])
            start += count
    return out


def run_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """Each token's `sum_k weights[t, k] * expert[experts[t, k]](x[t])`, `[tokens, hidden]`."""
    if x.is_cuda:  # the Triton fused-MoE kernels, imported on first use (CPU-only installs need no Triton)
        from engine.model.triton_moe import fused_moe
        return fused_moe(x, weights, experts, w)
    # On CPU, a decode-sized batch (float32 or bf16, 1 to the kernel's `moe_experts_max_tokens()`,
    # 64, tokens) runs as one native call (engine/csrc/moe_cpu.cpp): each chosen expert's weights
    # read once for all its tokens, no per-expert Python. It sums as the reference does: float32
    # SwiGLU bit-identical (GeGLU's tanh and gpt-oss's sigmoid a few ulps apart), bf16 rounded where
    # the reference rounds. Larger batches (prefill chunks) and `PDSERVE_FUSED_OPS=0` take the
    # reference, whose per-expert GEMMs are faster there. (AVX-512 builds report the kernel absent
    # until its 16-lane path has run on such a machine: engine/csrc/moe_cpu.cpp.)
    native = fused_ops.native_for(x)
    if (native is not None and x.dim() == 2 and x.stride(1) == 1 and native.has_moe_experts()
            and 1 <= x.shape[0] <= native.moe_experts_max_tokens()
            and w.activation.kind in ("silu", "gelu_pytorch_tanh", "clamped_swiglu") and experts.dtype is torch.int64
            and all(t.dtype is x.dtype and t.is_contiguous()
                    for t in (w.gate_up, w.down, w.gate_up_bias, w.down_bias) if t is not None)):
        return native.moe_experts(x, weights.float(), experts, w.gate_up, w.down, w.gate_up_bias, w.down_bias,
                                  w.activation.kind, w.activation.alpha, w.activation.limit)
    return grouped_experts_torch(x, weights, experts, w)


class Router(nn.Module):
    """A mixture of experts' router (replicated under TP): each token's `top_k` experts and
    their weights, by `arch.moe_router`:
    - "softmax_topk" (Mixtral, Qwen3-MoE): softmax over every expert, the top k, renormalized to
      sum to 1 with `norm_topk_prob`;
    - "topk_softmax" (gpt-oss, biased): the top k logits, then their softmax;
    - "softmax_group_topk" (DeepSeek-V2's group-limited greedy): softmax over every expert; the
      choice keeps to the `moe_topk_groups` groups whose best score is highest;
    - "sigmoid_group_topk" (DeepSeek-V3, GLM-4.5), in float32: sigmoid scores; the choice adds
      `e_score_correction_bias` and keeps to the `moe_topk_groups` groups whose two best scores
      sum highest; the weights are the chosen plain scores.
    The chosen weights are renormalized with `norm_topk_prob`, then multiplied by
    `moe_routed_scaling` (1 but for DeepSeek's and GLM's)."""

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.kind, self.top_k, self.renormalize = arch.moe_router, arch.num_experts_per_tok, arch.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size))
        self.bias = nn.Parameter(torch.empty(arch.num_experts)) if arch.moe_bias else None
        grouped = self.kind == "sigmoid_group_topk"
        self.e_score_correction_bias = nn.Parameter(torch.empty(arch.num_experts)) if grouped else None
        self.groups, self.topk_groups, self.scaling = arch.moe_num_groups, arch.moe_topk_groups, arch.moe_routed_scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k] float32, experts [tokens, top_k])."""
        if self.kind == "sigmoid_group_topk":
            scores = torch.nn.functional.linear(x.float(), self.weight.float()).sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            by_group = choice.view(choice.shape[0], self.groups, -1)
            experts = torch.topk(self._in_best_groups(choice, by_group.topk(2, dim=-1)[0].sum(dim=-1)),
                                 self.top_k, dim=-1)[1]
            weights = scores.gather(1, experts)
        else:
            logits = fused_ops.linear(x, self.weight, self.bias)
            if self.kind == "topk_softmax":
                top, experts = torch.topk(logits, self.top_k, dim=-1)
                return torch.softmax(top, dim=-1), experts
            scores = torch.softmax(logits.float(), dim=-1)
            if self.kind == "softmax_group_topk":
                scores = self._in_best_groups(scores, scores.view(scores.shape[0], self.groups, -1).amax(dim=-1))
            weights, experts = torch.topk(scores, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts

    def _in_best_groups(self, choice: torch.Tensor, group_scores: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's `topk_groups` best groups at -inf."""
        best_groups = torch.topk(group_scores, self.topk_groups, dim=-1)[1]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        by_group = choice.view(choice.shape[0], self.groups, -1)
        return by_group.masked_fill(~allowed[..., None], float("-inf")).flatten(1)


class SparseMoE(nn.Module):
    """A mixture of gated experts (Mixtral, Qwen3-MoE, gpt-oss, GLM-4.5, DeepSeek): the `Router`
    (`gate`) picks `top_k` experts per token; each expert is a gated MLP of
    `moe_intermediate_size`, its gate|up rows in `experts_gate_up[e]` and its down projection in
    `experts_down[e]`, run by `run_experts`; plus the shared experts' MLP where the family has
    one. Under tensor parallelism every expert (and the shared MLP) is split along its
    intermediate dimension like a dense MLP, and the output is all-reduced once."""

    def __init__(self, arch: ModelArchConfig, shard: TensorParallelShard,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.intermediate_size = arch.moe_intermediate_size // shard.size  # this rank's
        self.inter_start = shard.rank * self.intermediate_size
        self.gate = Router(arch)
        self.experts_gate_up = nn.Parameter(torch.empty(arch.num_experts, 2 * self.intermediate_size, arch.hidden_size))
        self.experts_down = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size, self.intermediate_size))
        # biases (gpt-oss): gate|up's split like their rows; down's added once, by rank 0
        bias = arch.moe_bias
        self.experts_gate_up_bias = nn.Parameter(torch.empty(arch.num_experts, 2 * self.intermediate_size)) if bias else None
        self.experts_down_bias = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size)) if bias else None
        self._add_down_bias = bias and shard.rank == 0
        self.activation = ExpertActivation.of(arch)
        # partial sums under TP, like the experts': one all-reduce for both
        shared = arch.moe_shared_intermediate_size // shard.size
        self.shared_experts = GatedMLP(arch, shard, None, shared) if shared else None
        self.tp = tp

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(self.experts_gate_up, self.experts_down, self.experts_gate_up_bias,
                             self.experts_down_bias if self._add_down_bias else None, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = run_experts(x, weights, experts, self.expert_weights())
        if self.shared_experts is not None:
            out += self.shared_experts(x)
        return out if self.tp is None else self.tp.all_reduce(out)

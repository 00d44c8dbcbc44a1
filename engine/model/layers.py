"""The layers every model family shares: RMSNorm, Linear (with its optional pre-blocked weight),
the row-parallel Linear of tensor parallelism (engine/model/decoder.py says how TP splits a
model) and the gated MLP; `replace_linear` / `RowParallel` put a quantized linear in a Linear's
place, keeping a row-parallel one's all-reduce."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from engine.model import fused_ops

if TYPE_CHECKING:
    from engine.model.arch import ModelArchConfig
    from engine.model.decoder import TensorParallelShard
    from engine.parallel import TensorParallelGroup


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # per-head q / k norms: [tokens, heads, head_dim]
            return fused_ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return fused_ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual += x` in place, then the norm of the sum (one pass in the fused kernel)."""
        return fused_ops.add_rms_norm_(x, residual, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear that may carry a pre-blocked copy of its weight for CPU bf16 / float32 matmuls
    (`fused_ops.prepack_linear_weight`; set by `DecoderForCausalLM.prepack_linear_weights`)."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.linear(x, self.weight, self.bias, self.packed)


class RowParallelLinear(Linear):
    """A Linear whose input features are split across the tensor-parallel ranks: each computes a
    partial sum, all-reduced, then the bias (whole on every rank) is added once. With `tp` None it
    is a plain `Linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup | None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        out = self.tp.all_reduce(fused_ops.linear(x, self.weight, None, self.packed))
        return out if self.bias is None else out.add_(self.bias)


GATED_ACTS = {"silu": fused_ops.silu_and_mul, "gelu_pytorch_tanh": fused_ops.gelu_tanh_and_mul}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (gelu, tanh approximation), of this
    rank's `intermediate_size` columns (None: the dense MLP's, `shard.intermediate_size`)."""

    def __init__(self, arch: ModelArchConfig, shard: TensorParallelShard,
                 tp: TensorParallelGroup | None = None, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = shard.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * inter, bias=False)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, False, tp)
        self.act_and_mul = GATED_ACTS[arch.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class RowParallel(nn.Module):
    """A row-parallel projection over any linear layer without a bias (a quantized one): this
    rank's partial sums all-reduced, then the bias, whole on every rank, added once."""

    def __init__(self, inner: nn.Module, tp: TensorParallelGroup, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.inner, self.tp = inner, tp
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.inner(x))
        return out if self.bias is None else out.add_(self.bias.to(out.dtype))


def replace_linear(owner: nn.Module, attribute: str, make: Callable[[torch.Tensor | None], nn.Module]) -> None:
    """Put `make(bias)` in place of `owner.<attribute>` (a `Linear`): `make` builds the replacement
    (a quantized linear) with the float32 bias it is given. A row-parallel layer on several ranks
    keeps its all-reduce: `make(None)` inside a `RowParallel` that adds the bias after it."""
    current = getattr(owner, attribute)
    bias = None if current.bias is None else current.bias.detach().to(torch.float32)
    tp = current.tp if isinstance(current, RowParallelLinear) else None
    setattr(owner, attribute, make(bias) if tp is None else RowParallel(make(None), tp, bias))

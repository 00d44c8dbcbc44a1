"""What one layer's attention computes beyond causal `softmax(q k^T * scale) v`.

A model builds one `AttentionVariant` per attention layer and passes it to every backend call
(`AttentionBackend.forward(..., variant=)`); None or `AttentionVariant()` is plain causal
attention. Every backend implements each field exactly as the torch reference does
(`engine/attention/torch_backend.py`), in this order, per query row:

1. `scores = q . k * scale` over the keys the row may see;
2. `softcap`: `scores = softcap * tanh(scores / softcap)` (Gemma 2's attention logit soft-capping);
3. `sliding_window`: a query at position `p` sees the keys at positions `p - window < j <= p`
   (the last `window` positions, itself included: transformers' `kv_idx > q_idx - window`);
4. `sinks`: one learned logit per query head that joins the softmax's denominator and nothing
   else (gpt-oss): `p_j = exp(s_j) / (exp(sink_h) + sum_j exp(s_j))`;
5. the output is `sum_j p_j v_j`; the softmax runs in float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class AttentionVariant:
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: "torch.Tensor | None" = None  # [num_heads of this rank] in any float dtype

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap!r}")

    @property
    def plain(self) -> bool:
        """Nothing beyond causal attention: every backend's fastest path applies."""
        return self.sliding_window is None and self.softcap is None and self.sinks is None

    def window_start(self, position: int) -> int:
        """The first key position a query at `position` sees."""
        return 0 if self.sliding_window is None else max(0, position - self.sliding_window + 1)


PLAIN = AttentionVariant()


def is_plain(variant: AttentionVariant | None) -> bool:
    return variant is None or variant.plain

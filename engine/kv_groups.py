"""Which blocks of the KV cache a layer uses: one group of layers per kind, one block table each.

A model whose layers all attend to the whole context has one group: a block holds every layer's
K/V of its `block_size` tokens and a request has one block table (engine/kv_cache.py's layout).

A model with sliding-window layers (Gemma 2/3, gpt-oss, Mistral with a window) has its layers
split into groups of the same size S, each of layers of one window (vLLM's hybrid allocator does
the same). The cache is then `[S, num_blocks, ...]`: a block, given to one group, holds that
group's S layers for its tokens (layer i uses slot `layer_slot[i]` of the blocks in its group's
table), and a request has one block table per group, all from one pool. A sliding group reads,
for the token at position p, only positions > p - window: the blocks behind that go back to the
pool (engine/block_groups.py) and their entries in the table become the null block, block 0,
which nobody holds and nothing writes (a kernel may read it, as zeros, and masks it out).

Gemma 3 270M: 15 sliding layers (window 512) and 3 full ones make six groups of three layers.
At 8k tokens of context a request holds 512 blocks of the full group and at most 33 of each
sliding one (blocks of 16 tokens): 677 blocks of 3 layers, 0.22x of 512 blocks of 18 layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

NULL_BLOCK = 0  # a grouped cache's placeholder for a sliding group's blocks behind its window

# `CacheConfig.kv_layout`: "grouped" frees sliding layers' blocks behind their window (refused
# where a feature does not support it yet), "uniform" keeps every layer's blocks, "auto" groups
# whenever a layer slides and nothing in the configuration needs the uniform layout.
KV_LAYOUTS = ("auto", "grouped", "uniform")


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: its layers' sliding window in tokens, 0 = full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its index within the group (the cache's first dim)

    @classmethod
    def uniform(cls, num_layers: int) -> KVGroups:
        """One group of every layer, each in its own slot: a block holds the whole model's K/V."""
        return cls((0,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def from_windows(cls, windows: Sequence[int]) -> KVGroups:
        """Groups for layers of these windows (0 = full): each window's layers, in order, cut into
        runs of S = the gcd of the windows' layer counts."""
        kinds = list(dict.fromkeys(windows))
        counts = [sum(1 for w in windows if w == kind) for kind in kinds]
        size = math.gcd(*counts)
        group_windows: list[int] = []
        layer_group = [0] * len(windows)
        layer_slot = [0] * len(windows)
        for kind in kinds:
            layers = [i for i, w in enumerate(windows) if w == kind]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    layer_group[layer], layer_slot[layer] = len(group_windows), slot
                group_windows.append(kind)
        return cls(tuple(group_windows), tuple(layer_group), tuple(layer_slot))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """Layers per block (the cache's first dimension)."""
        return max(self.layer_slot, default=0) + 1

    @property
    def grouped(self) -> bool:
        """Whether some group slides (blocks behind a window are given back; block 0 is the null block)."""
        return any(self.windows)

    def first_read_block(self, group: int, position: int, block_size: int) -> int:
        """The first block of `group`'s table that the token at `position` reads (or any later one)."""
        window = self.windows[group]
        return max(0, position - window + 1) // block_size if window else 0

    def describe(self) -> str:
        return ", ".join(f"{self.windows.count(w)} group(s) of {self.num_slots} layers "
                         + (f"with a {w}-token window" if w else "with full attention")
                         for w in dict.fromkeys(self.windows))


def kv_groups_for(layer_windows: Sequence[int], num_layers: int, layout: str,
                  blockers: Sequence[str]) -> KVGroups:
    """The groups an engine uses. `layer_windows`: each layer's window (0 = full; () none slides);
    `blockers`: the options of the configuration that need the uniform layout, as a user names
    them. `layout="grouped"` with a blocker is refused naming it; "auto" then keeps every block."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {layout!r}")
    if layout == "uniform" or not any(layer_windows):
        return KVGroups.uniform(num_layers)
    if blockers:
        if layout == "grouped":
            raise ValueError(f"kv_layout='grouped' (freeing sliding-window layers' blocks) does not work with "
                             f"{', '.join(blockers)} yet; use kv_layout 'auto' or 'uniform' (every layer's blocks kept)")
        return KVGroups.uniform(num_layers)
    return KVGroups.from_windows(layer_windows)

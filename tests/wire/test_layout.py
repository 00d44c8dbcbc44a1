"""The KV layout in the schema: a kvtransfer layout's fields, sliding windows included, arrive as
sent and decide whether a prefill worker can serve a decode worker."""
from __future__ import annotations

import torch

from kvtransfer import KVLayout
from wire.convert import describe_wire_layout, layout_to_wire, same_layout
from wire.schema import messages

GEMMA_WINDOWS = ([512] * 5 + [0]) * 3


def layout(layer_windows=()) -> KVLayout:
    return KVLayout(18, 64, 16, 1, 256, torch.bfloat16, layer_windows=layer_windows)


def test_windows_travel_and_are_described():
    wired = layout_to_wire(layout(GEMMA_WINDOWS))
    back = messages().KVLayout.FromString(wired.SerializeToString())
    assert list(back.layer_windows) == GEMMA_WINDOWS
    assert describe_wire_layout(back) == ("layers=18 block_size=16 kv_heads=1 head_dim=256 dtype=bfloat16 "
                                          "windows=[512x5, full, 512x5, full, 512x5, full]")
    full = layout_to_wire(layout())
    assert list(full.layer_windows) == []
    assert "windows" not in describe_wire_layout(full)


def test_same_layout_compares_windows():
    windowed = layout_to_wire(layout(GEMMA_WINDOWS))
    assert same_layout(windowed, layout_to_wire(layout(GEMMA_WINDOWS)))
    assert not same_layout(windowed, layout_to_wire(layout()))
    assert not same_layout(windowed, layout_to_wire(layout([256] * 5 + [0] + GEMMA_WINDOWS[6:])))
    all_full = messages().KVLayout(num_layers=18, block_size=16, num_kv_heads=1, head_dim=256, dtype="bfloat16",
                                   layer_windows=[0] * 18)
    assert same_layout(all_full, layout_to_wire(layout()))  # all zeros: every layer full, as none

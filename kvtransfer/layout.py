"""The KV cache layout both sides of a transfer must agree on.

One tensor per layer, shaped `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (index 0 = K,
1 = V). A (layer, block) pair is one contiguous chunk of `chunk_nbytes` bytes: the unit that
kvtransfer moves.

An 8-bit cache (`kv_format` "int8" or "fp8_e4m3"; its owner is the engine's engine/kv_quant.py)
is one `[num_blocks, chunk_nbytes]` uint8 tensor per layer: each chunk holds the block's 8-bit
K and V, a float32 scale per K/V and head, then a bf16 K reference row per head. Its chunks move
as they are; both sides must use the same format.

`layer_windows`: per layer, its sliding attention window in tokens (0 = full attention), or `()`
when every layer attends to the whole sequence. A windowed layer never reads a prompt's early
blocks again, so a transfer may skip them for that layer (`skip_blocks`, kvtransfer/sender.py);
both sides must describe the same windows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from .status import LayoutMismatchError, dtype_description, windows_description

_DTYPES_BY_NAME = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                  torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8)
}


class PackedBlocks(Protocol):
    """An 8-bit block format (engine/kv_quant.py `KVQuantFormat`): what the layout needs of it."""

    name: str
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_bytes(self) -> int: ...


# What an 8-bit chunk holds besides its values, per KV head: two float32 scales (K, V) and a bf16
# K reference row (engine/kv_quant.py; `from_caches` checks the sum against the format's).
SCALE_BYTES = 4
REF_BYTES = 2


@dataclass(frozen=True)
class KVLayout:
    """Shape, dtype and device of one side's paged KV cache. `kv_format`: "" (values in `dtype`)
    or the 8-bit format whose chunks carry their scales (`dtype` is then uint8). `layer_windows`:
    one sliding window (tokens, 0 = full attention) per layer; all zeros is stored as `()`."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str = "cpu"
    kv_format: str = ""
    layer_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "device", str(torch.device(self.device)))
        windows = tuple(self.layer_windows)
        if windows and len(windows) != self.num_layers:
            raise ValueError(f"KVLayout.layer_windows has {len(windows)} entries for {self.num_layers} layers")
        bad = [w for w in windows if not isinstance(w, int) or isinstance(w, bool) or w < 0]
        if bad:
            raise ValueError(f"KVLayout.layer_windows must be non-negative ints (0 = full attention), got {bad[:4]}")
        object.__setattr__(self, "layer_windows", windows if any(windows) else ())

    @classmethod
    def from_caches(cls, layer_caches: Sequence[torch.Tensor], packed: PackedBlocks | None = None,
                    layer_windows: Sequence[int] = ()) -> "KVLayout":
        """Describe a list of per-layer caches, checking they share one valid layout. `packed`:
        the caches are 8-bit blocks in that format (`[num_blocks, block_bytes]` uint8 each);
        `layer_windows`: each layer's sliding window in tokens (0 = full; `()`: every layer full)."""
        if len(layer_caches) == 0:
            raise ValueError("layer_caches is empty: need one tensor per layer")
        first = layer_caches[0]
        for index, cache in enumerate(layer_caches):
            if not isinstance(cache, torch.Tensor):
                raise TypeError(f"layer_caches[{index}] is a {type(cache).__name__}, not a tensor")
            if packed is not None:
                if cache.dim() != 2 or cache.shape[1] != packed.block_bytes or cache.dtype != torch.uint8:
                    raise ValueError(f"layer_caches[{index}] is {tuple(cache.shape)} {cache.dtype}; an {packed.name} "
                                     f"cache is [num_blocks, {packed.block_bytes}] uint8")
            elif cache.dim() != 5 or cache.shape[1] != 2:
                raise ValueError(
                    f"layer_caches[{index}] has shape {tuple(cache.shape)}; expected "
                    "[num_blocks, 2, block_size, num_kv_heads, head_dim]")
            if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
                raise ValueError(
                    f"layer_caches[{index}] is {tuple(cache.shape)} {cache.dtype} on {cache.device}, "
                    f"layer 0 is {tuple(first.shape)} {first.dtype} on {first.device}: "
                    "all layers must match")
            if not cache.is_contiguous():
                raise ValueError(f"layer_caches[{index}] is not contiguous")
        if packed is not None:
            layout = cls(num_layers=len(layer_caches), num_blocks=int(first.shape[0]), block_size=packed.block_size,
                         num_kv_heads=packed.num_kv_heads, head_dim=packed.head_dim, dtype=torch.uint8,
                         device=str(first.device), kv_format=packed.name, layer_windows=tuple(layer_windows))
            if layout.chunk_nbytes != packed.block_bytes:
                raise ValueError(f"an {packed.name} block is {packed.block_bytes} bytes, kvtransfer's layout counts "
                                 f"{layout.chunk_nbytes}: the two disagree on the 8-bit format")
            return layout
        num_blocks, _, block_size, num_kv_heads, head_dim = first.shape
        return cls(num_layers=len(layer_caches), num_blocks=num_blocks, block_size=block_size,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=first.dtype,
                   device=str(first.device), layer_windows=tuple(layer_windows))

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one (layer, block) pair: K and V of `block_size` tokens (8-bit: and their scales
        and K references)."""
        values = 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize
        if not self.kv_format:
            return values
        return values + self.num_kv_heads * (2 * SCALE_BYTES + self.head_dim * REF_BYTES)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """One chunk as a tensor of `dtype` (an 8-bit one: its bytes)."""
        if self.kv_format:
            return (self.chunk_nbytes,)
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def is_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens; 0 = full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def describe(self) -> str:
        windows = f" windows=[{windows_description(self.layer_windows)}]" if self.layer_windows else ""
        return (f"layers={self.num_layers} blocks={self.num_blocks} block_size={self.block_size} "
                f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
                f"dtype={dtype_description(self.kv_format, str(self.dtype).removeprefix('torch.'))} "
                f"device={self.device}{windows}")

    def to_wire(self) -> dict:
        return {"num_layers": self.num_layers, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": str(self.dtype).removeprefix("torch."),
                "device": self.device, "kv_format": self.kv_format,
                "layer_windows": list(self.layer_windows)}

    @classmethod
    def from_wire(cls, fields: dict) -> "KVLayout":
        dtype_name = fields["dtype"]
        if dtype_name not in _DTYPES_BY_NAME:
            raise ValueError(f"unsupported KV cache dtype {dtype_name!r}")
        return cls(num_layers=int(fields["num_layers"]), num_blocks=int(fields["num_blocks"]),
                   block_size=int(fields["block_size"]), num_kv_heads=int(fields["num_kv_heads"]),
                   head_dim=int(fields["head_dim"]), dtype=_DTYPES_BY_NAME[dtype_name],
                   device=fields["device"], kv_format=str(fields.get("kv_format", "")),
                   layer_windows=tuple(int(w) for w in fields.get("layer_windows", ())))

    def transfer_compatible(self, other: "KVLayout") -> bool:
        """Whether blocks can move between the two caches: everything but the pool size and
        the device must agree (a CPU sender may feed a GPU receiver over tcp), sliding windows
        included."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.kv_format,
                self.layer_windows) == (other.num_layers, other.block_size, other.num_kv_heads, other.head_dim,
                                        other.dtype, other.kv_format, other.layer_windows)


def check_layouts(sender: KVLayout, receiver: KVLayout) -> None:
    """Raise LayoutMismatchError, naming both layouts, if blocks cannot move between them."""
    if not sender.transfer_compatible(receiver):
        raise LayoutMismatchError(layout_mismatch_message(sender, receiver))


def layout_mismatch_message(sender: KVLayout, receiver: KVLayout) -> str:
    return (f"KV layout mismatch: sender has [{sender.describe()}], "
            f"receiver has [{receiver.describe()}]")

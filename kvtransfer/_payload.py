"""What one data message carries, and the views that read or write it in the caches.

A data message covers `layers x block_ids[block_start:block_end]` of one transfer; on the wire
its payload is, for each layer in order, each block's chunk in order. Transports either move
chunks straight from/into cache memory (`chunk_views`) or through a contiguous staging tensor
(`gather` / `scatter`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ._chunk_copy import copy_chunks
from ._chunk_copy import native as chunk_copy_ready
from .layout import KVLayout


@dataclass(frozen=True)
class DataPiece:
    layers: tuple[int, ...]
    block_start: int
    block_end: int

    @property
    def num_blocks(self) -> int:
        return self.block_end - self.block_start

    def nbytes(self, layout: KVLayout) -> int:
        return len(self.layers) * self.num_blocks * layout.chunk_nbytes


def plan_pieces(layers: Sequence[int], num_blocks: int, layout: KVLayout,
                max_bytes: int, block_start: int = 0) -> list[DataPiece]:
    """Split `layers x blocks[block_start:num_blocks]` chunks into messages of at most
    `max_bytes` each."""
    chunk = layout.chunk_nbytes
    if chunk > max_bytes:
        raise ValueError(f"one KV chunk is {chunk} bytes, above the message limit of {max_bytes}")
    layer_bytes = (num_blocks - block_start) * chunk
    pieces = []
    if layer_bytes <= 0:
        return pieces
    if layer_bytes <= max_bytes:
        per_message = max_bytes // layer_bytes
        for start in range(0, len(layers), per_message):
            pieces.append(DataPiece(tuple(layers[start:start + per_message]), block_start, num_blocks))
    else:
        blocks_per_message = max_bytes // chunk
        for layer in layers:
            for start in range(block_start, num_blocks, blocks_per_message):
                pieces.append(DataPiece((layer,), start, min(num_blocks, start + blocks_per_message)))
    return pieces


def staging_view(buffer: torch.Tensor, layout: KVLayout, piece: DataPiece) -> torch.Tensor:
    """View the head of a flat uint8 buffer as `[layers, blocks, 2, block_size, heads, dim]`."""
    nbytes = piece.nbytes(layout)
    if buffer.numel() < nbytes:
        raise ValueError(f"staging buffer of {buffer.numel()} bytes is smaller than {nbytes}")
    return buffer[:nbytes].view(layout.dtype).view(
        len(piece.layers), piece.num_blocks, *layout.chunk_shape)


def chunk_addresses(layer_addresses: Sequence[int] | np.ndarray, layers: Sequence[int],
                    block_ids: Sequence[int] | np.ndarray, chunk_nbytes: int) -> np.ndarray:
    """Start address of each (layer, block) chunk, layer-major (the order of a payload), for
    per-layer caches starting at `layer_addresses` (in this process or, for shm, in a peer's)."""
    bases = np.asarray(layer_addresses, dtype=np.uint64)[list(layers)]
    offsets = np.asarray(block_ids, dtype=np.uint64) * np.uint64(chunk_nbytes)
    return (bases[:, None] + offsets[None, :]).reshape(-1)


class CacheViews:
    """The per-layer caches, with byte views for zero-copy socket I/O on CPU."""

    def __init__(self, layer_caches: Sequence[torch.Tensor], layout: KVLayout) -> None:
        self.caches = list(layer_caches)
        self.layout = layout
        self._layer_bytes: list[memoryview] | None = None
        self._layer_addresses: np.ndarray | None = None
        if not layout.is_cuda:
            # [num_blocks, chunk_nbytes] uint8 arrays, one per layer (each cache is contiguous)
            rows = [cache.view(torch.uint8).reshape(layout.num_blocks, -1).numpy() for cache in self.caches]
            self._layer_bytes = [memoryview(layer_rows.reshape(-1)) for layer_rows in rows]
            self._layer_addresses = np.array([cache.data_ptr() for cache in self.caches], dtype=np.uint64)
            chunk_copy_ready()  # build or load the copier now, not inside the first transfer

    @property
    def supports_chunk_views(self) -> bool:
        return self._layer_bytes is not None

    def cache_addresses(self) -> tuple[int, ...]:
        """Where each layer's cache starts in this process (host memory only)."""
        if self.layout.is_cuda:
            return ()
        return tuple(cache.data_ptr() for cache in self.caches)

    def chunk_views(self, layers: Sequence[int], block_ids: Sequence[int]) -> list[memoryview]:
        assert self._layer_bytes is not None, "chunk views need caches in host memory"
        size = self.layout.chunk_nbytes
        views = []
        for layer in layers:
            layer_bytes = self._layer_bytes[layer]
            views.extend(layer_bytes[block * size:(block + 1) * size] for block in block_ids)
        return views

    def chunk_addresses(self, layers: Sequence[int], block_ids: np.ndarray) -> np.ndarray:
        """Where each (layer, block) chunk starts in this process, layer-major."""
        assert self._layer_addresses is not None, "chunk addresses need caches in host memory"
        return chunk_addresses(self._layer_addresses, layers, block_ids, self.layout.chunk_nbytes)

    def gather(self, layers: Sequence[int], index: torch.Tensor, out: torch.Tensor) -> None:
        """`out` is `[len(layers), len(index), *chunk_shape]`, contiguous, on the caches' device."""
        if self._layer_addresses is not None:
            copy_chunks(self._payload_addresses(out),
                        self.chunk_addresses(layers, index.numpy()), self.layout.chunk_nbytes)
            return
        for position, layer in enumerate(layers):
            torch.index_select(self.caches[layer], 0, index, out=out[position])

    def scatter(self, layers: Sequence[int], index: torch.Tensor, src: torch.Tensor) -> None:
        """`src` is `[len(layers), len(index), *chunk_shape]`, contiguous, on the caches' device."""
        if self._layer_addresses is not None:
            copy_chunks(self.chunk_addresses(layers, index.numpy()),
                        self._payload_addresses(src), self.layout.chunk_nbytes)
            return
        for position, layer in enumerate(layers):
            self.caches[layer].index_copy_(0, index, src[position])

    def _payload_addresses(self, payload: torch.Tensor) -> np.ndarray:
        """The chunks of a contiguous staging payload, in order."""
        assert payload.is_contiguous()
        chunk = self.layout.chunk_nbytes
        count = payload.numel() * payload.element_size() // chunk
        return np.arange(count, dtype=np.uint64) * np.uint64(chunk) + np.uint64(payload.data_ptr())

    def release(self) -> None:
        self._layer_bytes = None
        self._layer_addresses = None
        self.caches = []


class _MessageBlocks:
    """The blocks of one data message on one side: `piece`'s slice of the transfer's block ids
    (and of their index tensor), its byte count, and whether the transfer is still live."""

    def __init__(self, views: CacheViews, piece: DataPiece, block_ids: Sequence[int],
                 index: torch.Tensor, is_active: Callable[[], bool]) -> None:
        self.views = views
        self.piece = piece
        self.block_ids = block_ids[piece.block_start:piece.block_end]
        self.index = index[piece.block_start:piece.block_end]
        self.nbytes = piece.nbytes(views.layout)
        self.is_active = is_active

    @property
    def supports_chunk_views(self) -> bool:
        return self.views.supports_chunk_views

    def chunk_views(self) -> list[memoryview]:
        return self.views.chunk_views(self.piece.layers, self.block_ids)


class BlockSource(_MessageBlocks):
    """The source side of one data message (sender)."""

    def gather_into(self, buffer: torch.Tensor) -> torch.Tensor:
        out = staging_view(buffer, self.views.layout, self.piece)
        self.views.gather(self.piece.layers, self.index.to(buffer.device), out)
        return buffer[:self.nbytes]


class BlockSink(_MessageBlocks):
    """The destination side of one data message (receiver); `is_active()` turns False the
    moment the transfer is cancelled or fails, after which nothing may be written."""

    def scatter_from(self, buffer: torch.Tensor) -> bool:
        """Copy a received staging buffer into the blocks, if still active."""
        if not self.is_active():
            return False
        src = staging_view(buffer, self.views.layout, self.piece)
        device = self.index.device
        self.views.scatter(self.piece.layers, self.index, src.to(device, non_blocking=True))
        return True


class DiscardSink:
    """Where the bytes of a message nobody expects go: nowhere."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.supports_chunk_views = False

    @staticmethod
    def is_active() -> bool:
        return False

    def scatter_from(self, buffer: torch.Tensor) -> bool:
        return False

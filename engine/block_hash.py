"""Content hashes of full KV-cache blocks, identical in every process and on every host.

The router and every worker compute the same hashes for the same tokens, so this module depends
on the standard library only (xxhash is imported lazily, when asked for).

A block's hash chains its parent's (the previous block of the same sequence), so equal hashes
mean equal whole prefixes:

    hash(block i) = H( 0x00 | 0x01 + hash(block i-1),  len(extra_key) as u32 + extra_key utf-8,
                       token ids as little-endian u32 )

`extra_key` (e.g. a cache salt) separates caches that must never share blocks. A `CacheSalt`
gives a sequence's blocks their keys: its own salt, except the blocks wholly inside a prefix
hashed under a shared salt (tenants that opt in share a common system prompt's blocks, their own
turns chain on under their own salts). Never Python's `hash()`: it is salted per process.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

BlockHash = bytes

HASH_ALGORITHMS = ("sha256", "xxh3_128")
DEFAULT_HASH_ALGORITHM = "sha256"


@dataclass(frozen=True)
class CacheSalt:
    """The extra keys of a sequence's blocks: `own` (a request's cache_salt; None: none), except
    for the blocks that lie wholly within its first `shared_tokens` tokens, keyed by `shared`."""
    own: str | None = None
    shared: str | None = None
    shared_tokens: int = 0

    def __post_init__(self) -> None:
        if self.shared_tokens < 0 or (self.shared_tokens and self.shared is None):
            raise ValueError(f"shared_tokens ({self.shared_tokens}) needs a shared salt and must be >= 0")

    def of_block(self, index: int, block_size: int) -> str | None:
        """The extra key of block `index` (of `block_size` tokens; a trailing partial block too)."""
        return self.shared if (index + 1) * block_size <= self.shared_tokens else self.own


def block_key(salt: "str | CacheSalt | None", index: int, block_size: int) -> str | None:
    """Block `index`'s extra key under `salt` (a plain string keys every block)."""
    return salt.of_block(index, block_size) if isinstance(salt, CacheSalt) else salt


def _new_hasher(algorithm: str):
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash
        return xxhash.xxh3_128()
    raise ValueError(f"unknown block hash algorithm {algorithm!r}; choose one of {', '.join(HASH_ALGORITHMS)}")


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: str | None = None,
               algorithm: str = DEFAULT_HASH_ALGORITHM) -> BlockHash:
    """Hash of one block of `token_ids` whose previous block hashed to `parent` (None: first block)."""
    hasher = _new_hasher(algorithm)
    if parent is None:
        hasher.update(b"\x00")
    else:
        hasher.update(b"\x01")
        hasher.update(parent)
    salt = b"" if extra_key is None else extra_key.encode("utf-8")
    hasher.update(struct.pack("<I", len(salt)))
    hasher.update(salt)
    try:
        hasher.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    return hasher.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, extra_key: str | CacheSalt | None = None,
                     algorithm: str = DEFAULT_HASH_ALGORITHM, parent: BlockHash | None = None,
                     start_block: int = 0) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids`, from block `start_block` on.

    `parent` is the hash of block `start_block - 1` (None when starting at block 0); a trailing
    partial block gets no hash.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    for block in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[block * block_size:(block + 1) * block_size],
                            block_key(extra_key, block, block_size), algorithm)
        hashes.append(parent)
    return hashes

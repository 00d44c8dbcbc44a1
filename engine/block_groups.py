"""The block manager of a grouped KV cache (engine/kv_groups.py): one block table per group.

A request holds `request.block_tables[g]` for each group g, all from one pool, with the
invariants of `BlockManager` over the blocks of every table. Block 0 is the null block: nobody
holds it, it is never free, and a sliding group's table has it in the place of each block behind
its window. Such blocks go back to the pool as soon as the computed tokens leave them behind
(`cache_computed_blocks`, after registering them: a cached one stays findable until reused), and
a new one is never allocated for positions the next computed token does not read.

Prefix caching: each group caches its blocks under (group, hash). A hit of h blocks needs, from a
full-attention group, every block before h, and from a sliding group the blocks the token at
position h * block_size reads; the longest h that every group has is taken (with null blocks for
what the sliding groups no longer hold).

KV events report one group's blocks, a full-attention one if there is one (its cached run bounds
every hit): the router's prefix-aware routing estimates a worker's hit from them.

An import (decode role) allocates from the end of the prompt on (`start`): a sliding group holds
only the blocks its window reads there, and each group's blocks arrive in a transfer of their own
(`destination_groups`, engine/kv_connector.py); every block received then holds all of its
group's layers, so it may join the prefix cache. A fallback to a local prefill allocates the
blocks it did not hold when it computes them (`_missing`).

Not supported yet (engine/kv_groups.py's `kv_groups_for` keeps such configurations uniform): the
host tier, swap preemption, the prefill role (its sends read one block table for every layer).
"""
from __future__ import annotations

from engine.block_hash import DEFAULT_HASH_ALGORITHM
from engine.block_manager import BlockManager
from engine.kv_events import BlockStored
from engine.kv_groups import NULL_BLOCK, KVGroups
from engine.kv_hooks import KVDestinationGroup
from engine.request import Request

PrefixEntry = tuple[int, ...]  # one block position of a prefix hit: each group's block (or NULL_BLOCK)


class GroupedBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, groups: KVGroups, enable_prefix_caching: bool = True,
                 hash_algorithm: str = DEFAULT_HASH_ALGORITHM, record_kv_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"a grouped KV cache needs num_blocks >= 2 (block 0 is its null block), got {num_blocks}")
        super().__init__(num_blocks, block_size, enable_prefix_caching, hash_algorithm,
                         record_kv_events=record_kv_events)
        self.groups = groups
        self._reported_group = next((g for g, window in enumerate(groups.windows) if not window), 0)
        self._released: dict[str, list[int]] = {}  # request id -> per group: entries below are null
        del self._free[NULL_BLOCK]

    # ---- queries ---------------------------------------------------------------------------

    @property
    def token_capacity(self) -> int:
        """The longest sequence whose blocks the cache holds even if no sliding group gives any back."""
        return (self.num_blocks - 1) // self.groups.num_groups * self.block_size

    def _tables(self, request: Request) -> list[list[int]]:
        if len(request.block_tables) != self.groups.num_groups:
            if any(request.block_tables):
                raise ValueError(f"request {request.request_id} holds {len(request.block_tables)} block tables, "
                                 f"the cache has {self.groups.num_groups} groups")
            request.block_tables = [[] for _ in self.groups.windows]
        return request.block_tables

    def _first_read(self, group: int, position: int) -> int:
        return self.groups.first_read_block(group, position, self.block_size)

    def _first_needed(self, group: int, start: int, target: int) -> int:
        """The first of `target` blocks that computing from position `start` on reads (at most the
        last one: an import, computing from its end, still holds the last block it fills)."""
        return min(self._first_read(group, start), max(0, target - 1))

    def _missing(self, table: list[int], group: int, start: int, target: int) -> list[int]:
        """Indices below `target` that computing from `start` reads and `table` has no block for
        (past its end, or null: e.g. a failed import's blocks, prefilled here after all)."""
        return [index for index in range(self._first_needed(group, start, target), target)
                if index >= len(table) or table[index] == NULL_BLOCK]

    def new_blocks_for(self, request: Request, num_tokens: int, start: int | None = None) -> int:
        """Free blocks `allocate_slots(request, num_tokens, start=start)` would take."""
        start = request.num_computed_tokens if start is None else start
        target = self.blocks_needed(num_tokens)
        return sum(len(self._missing(table, g, start, target)) for g, table in enumerate(self._tables(request)))

    # ---- prefix cache ----------------------------------------------------------------------

    def _lookup(self, group: int, request: Request, index: int) -> int | None:
        block_id = self._cached.get((group, request.block_hashes[index]))
        if block_id is None or self._block_content[block_id] != self._content(request, index):
            return None
        return block_id

    def find_cached_prefix(self, request: Request) -> tuple[list[PrefixEntry], int]:
        """The longest hit every group has: (one entry per block position, tokens covered)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_hashes(request, max_blocks)
        found: list[list[int | None]] = []
        limit = max_blocks
        for group, window in enumerate(self.groups.windows):
            blocks = [self._lookup(group, request, index) for index in range(limit)]
            if not window:  # full attention: only a run from the first block counts
                limit = next((i for i, b in enumerate(blocks) if b is None), limit)
            found.append(blocks)
        for hit in range(limit, 0, -1):
            if all(found[g][i] is not None for g, window in enumerate(self.groups.windows) if window
                   for i in range(self._first_read(g, hit * self.block_size), hit)):
                break
        else:
            hit = 0
        entries = [tuple(found[g][i] if i >= self._first_read(g, hit * self.block_size) else NULL_BLOCK
                         for g in range(self.groups.num_groups)) for i in range(hit)]
        return entries, hit * self.block_size

    def find_host_prefix(self, request: Request, num_device_blocks: int) -> int:
        return 0

    def cache_computed_blocks(self, request: Request) -> None:
        """Register each group's full computed blocks, then give back the sliding groups' blocks
        behind the window of the next token."""
        tables = self._tables(request)
        super().cache_computed_blocks(request)  # registers through `_register`, every group
        # Entries below each group's mark are null already: a step scans only what it releases
        # (the computed tokens never go back while the request holds blocks).
        released = self._released.setdefault(request.request_id, [0] * len(tables))
        for group, table in enumerate(tables):
            end = min(len(table), self._first_read(group, request.num_computed_tokens))
            for index in range(released[group], end):
                if table[index] != NULL_BLOCK:
                    self._unref(table[index])
                    table[index] = NULL_BLOCK
            released[group] = max(released[group], end)

    def _register(self, request: Request, index: int) -> None:
        block_hash = request.block_hashes[index]
        for group, table in enumerate(self._tables(request)):
            block_id, key = table[index], (group, block_hash)
            if block_id != NULL_BLOCK and self._block_hash[block_id] is None and key not in self._cached:
                self._cached[key] = block_id
                self._block_hash[block_id] = key
                self._block_content[block_id] = content = self._content(request, index)
                if self._kv_events is not None and group == self._reported_group:
                    self._kv_events.append(BlockStored.of_block(block_hash, content, "device"))

    def _event_hash(self, key: tuple[int, bytes]) -> bytes | None:
        return key[1] if key[0] == self._reported_group else None

    # ---- allocation ------------------------------------------------------------------------

    def can_allocate(self, request: Request, num_tokens: int, prefix_blocks: list[PrefixEntry] = (),
                     start: int | None = None) -> bool:
        start = self._start(request, prefix_blocks, start)
        target = self.blocks_needed(num_tokens)
        tables = self._tables(request)
        if prefix_blocks:  # the tables are empty: they will start with the entries
            tables = [[entry[g] for entry in prefix_blocks] for g in range(self.groups.num_groups)]
        needed = sum(len(self._missing(table, g, start, target)) for g, table in enumerate(tables))
        reclaimed = len({b for entry in prefix_blocks for b in entry if b != NULL_BLOCK and self._ref_counts[b] == 0})
        return needed + reclaimed <= len(self._free)

    def _start(self, request: Request, prefix_blocks: list[PrefixEntry], start: int | None) -> int:
        if start is not None:
            return start
        return len(prefix_blocks) * self.block_size if prefix_blocks else request.num_computed_tokens

    def allocate_slots(self, request: Request, num_tokens: int, prefix_blocks: list[PrefixEntry] = (),
                       host_hits: int = 0, start: int | None = None) -> bool:
        """Make every table cover positions < num_tokens, all or nothing: the prefix entries
        first (admission only), then blocks where computing from `start` reads (default: the
        hit's end, or the computed tokens; an import, whose KV arrives, passes its length), null
        blocks before that."""
        tables = self._tables(request)
        if host_hits:
            raise ValueError("a grouped KV cache has no host tier")
        if prefix_blocks and any(tables):
            raise ValueError(f"request {request.request_id} already holds blocks; prefix blocks are for admission")
        if not self.can_allocate(request, num_tokens, prefix_blocks, start):
            return False
        start = self._start(request, prefix_blocks, start)
        for entry in prefix_blocks:
            for table, block_id in zip(tables, entry):
                if block_id != NULL_BLOCK:
                    if self._ref_counts[block_id] == 0:
                        del self._free[block_id]
                    self._ref_counts[block_id] += 1
                table.append(block_id)
        if prefix_blocks:
            self._num_registered[request.request_id] = len(prefix_blocks)
        target = self.blocks_needed(num_tokens)
        for group, table in enumerate(tables):
            missing = self._missing(table, group, start, target)
            table.extend([NULL_BLOCK] * (target - len(table)))
            for index in missing:
                block_id, _ = self._free.popitem(last=False)
                self._evict(block_id)
                self._ref_counts[block_id] = 1
                table[index] = block_id
        if any(tables):
            self._holders[request.request_id] = request
        return True

    def free(self, request: Request) -> None:
        for table in self._tables(request):
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._unref(block_id)
            table.clear()
        self._holders.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._released.pop(request.request_id, None)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        keep = self.blocks_needed(num_tokens)
        for table in self._tables(request):
            for block_id in table[keep:]:
                if block_id != NULL_BLOCK:
                    self._unref(block_id)
            del table[keep:]

    def destination_groups(self, request: Request, first: int) -> list[KVDestinationGroup]:
        """Per group, its layers and the blocks an import writes: the request's from prompt block
        `first` (its prefix-cache hit's end) or past the group's last null entry, whichever is later."""
        layers = [tuple(i for i, g in enumerate(self.groups.layer_group) if g == group)
                  for group in range(self.groups.num_groups)]
        result = []
        for group, table in enumerate(self._tables(request)):
            start = max(first, max((i + 1 for i, block in enumerate(table) if block == NULL_BLOCK), default=0))
            result.append(KVDestinationGroup(layers[group], tuple(table[start:])))
        return result

    # ---- invariants ------------------------------------------------------------------------

    num_reserved = 1  # the null block

    def _held(self, request: Request) -> list[int]:
        return [b for table in request.block_tables for b in table if b != NULL_BLOCK]

    def check_integrity(self) -> None:
        if self._ref_counts[NULL_BLOCK] or NULL_BLOCK in self._free or self._block_hash[NULL_BLOCK] is not None:
            raise AssertionError("the null block is held, free or cached")
        for request_id, request in self._holders.items():
            if len(request.block_tables) != self.groups.num_groups:
                raise AssertionError(f"request {request_id} has {len(request.block_tables)} block tables, "
                                     f"the cache {self.groups.num_groups} groups")
        super().check_integrity()

"""KV-cache block manager: fixed-size blocks, reference counts, prefix caching.

Every block is either FREE (reference count 0, in the free list) or REFERENCED by one or more
requests (each holder lists it once in `request.block_ids`). The free list is an LRU with lazy
eviction: a freed block keeps its hash and stays findable by prefix lookups until it is handed
out again, which is when its hash is dropped. Freeing puts blocks without a hash at the front
(reused first, costing nothing) and hashed blocks at the back, a request's last block first, so
that long shared prefixes outlive their tails.

Prefix caching: once all tokens of a full block are computed, the block is registered under its
chained content hash (`engine.block_hash`). A lookup walks a request's full blocks from the
first one and stops at the first miss; a hash hit counts only if the stored (parent hash, extra
key, token ids) equal the request's, so a hash collision is a miss, never wrong KV. A lookup
never covers the request's last token, whose logits are needed, and is block-aligned. A request
registers no block from `request.max_cached_blocks` on (an import whose sliding-window layers
left those blocks' KV out).

Host tier (optional, `engine/host_cache.py`): evicting a cached block saves its KV to host memory
first, and a lookup that misses on the device goes on in the host tier; the blocks found there
are allocated like new ones and filled by a copy from host memory (`allocate_slots(...,
host_hits=...)`), then registered in the device cache at once. The copies are queued in the host
cache and taken by the scheduler (`take_host_copies`).

KV events (engine/kv_events.py, with `record_kv_events`): every block that joins or leaves the
device cache or the host tier is recorded, in order, for `take_kv_events`; `kv_snapshot` gives
the whole state as events.
"""
from __future__ import annotations

from collections import OrderedDict

from engine.block_hash import DEFAULT_HASH_ALGORITHM, BlockHash, block_key, hash_block
from engine.host_cache import HostCache
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from engine.request import Request

BlockContent = tuple  # (parent hash | None, extra key | None, token ids tuple)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algorithm: str = DEFAULT_HASH_ALGORITHM, num_host_slots: int = 0,
                 record_kv_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        hash_block(None, [0], None, hash_algorithm)  # validates the algorithm name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algorithm = hash_algorithm

        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._block_content: list[BlockContent | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._holders: dict[str, Request] = {}
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already in the cache
        self._kv_events: list[KVEvent] | None = [] if record_kv_events else None
        self.host_cache = (HostCache(num_host_slots, self._kv_events)
                           if num_host_slots > 0 and enable_prefix_caching else None)

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, including evictable cached ones."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (referenced or evictable)."""
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def token_capacity(self) -> int:
        """The longest sequence whose blocks the whole cache holds."""
        return self.num_blocks * self.block_size

    def new_blocks_for(self, request: Request, num_tokens: int, start: int | None = None) -> int:
        """How many free blocks `allocate_slots(request, num_tokens)` would take (`start`: as there)."""
        return max(0, self.blocks_needed(num_tokens) - len(request.block_ids))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def holder_ids(self) -> list[str]:
        """Ids of the requests that hold blocks."""
        return list(self._holders)

    def free_block_order(self) -> list[int]:
        """Free blocks in the order they would be handed out (for tests and debugging)."""
        return list(self._free)

    # ---- prefix cache ----------------------------------------------------------------------

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.all_token_ids[start:start + self.block_size])

    def _ensure_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else None
            index = len(hashes)
            hashes.append(hash_block(parent, self._block_tokens(request, index),
                                     block_key(request.cache_salt, index, self.block_size), self.hash_algorithm))

    def _content(self, request: Request, index: int) -> BlockContent:
        parent = request.block_hashes[index - 1] if index else None
        return (parent, block_key(request.cache_salt, index, self.block_size), self._block_tokens(request, index))

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Longest run of device-cached blocks matching the request's leading full blocks.

        Returns (block ids, number of tokens they cover). Touches nothing: pass the blocks to
        `allocate_slots(..., prefix_blocks=...)` to take them.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_hashes(request, max_blocks)
        blocks: list[int] = []
        for index in range(max_blocks):
            block_id = self._cached.get(request.block_hashes[index])
            if block_id is None or self._block_content[block_id] != self._content(request, index):
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def find_host_prefix(self, request: Request, num_device_blocks: int) -> int:
        """How many blocks after the first `num_device_blocks` (a device hit) the host tier holds,
        in one run. Touches nothing: pass the count to `allocate_slots(..., host_hits=...)`."""
        if self.host_cache is None:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        count = 0
        for index in range(num_device_blocks, max_blocks):
            if self.host_cache.lookup(request.block_hashes[index], self._content(request, index)) is None:
                break
            count += 1
        return count

    def take_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(offloads: (block, slot), reloads: (slot, block)) queued since the last call."""
        return self.host_cache.take_copies() if self.host_cache is not None else ([], [])

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose tokens are all computed (prompt or decoded)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if request.max_cached_blocks is not None:
            num_full = min(num_full, request.max_cached_blocks)
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        self._ensure_hashes(request, num_full)
        for index in range(start, num_full):
            self._register(request, index)
        self._num_registered[request.request_id] = num_full

    def _register(self, request: Request, index: int) -> None:
        """Put the request's block `index` (whose KV is, or is about to be, computed) in the cache,
        unless the same content is already cached in another block (this one then stays private)."""
        block_id, block_hash = request.block_ids[index], request.block_hashes[index]
        if self._block_hash[block_id] is None and block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self._block_hash[block_id] = block_hash
            self._block_content[block_id] = content = self._content(request, index)
            if self._kv_events is not None:
                self._kv_events.append(BlockStored.of_block(block_hash, content, "device"))

    # ---- allocation ------------------------------------------------------------------------

    def can_allocate(self, request: Request, num_tokens: int, prefix_blocks: list[int] = ()) -> bool:
        have = len(request.block_ids) + len(prefix_blocks)
        new_blocks = max(0, self.blocks_needed(num_tokens) - have)
        reclaimed = sum(1 for b in prefix_blocks if self._ref_counts[b] == 0)
        return new_blocks + reclaimed <= len(self._free)

    def allocate_slots(self, request: Request, num_tokens: int, prefix_blocks: list[int] = (),
                       host_hits: int = 0, start: int | None = None) -> bool:
        """Make `request.block_ids` cover token positions `< num_tokens`, all or nothing.

        `prefix_blocks` (from `find_cached_prefix`) are taken first, then `host_hits` new blocks
        (from `find_host_prefix`) are queued to be filled from the host tier and join the device
        cache; only for a request that holds no blocks yet. Returns False, changing nothing, if
        the free list is too short. `start`: the first position the next step computes (a grouped
        cache allocates only what it reads, engine/block_groups.py; every position here).
        """
        if (prefix_blocks or host_hits) and request.block_ids:
            raise ValueError(f"request {request.request_id} already holds blocks; prefix blocks are for admission")
        if host_hits and num_tokens < (len(prefix_blocks) + host_hits) * self.block_size:
            raise ValueError(f"{host_hits} host-cache blocks reach past the {num_tokens} tokens to allocate")
        if not self.can_allocate(request, num_tokens, prefix_blocks):
            return False
        # Pin the host hits first: the evictions below save blocks to the host tier, which must
        # not make room by dropping them.
        first_host = len(prefix_blocks)
        host_slots = [self.host_cache.pin(request.block_hashes[index])
                      for index in range(first_host, first_host + host_hits)]
        for block_id in prefix_blocks:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        request.block_ids.extend(prefix_blocks)
        if prefix_blocks:
            self._num_registered[request.request_id] = len(prefix_blocks)
        for _ in range(self.blocks_needed(num_tokens) - len(request.block_ids)):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        if request.block_ids:
            self._holders[request.request_id] = request
        if host_slots:
            self._reload_from_host(request, first_host, host_slots)
        return True

    def _reload_from_host(self, request: Request, first: int, slots: list[int]) -> None:
        """Blocks `first ..` of the request come back from these host slots: queue the copies and
        register the blocks in the device cache (their KV is there before any forward)."""
        for index, slot in enumerate(slots, start=first):
            self.host_cache.reload(slot, request.block_ids[index])
            self._register(request, index)
        self._num_registered[request.request_id] = first + len(slots)

    def _evict(self, block_id: int, keep_on_host: bool = True) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
                reported = self._event_hash(block_hash)
                if self._kv_events is not None and reported is not None:
                    self._kv_events.append(BlockRemoved((reported,), "device", "evicted" if keep_on_host else "cleared"))
                if keep_on_host and self.host_cache is not None:
                    self.host_cache.save(block_hash, self._block_content[block_id], block_id)
            self._block_hash[block_id] = None
            self._block_content[block_id] = None

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks nobody holds any more become free (cached ones
        stay findable until reused)."""
        for block_id in reversed(request.block_ids):
            self._unref(block_id)
        request.block_ids.clear()
        self._holders.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past those `num_tokens` tokens need (a rejected draft's
        slots). They hold no registered block: registration covers computed tokens only."""
        keep = self.blocks_needed(num_tokens)
        for block_id in request.block_ids[keep:]:
            self._unref(block_id)
        del request.block_ids[keep:]

    def _unref(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds joins the free list, at the front unless it
        is cached (then at the back, findable until reused)."""
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
            if self._block_hash[block_id] is None:
                self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (referenced ones stay), and the host tier.
        Returns how many device blocks."""
        dropped = 0
        if self.host_cache is not None:
            self.host_cache.clear()
        for block_id in list(self._free):
            if self._block_hash[block_id] is not None:
                self._evict(block_id, keep_on_host=False)
                self._free.move_to_end(block_id, last=False)
                dropped += 1
        return dropped

    # ---- KV events -------------------------------------------------------------------------

    def _event_hash(self, key) -> BlockHash | None:
        """The hash a KV event reports for a cache key (None: the key's block is not reported)."""
        return key

    def take_kv_events(self) -> list[KVEvent]:
        """The events recorded since the last call, in order ([] when not recording)."""
        if not self._kv_events:
            return []
        events = list(self._kv_events)
        self._kv_events.clear()  # in place: the host tier appends to the same list
        return events

    def kv_snapshot(self) -> list[KVEvent]:
        """The cache's whole state as events: AllBlocksCleared, then each cached block per tier."""
        events: list[KVEvent] = [AllBlocksCleared()]
        events += [BlockStored.of_block(self._event_hash(key), self._block_content[b], "device")
                   for key, b in self._cached.items() if self._event_hash(key) is not None]
        if self.host_cache is not None:
            events += [BlockStored.of_block(h, content, "host") for h, content in self.host_cache.entries()]
        return events

    # ---- invariants ------------------------------------------------------------------------

    num_reserved = 0  # leading blocks never handed out (a grouped cache's null block)

    def _held(self, request: Request) -> list[int]:
        """The blocks the request holds a reference to, each once per table that lists it."""
        return request.block_ids

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        counts = [0] * self.num_blocks
        for request_id, request in self._holders.items():
            held = self._held(request)
            if not held:
                raise AssertionError(f"request {request_id} is a holder without blocks")
            if len(set(held)) != len(held):
                raise AssertionError(f"request {request_id} lists a block twice: {request.block_tables}")
            for block_id in held:
                counts[block_id] += 1
        for block_id in range(self.num_reserved, self.num_blocks):
            ref, free = self._ref_counts[block_id], block_id in self._free
            if ref != counts[block_id]:
                raise AssertionError(f"block {block_id}: ref count {ref} but {counts[block_id]} holders")
            if free == (ref > 0):
                raise AssertionError(f"block {block_id}: ref count {ref} and {'in' if free else 'not in'} the free list")
            block_hash = self._block_hash[block_id]
            if block_hash is not None and self._cached.get(block_hash) != block_id:
                raise AssertionError(f"block {block_id} has a hash that the cache maps elsewhere")
            if (block_hash is None) != (self._block_content[block_id] is None):
                raise AssertionError(f"block {block_id}: hash and stored tokens disagree")
        for block_hash, block_id in self._cached.items():
            if self._block_hash[block_id] != block_hash:
                raise AssertionError(f"cache maps a hash to block {block_id}, which holds another hash")
        if len(self._free) + sum(1 for c in self._ref_counts if c > 0) != self.num_blocks - self.num_reserved:
            raise AssertionError("free + referenced blocks != total")
        if self.host_cache is not None:
            self.host_cache.check_integrity()

"""Paged KV cache bookkeeping: which blocks are free, who holds them, what they contain.

Device-free: the runners own the KV tensors; this module only hands out block ids, and the
scheduler sends those ids to the runners inside a `StepPlan`. Token `t` of a sequence lives
in slot `block_table[t // block_size] * block_size + t % block_size`.

Block 0 is the null block (`plan.NULL_BLOCK`): it is never handed out, so runners can point
padding slots at it. Usable blocks are 1..num_blocks-1.

Prefix caching (off by default): a full, computed block can be registered under a hash that
chains the previous block's hash with the block's tokens. A later sequence whose prompt
starts with the same tokens takes the block (reference count + 1) instead of recomputing
it. Blocks whose count drops to 0 keep their hash and sit in the free list, least recently
freed first, until `allocate` reuses (evicts) them. Hits compare the stored tokens, so a
hash collision cannot hand out wrong KV data.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from runtime.core.plan import NULL_BLOCK


class NoFreeBlocks(RuntimeError):
    """`BlockManager.allocate` found too few free blocks; nothing was allocated."""


def hash_block(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: its tokens chained with the previous block's key.

    Chaining makes the key stand for the whole prefix, not only this block's tokens.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"root")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def _check(cond: bool, msg: str) -> None:
    # An explicit raise instead of `assert`, so integrity checks survive `python -O`.
    if not cond:
        raise AssertionError(msg)


class BlockManager:
    """Reference-counted KV blocks with a free list and an optional prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block {NULL_BLOCK} is the null block), "
                f"got {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        # Free blocks in reuse order: allocation takes the head (least recently freed),
        # `free` appends at the tail. An OrderedDict rather than a deque so that a prefix
        # hit can take a free block out of the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._used: set[int] = set()
        # Prefix cache: a bijection between registered blocks and their hashes.
        self._hash_of: dict[int, bytes] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._block_of: dict[bytes, int] = {}
        self._cached_free = 0  # registered blocks no sequence holds (they sit in _free)

    # ---- sizes -------------------------------------------------------------------------

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (cached blocks with no holder included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._hash_of)

    @property
    def num_cached_free(self) -> int:
        """Prefix-cached blocks that no sequence holds: kept for a later prompt that
        shares their prefix, counted in `num_free` (allocate evicts them when it must)."""
        return self._cached_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # ---- allocation --------------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` fresh blocks (reference count 1), evicting cached ones if needed."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            if block_id in self._hash_of:
                self._cached_free -= 1
            self._forget_hash(block_id)
            self._ref[block_id] = 1
            self._used.add(block_id)
            out.append(block_id)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed id; blocks reaching 0 go to the free list's tail.

        Pass a sequence's blocks last-first so that its tail blocks, the least likely to
        be shared by a later prompt, are the first to be evicted. Raises ValueError (and
        frees nothing) if a block is released more often than it is held.
        """
        counts = Counter(block_ids)
        for block_id, n in counts.items():
            if not 0 < block_id < self.num_blocks or self._ref[block_id] < n:
                raise ValueError(
                    f"freeing block {block_id} {n} time(s), but it is held "
                    f"{self._ref[block_id] if 0 <= block_id < self.num_blocks else 0} time(s)"
                )
        for block_id in counts.elements():
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._used.remove(block_id)
                self._free[block_id] = None
                if block_id in self._hash_of:
                    self._cached_free += 1

    # ---- prefix cache ------------------------------------------------------------------

    def cached_block(self, block_hash: bytes, tokens: Sequence[int]) -> int | None:
        """The block holding exactly `tokens` under `block_hash`, if the cache has one."""
        block_id = self._block_of.get(block_hash)
        if block_id is None or self._tokens_of[block_id] != tuple(tokens):
            return None
        return block_id

    def share(self, block_id: int) -> None:
        """One more holder of a block in use (a forked sequence shares its parent's)."""
        _check(self._ref[block_id] > 0, f"sharing block {block_id}, which is not held")
        self._ref[block_id] += 1

    def acquire(self, block_id: int) -> None:
        """Take one more reference to a cached block (it leaves the free list if it was there)."""
        _check(block_id in self._hash_of, f"block {block_id} is not in the prefix cache")
        if self._ref[block_id] == 0:
            del self._free[block_id]
            self._used.add(block_id)
            self._cached_free -= 1
        self._ref[block_id] += 1

    def register(self, block_id: int, block_hash: bytes, tokens: Sequence[int]) -> bool:
        """Publish a full, computed block under its hash; False if nothing was registered.

        Nothing happens when caching is off, when the block is already registered, or when
        another block already holds the same prefix (two sequences computed it at once).
        """
        if not self.enable_prefix_caching or block_id in self._hash_of:
            return False
        _check(self._ref[block_id] > 0, f"registering block {block_id}, which is not held")
        _check(len(tokens) == self.block_size, "only full blocks can be registered")
        if block_hash in self._block_of:
            return False
        self._hash_of[block_id] = block_hash
        self._tokens_of[block_id] = tuple(tokens)
        self._block_of[block_hash] = block_id
        return True

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._tokens_of[block_id]
            del self._block_of[block_hash]

    # ---- audit -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        free = set(self._free)
        _check(len(free) == len(self._free), "duplicate ids in the free list")
        _check(not (free & self._used), f"blocks both free and used: {free & self._used}")
        _check(
            free | self._used == set(range(1, self.num_blocks)),
            "free and used blocks do not cover 1..num_blocks-1",
        )
        _check(NULL_BLOCK not in free and NULL_BLOCK not in self._used, "null block in use")
        _check(self._ref[NULL_BLOCK] == 0, "null block has references")
        for block_id in range(1, self.num_blocks):
            ref = self._ref[block_id]
            _check(ref >= 0, f"block {block_id} has negative reference count {ref}")
            _check(
                (ref > 0) == (block_id in self._used),
                f"block {block_id}: reference count {ref} but used={block_id in self._used}",
            )
        _check(
            self.enable_prefix_caching or not self._hash_of,
            "prefix cache entries while caching is off",
        )
        _check(
            len(self._hash_of) == len(self._block_of) == len(self._tokens_of),
            "prefix cache maps disagree in size",
        )
        idle = sum(1 for block_id in self._hash_of if self._ref[block_id] == 0)
        _check(self._cached_free == idle,
               f"{self._cached_free} cached blocks counted free, {idle} actually are")
        for block_id, block_hash in self._hash_of.items():
            _check(self._block_of.get(block_hash) == block_id, f"hash map broken at {block_id}")
            _check(
                len(self._tokens_of[block_id]) == self.block_size,
                f"cached block {block_id} is not full",
            )

from __future__ import annotations

import random

import pytest

from runtime.core.kv_cache import BlockManager, NoFreeBlocks, hash_block
from runtime.core.plan import NULL_BLOCK


def test_null_block_is_never_handed_out() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    bm.check_integrity()
    assert (bm.num_usable, bm.num_free, bm.num_used) == (4, 4, 0)
    blocks = bm.allocate(4)
    bm.check_integrity()
    assert sorted(blocks) == [1, 2, 3, 4]
    assert NULL_BLOCK not in blocks
    assert (bm.num_free, bm.num_used) == (0, 4)


def test_allocate_short_raises_and_allocates_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(2)
    assert bm.can_allocate(1) and not bm.can_allocate(2)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(2)
    bm.check_integrity()
    assert bm.num_free == 1
    assert bm.allocate(0) == []
    with pytest.raises(ValueError):
        bm.allocate(-1)


def test_free_returns_blocks_in_lru_order() -> None:
    bm = BlockManager(num_blocks=5, block_size=2)
    a = bm.allocate(2)
    b = bm.allocate(2)
    bm.free(b)
    bm.check_integrity()
    bm.free(a)
    bm.check_integrity()
    assert bm.num_free == 4
    # Least recently freed first.
    assert bm.allocate(4) == b + a
    bm.check_integrity()


def test_free_of_unallocated_block_raises_and_frees_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    blocks = bm.allocate(2)
    with pytest.raises(ValueError):
        bm.free([blocks[0], 3])  # 3 was never allocated
    bm.check_integrity()
    assert bm.num_used == 2  # the valid block in the same call was not released
    with pytest.raises(ValueError):
        bm.free([NULL_BLOCK])
    with pytest.raises(ValueError):
        bm.free([99])
    with pytest.raises(ValueError):
        bm.free([blocks[0], blocks[0]])  # released twice, held once
    bm.free(blocks)
    with pytest.raises(ValueError):
        bm.free(blocks)  # double free
    bm.check_integrity()
    assert bm.num_free == 3


def test_blocks_needed() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="null block"):
        BlockManager(num_blocks=1, block_size=4)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)


def test_integrity_check_catches_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate(1)
    bm._ref[1] = 0  # a used block without references
    with pytest.raises(AssertionError):
        bm.check_integrity()
    bm = BlockManager(num_blocks=4, block_size=2)
    bm._free[0] = None  # the null block on the free list
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_random_alloc_free_keeps_invariants() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=33, block_size=4)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            bm.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(0, 6)
            if bm.can_allocate(n):
                blocks = bm.allocate(n)
                assert len(set(blocks)) == n
                held.append(blocks)
            else:
                with pytest.raises(NoFreeBlocks):
                    bm.allocate(n)
        bm.check_integrity()
        assert bm.num_used == sum(len(b) for b in held)
    for blocks in held:
        bm.free(blocks)
    bm.check_integrity()
    assert bm.num_free == bm.num_usable


# ---- prefix cache ------------------------------------------------------------------------


def test_hash_chains_the_prefix() -> None:
    h1 = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == h1
    assert hash_block(None, [2, 1]) != h1
    # Same block tokens after a different prefix: a different key.
    assert hash_block(hash_block(None, [9, 9]), [1, 2]) != hash_block(h1, [1, 2])


def test_registered_block_is_shared_and_survives_free_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    [b] = bm.allocate(1)
    h = hash_block(None, [5, 6])
    assert bm.register(b, h, [5, 6])
    assert not bm.register(b, h, [5, 6])  # already registered
    bm.check_integrity()
    assert bm.cached_block(h, [5, 6]) == b
    assert bm.cached_block(h, [5, 7]) is None  # tokens are compared, not only the hash
    bm.acquire(b)  # a second holder
    assert bm.ref_count(b) == 2
    assert bm.num_cached_free == 0  # cached but held
    bm.free([b])
    bm.free([b])
    bm.check_integrity()
    assert bm.num_free == 3 and bm.num_cached == 1
    assert (bm.num_used, bm.num_cached_free) == (0, 1)  # nothing held, one block kept
    # Free but cached: a hit takes it back out of the free list.
    assert bm.cached_block(h, [5, 6]) == b
    bm.acquire(b)
    bm.check_integrity()
    assert bm.num_used == 1 and bm.ref_count(b) == 1 and bm.num_cached_free == 0
    bm.free([b])
    assert bm.num_cached_free == 1
    # Allocating everything evicts it.
    bm.allocate(3)
    bm.check_integrity()
    assert bm.cached_block(h, [5, 6]) is None and bm.num_cached == 0
    assert bm.num_cached_free == 0


def test_duplicate_content_is_registered_once() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a, b = bm.allocate(2)
    h = hash_block(None, [1, 1])
    assert bm.register(a, h, [1, 1])
    assert not bm.register(b, h, [1, 1])
    bm.check_integrity()
    assert bm.cached_block(h, [1, 1]) == a


def test_register_is_a_no_op_when_caching_is_off() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    [b] = bm.allocate(1)
    assert not bm.register(b, hash_block(None, [1, 2]), [1, 2])
    bm.check_integrity()
    assert bm.num_cached == 0


def test_register_rejects_partial_or_unheld_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    [b] = bm.allocate(1)
    with pytest.raises(AssertionError):
        bm.register(b, hash_block(None, [1]), [1])
    with pytest.raises(AssertionError):
        bm.register(3, hash_block(None, [1, 2]), [1, 2])  # never allocated
    bm.check_integrity()

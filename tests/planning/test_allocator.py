"""The simulated CUDA caching allocator (`torchloom.planning.allocator`): sequences whose allocated and reserved
figures follow by hand from c10's rules (each test's arithmetic in its comments), and, on a CUDA machine, the same
sequences replayed against the device's own `max_memory_reserved()`."""

from __future__ import annotations

import pytest
import torch

from torchloom.errors import ConfigurationError
from torchloom.planning.allocator import CachingAllocator, OutOfMemory, parse_config, round_size, segment_size

KiB, MiB = 1 << 10, 1 << 20


def test_sizes_round_to_512_bytes_and_segments_follow_the_request() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    # <= 1 MiB: a 2 MiB small segment; 1-10 MiB: a 20 MiB large one; >= 10 MiB: rounded up to 2 MiB, its own
    assert segment_size(1 * MiB) == 2 * MiB
    assert segment_size(1 * MiB + 512) == 20 * MiB
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB + 1) == 12 * MiB


def test_small_requests_share_one_2mib_segment() -> None:
    a = CachingAllocator()
    a.malloc(1)  # 512 B of a new 2 MiB segment (remainder 2 MiB - 512 B >= 512 B: kept)
    a.malloc(1000)  # 1024 B, split off the remainder
    a.malloc(1 * MiB)  # 1 MiB still fits the remainder (2 MiB - 1536 B)
    assert (a.allocated, a.reserved, a.segments) == (512 + 1024 + MiB, 2 * MiB, 1)
    a.malloc(1 * MiB)  # 1 MiB - 1536 B left: a second small segment
    assert (a.reserved, a.segments) == (4 * MiB, 2)


def test_large_pool_splits_only_remainders_over_1mib() -> None:
    a = CachingAllocator()
    x = a.malloc(8 * MiB)  # a 20 MiB segment, split: 12 MiB > 1 MiB stays free
    y = a.malloc(
        11 * MiB
    )  # 11 MiB <= 12 MiB: best fit from the remainder, 1 MiB left (not > 1 MiB): not split
    assert (a.allocated, a.reserved) == (8 * MiB + 12 * MiB, 20 * MiB)  # y holds the whole 12 MiB block
    a.free(y)
    a.free(x)  # merged back into one free 20 MiB block
    a.malloc(19 * MiB)  # reuses it; remainder 1 MiB: not split
    assert (a.allocated, a.reserved, a.max_reserved) == (20 * MiB, 20 * MiB, 20 * MiB)


def test_large_requests_take_segments_of_their_own_and_frees_keep_them_reserved() -> None:
    a = CachingAllocator()
    x = a.malloc(100 * MiB + 1)  # rounded to 100 MiB + 512 B, a segment of 102 MiB (2 MiB multiples)
    assert (a.allocated, a.reserved) == (100 * MiB + 512, 102 * MiB)
    a.free(x)
    assert (a.allocated, a.reserved) == (0, 102 * MiB)  # back to the cache, not to the device
    a.malloc(50 * MiB)  # best fit: the cached 102 MiB block, split (52 MiB > 1 MiB left)
    assert (a.allocated, a.reserved) == (50 * MiB, 102 * MiB)
    a.malloc(60 * MiB)  # the 52 MiB remainder is too small: a new 60 MiB segment
    assert (a.reserved, a.max_allocated, a.max_reserved) == (162 * MiB, 110 * MiB, 162 * MiB)
    a.empty_cache()  # both segments are in use (one split): nothing to release
    assert a.reserved == 162 * MiB


def test_best_fit_takes_the_smallest_block_that_holds_the_request() -> None:
    a = CachingAllocator()
    big, small = a.malloc(40 * MiB), a.malloc(30 * MiB)  # two segments, 40 + 30 MiB
    a.free(big)
    a.free(small)
    a.malloc(25 * MiB)  # 30 MiB is the best fit (5 MiB left: split); the 40 MiB block stays whole
    a.malloc(40 * MiB)  # so this one still fits without a new segment
    assert (a.reserved, a.allocated) == (70 * MiB, 65 * MiB)


def test_streams_and_pools_do_not_share_cached_blocks() -> None:
    a = CachingAllocator()
    a.free(a.malloc(20 * MiB, stream=0))  # a cached 20 MiB block of stream 0
    a.malloc(20 * MiB, stream=1)  # another stream: a segment of its own
    assert a.reserved == 40 * MiB
    a.free(a.malloc(512 * KiB, stream=2))  # a cached 2 MiB small segment of stream 2
    a.malloc(2 * MiB, stream=2)  # a large request never takes it: a 20 MiB segment
    assert a.reserved == 40 * MiB + 2 * MiB + 20 * MiB


def test_the_reserved_peak_is_split_by_stream_and_pool() -> None:
    # FSDP2's shape: a unit's full-size reduce-scatter input made on its own stream and freed there, then the
    # compute stream's activations, which cannot use that stream's cached segment.
    a = CachingAllocator()
    held = a.malloc(30 * MiB, stream=0)  # >= 10 MiB: its own segment, 30 MiB
    a.free(a.malloc(12 * MiB + 1, stream=1))  # rounded to 12 MiB + 512 B, segment 14 MiB, cached for stream 1
    a.malloc(3 * MiB, stream=0)  # < 10 MiB: a 20 MiB segment of stream 0 (stream 1's 14 MiB stays apart)
    a.malloc(100, stream=0)  # a 2 MiB small segment
    assert a.max_reserved == 30 * MiB + 14 * MiB + 20 * MiB + 2 * MiB
    assert a.reserved_by_pool_at_peak == {(0, False): 50 * MiB, (1, False): 14 * MiB, (0, True): 2 * MiB}
    assert a.allocated_at_reserved_peak == 33 * MiB  # before the 512 B block of the last request
    a.free(held)
    a.empty_cache()  # the wholly free segments go back: stream 0's 30 MiB and stream 1's 14 MiB
    assert a.reserved_by_pool == {(0, False): 20 * MiB, (1, False): 0, (0, True): 2 * MiB}
    assert a.max_reserved == 66 * MiB  # a peak stays a peak


def test_freed_neighbours_merge() -> None:
    a = CachingAllocator()
    x, y, z = a.malloc(6 * MiB), a.malloc(6 * MiB), a.malloc(6 * MiB)  # 18 of one 20 MiB segment (2 MiB free)
    assert a.reserved == 20 * MiB
    a.free(x)
    a.free(z)  # z merges with the free 2 MiB after it: free blocks of 6 and 8 MiB
    a.malloc(9 * MiB)  # neither holds 9 MiB: a new 20 MiB segment
    assert a.reserved == 40 * MiB
    a.free(y)  # 6 + 6 + 8 merge into the whole first segment again
    a.malloc(19 * MiB)  # which holds 19 MiB: no new segment
    assert a.reserved == 40 * MiB


def test_a_full_device_releases_the_cache_then_runs_out() -> None:
    a = CachingAllocator(capacity=100 * MiB)
    a.free(a.malloc(60 * MiB))  # 60 MiB cached
    a.malloc(70 * MiB)  # 60 + 70 > 100: the free segment is released first, then 70 MiB reserved
    assert (a.reserved, a.max_reserved, a.retries) == (70 * MiB, 70 * MiB, 1)
    with pytest.raises(OutOfMemory, match="out of memory"):
        a.malloc(40 * MiB)  # 70 + 40 > 100 and nothing cached to release


def test_expandable_segments_keep_small_remainders_and_grow_by_pages() -> None:
    for expandable in (True, False):
        a = CachingAllocator(expandable_segments=expandable)
        x = a.malloc(8 * MiB)  # 20 MiB (a page, or a segment); 12 MiB left, kept (> 1 MiB)
        a.malloc(12 * MiB)  # the 12 MiB remainder exactly
        a.free(x)
        a.malloc(7 * MiB + 512 * KiB)  # the freed 8 MiB block; 512 KiB left
        if expandable:  # 512 KiB >= 512 B: split off and kept
            assert (a.allocated, a.reserved) == (19 * MiB + 512 * KiB, 20 * MiB)
        else:  # 512 KiB is not > 1 MiB: the request holds the whole 8 MiB
            assert (a.allocated, a.reserved) == (20 * MiB, 20 * MiB)
        a.malloc(12 * MiB + 512 * KiB)
        # expandable: nothing free at the segment's end, one more 20 MiB page: 40 MiB in one segment;
        # default: >= 10 MiB, a segment of its own rounded up to 2 MiB (14 MiB): 34 MiB in two
        assert (a.reserved, a.segments) == ((40 * MiB, 1) if expandable else (34 * MiB, 2))


def test_expandable_segments_grow_into_the_free_block_at_their_end() -> None:
    a = CachingAllocator(expandable_segments=True)
    a.malloc(8 * MiB)  # one 20 MiB page; 12 MiB free at the end
    a.malloc(12 * MiB + 512 * KiB)  # the free 12 MiB + one more page (20 MiB): 40 MiB, 19.5 MiB free after
    assert (a.reserved, a.allocated, a.segments) == (40 * MiB, 20 * MiB + 512 * KiB, 1)
    a.malloc(19 * MiB + 512 * KiB)  # the free end holds it exactly: no page more
    assert a.reserved == 40 * MiB


def test_expandable_segments_release_the_free_pages_at_their_end() -> None:
    a = CachingAllocator(expandable_segments=True)
    x = a.malloc(30 * MiB)  # two pages: 40 MiB
    a.free(x)
    a.empty_cache()
    assert a.reserved == 0


def test_alloc_conf_strings() -> None:
    assert parse_config("expandable_segments:True") is True
    assert parse_config("expandable_segments:False") is False
    assert parse_config(None) is False
    with pytest.raises(ConfigurationError, match="max_split_size_mb"):
        parse_config("max_split_size_mb:128")


@pytest.mark.cuda
def test_the_simulation_meets_the_device() -> None:
    """On a CUDA device: allocations and frees of the sizes above, the device's own peaks against the
    simulation's (run in this process: the allocator's default configuration)."""
    sizes = [1, 1000, MiB, 8 * MiB, 11 * MiB, 100 * MiB + 1, 50 * MiB, 60 * MiB, 6 * MiB, 19 * MiB]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_alloc, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    sim = CachingAllocator()
    held: list[tuple[torch.Tensor, int]] = []
    for i, n in enumerate(sizes):
        held.append((torch.empty(n, dtype=torch.uint8, device="cuda"), sim.malloc(n)))
        if i % 3 == 2:  # free every third one's predecessor
            tensor, handle = held.pop(-2)
            del tensor
            sim.free(handle)
    assert torch.cuda.max_memory_allocated() - base_alloc == sim.max_allocated
    assert torch.cuda.max_memory_reserved() - base_reserved == sim.max_reserved


@pytest.mark.parametrize("expandable", [False, True])
def test_random_sequences_keep_the_books(expandable: bool) -> None:
    """Every segment's blocks tile it, no two free blocks sit side by side, and `allocated`/`reserved` are the
    sums of the allocated blocks and the segments, after every call of a seeded random sequence."""
    import random

    rng = random.Random(0)
    a = CachingAllocator(expandable_segments=expandable, capacity=600 * MiB)
    live: list[int] = []
    for _ in range(1000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice(
                [rng.randrange(1, 4 * KiB), rng.randrange(1, 2 * MiB), rng.randrange(1, 40 * MiB)]
            )
            try:
                live.append(a.malloc(size, stream=rng.randrange(2)))
            except OutOfMemory:
                a.free(live.pop(0))
        if rng.random() < 0.01:
            a.empty_cache()
        segments = {id(b.segment): b.segment for b, _ in a._live.values()}
        segments.update({id(e[2].segment): e[2].segment for pool in a._free.values() for e in pool})
        allocated = 0
        for segment in segments.values():
            block, total = segment.first, 0
            while block is not None:
                assert block.address == segment.address + total
                assert block.allocated or block.next is None or block.next.allocated
                allocated += block.size if block.allocated else 0
                total, block = total + block.size, block.next
            assert total == segment.size
        assert allocated == a.allocated
        assert a.reserved == sum(s.size for s in segments.values()) <= 600 * MiB

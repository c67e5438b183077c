"""The CUDA caching allocator, simulated: what `torch.cuda.max_memory_reserved()` would report for a sequence of
allocations and frees, without a GPU.

Written from the rules of c10's `CUDACachingAllocator` (c10/cuda/CUDACachingAllocator.cpp), which a planned CUDA
job's reserved memory follows:

- a request is rounded up to a multiple of 512 B (512 B at least); a zero-byte request takes nothing;
- requests up to 1 MiB come from the small pool, larger ones from the large pool; pools and streams never share
  blocks;
- a request is served by the smallest cached free block of its pool and stream that holds it (the lowest
  address among equals); failing that, a new segment is reserved: 2 MiB for a small request, 20 MiB for a large
  one under 10 MiB, and the request rounded up to 2 MiB for larger ones (a segment of its own);
- a block larger than the request is split when the remainder is worth keeping (small pool: 512 B or more;
  large pool: more than 1 MiB); otherwise the request holds the whole block, and `allocated` counts all of it;
- a freed block goes back to its pool's cache, not to the device, and merges with free neighbours of its
  segment; `reserved` only falls when the cache is released (`empty_cache()`, or a reservation the device's
  memory cannot hold: every wholly free segment is released and the reservation tried again);
- `expandable_segments:True` (`PYTORCH_CUDA_ALLOC_CONF`): one segment per stream and pool that grows by mapping
  pages (2 MiB in the small pool, 20 MiB in the large one) at its end, where a free block at the end grows into
  them; split remainders of 512 B or more are kept in both pools.

Not modelled: `max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold` (refused by
`parse_config`), blocks used on another stream (`record_stream`: freed only when that stream is done), CUDA
graphs' private pools, and, with expandable segments, the release of free pages other than those at a segment's
end.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from torchloom.errors import ConfigurationError

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_SEGMENT = 2 << 20  # kSmallBuffer: the small pool's segments (and its expandable pages)
LARGE_SEGMENT = (
    20 << 20
)  # kLargeBuffer: the large pool's segments for requests under MIN_LARGE_ALLOC (and pages)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here on a request's segment is its own
ROUND_LARGE = 2 << 20  # kRoundLarge: such a segment is the request rounded up to 2 MiB


class OutOfMemory(Exception):
    """A reservation the device's memory could not hold, even with the cache released."""

    def __init__(self, nbytes: int, allocator: CachingAllocator) -> None:
        self.nbytes = nbytes
        self.allocated = allocator.allocated
        self.reserved = allocator.reserved
        super().__init__(
            f"out of memory: {nbytes} B more for the device's segments with {allocator.allocated} B allocated "
            f"and {allocator.reserved} B reserved, of {allocator.capacity} B"
        )


def parse_config(text: str | None) -> bool:
    """A `PYTORCH_CUDA_ALLOC_CONF` string -> whether it turns expandable segments on. Options the simulation does
    not model are refused (the figure would be another allocator's)."""
    expandable = False
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, _, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key == "expandable_segments" and value in ("True", "False"):
            expandable = value == "True"
        elif key in ("backend",) and value == "native":
            continue
        else:
            raise ConfigurationError(
                f"PYTORCH_CUDA_ALLOC_CONF option {item.strip()!r}: the plan's simulation of the caching allocator "
                "models expandable_segments:True or False only; leave the others out of PYTORCH_CUDA_ALLOC_CONF "
                "while planning (the plan then shows the default allocator's reserved memory)."
            )
    return expandable


def round_size(nbytes: int) -> int:
    """A request's size as the allocator serves it: a multiple of 512 B, 512 B at least."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment reserved for a (rounded) request that no cached block holds."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    stream: int
    small: bool
    segment: _Segment
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


@dataclass(eq=False)
class _Segment:
    address: int
    size: int  # reserved (mapped, for an expandable segment)
    expandable: bool = False
    first: _Block | None = field(default=None, repr=False)


class CachingAllocator:
    """One device's caching allocator. `malloc(nbytes, stream)` returns a handle for `free`; `allocated`,
    `reserved` and their peaks (`max_allocated`, `max_reserved`) are what `torch.cuda.memory_allocated()`,
    `memory_reserved()`, `max_memory_allocated()` and `max_memory_reserved()` report. `capacity`: the device's
    memory in bytes (None: unlimited), beyond which a reservation first releases the cache, then raises
    `OutOfMemory`."""

    def __init__(self, expandable_segments: bool = False, capacity: int | None = None) -> None:
        self.expandable = expandable_segments
        self.capacity = capacity
        self.allocated = 0
        self.reserved = 0
        self.requested = 0
        self.max_allocated = 0
        self.max_reserved = 0
        self.segments = 0  # the segments reserved now
        # (stream, small pool) -> the bytes reserved for it now, and as they were at the reserved peak: a
        # stream's segments serve only that stream (FSDP2's all-gather and reduce-scatter streams keep theirs)
        self.reserved_by_pool: dict[tuple[int, bool], int] = {}
        self.reserved_by_pool_at_peak: dict[tuple[int, bool], int] = {}
        self.allocated_at_reserved_peak = 0
        self.retries = 0  # reservations that released the cache first (`num_alloc_retries`)
        # (small pool, stream) -> the free blocks, sorted by (size, address): best fit is a bisection
        self._free: dict[tuple[bool, int], list[tuple[int, int, _Block]]] = {}
        self._live: dict[int, tuple[_Block, int]] = {}  # handle -> (block, requested bytes)
        self._expandable: dict[tuple[bool, int], _Segment] = {}
        self._next_address = 1 << 32
        self._next_handle = 0

    # ---- the two calls -------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate `nbytes` on `stream`; returns the handle `free` takes (0 for a zero-byte request)."""
        if nbytes <= 0:
            return 0
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, stream, size)
        if block is None:
            block = self._reserve(small, stream, size)
        self._split(block, size)
        block.allocated = True
        self.allocated += block.size
        self.requested += nbytes
        self.max_allocated = max(self.max_allocated, self.allocated)
        self._next_handle += 1
        self._live[self._next_handle] = (block, nbytes)
        return self._next_handle

    def free(self, handle: int) -> None:
        """Return an allocation to the cache (merged with its free neighbours); `reserved` does not change."""
        if handle == 0:
            return
        block, nbytes = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= nbytes
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._unlist(neighbour)
                self._merge(block, neighbour)
        self._list(block)

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: every wholly free segment goes back to the device (an expandable segment
        unmaps the free pages at its end)."""
        for pool in list(self._free.values()):
            for _, _, block in list(pool):
                segment = block.segment
                if segment.expandable:
                    self._unmap_tail(segment)
                elif block.prev is None and block.next is None:
                    self._unlist(block)
                    self._released(block, segment.size)
                    self.segments -= 1

    # ---- blocks ---------------------------------------------------------------------------------------------
    def _list(self, block: _Block) -> None:
        bisect.insort(self._free.setdefault((block.small, block.stream), []), (*block.key(), block))

    def _unlist(self, block: _Block) -> None:
        pool = self._free[(block.small, block.stream)]
        del pool[bisect.bisect_left(pool, block.key(), key=lambda entry: entry[:2])]

    def _best_fit(self, small: bool, stream: int, size: int) -> _Block | None:
        pool = self._free.get((small, stream), [])
        at = bisect.bisect_left(pool, (size, -1), key=lambda entry: entry[:2])
        if at == len(pool):
            return None
        block = pool.pop(at)[2]
        return block

    def _split(self, block: _Block, size: int) -> None:
        """Keep the remainder of a larger block as a free block of its own when it is worth keeping."""
        remaining = block.size - size
        worth = remaining >= MIN_BLOCK if block.small or self.expandable else remaining > SMALL_SIZE
        if not worth:
            return
        rest = _Block(block.address + size, remaining, block.stream, block.small, block.segment)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        self._list(rest)

    @staticmethod
    def _merge(block: _Block, neighbour: _Block) -> None:
        """Absorb the free `neighbour` (just before or after `block`) into `block`."""
        if neighbour is block.prev:
            block.address = neighbour.address
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                block.segment.first = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size

    # ---- segments -------------------------------------------------------------------------------------------
    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _release_for(self, nbytes: int) -> None:
        """A reservation the device cannot hold: release the cache (the allocator's retry), once."""
        if not self._fits(nbytes):
            self.retries += 1
            self.empty_cache()

    def _grant(self, nbytes: int, stream: int, small: bool) -> None:
        if not self._fits(nbytes):
            raise OutOfMemory(nbytes, self)
        self.reserved += nbytes
        pool = (stream, small)
        self.reserved_by_pool[pool] = self.reserved_by_pool.get(pool, 0) + nbytes
        if self.reserved > self.max_reserved:
            self.max_reserved = self.reserved
            self.reserved_by_pool_at_peak = dict(self.reserved_by_pool)
            self.allocated_at_reserved_peak = self.allocated

    def _released(self, block: _Block, nbytes: int) -> None:
        self.reserved -= nbytes
        self.reserved_by_pool[(block.stream, block.small)] -= nbytes

    def _reserve(self, small: bool, stream: int, size: int) -> _Block:
        if self.expandable:
            return self._grow(small, stream, size)
        nbytes = segment_size(size)
        self._release_for(nbytes)
        self._grant(nbytes, stream, small)
        segment = _Segment(self._next_address, nbytes)
        self._next_address += nbytes
        self.segments += 1
        block = _Block(segment.address, nbytes, stream, small, segment)
        segment.first = block
        return block

    def _grow(self, small: bool, stream: int, size: int) -> _Block:
        """Map pages at the end of the stream's and pool's expandable segment, into the free block at its end."""
        segment = self._expandable.get((small, stream))
        if segment is None:
            segment = _Segment(self._next_address, 0, expandable=True)
            self._next_address += 1 << 48  # a virtual range as large as any device
            self._expandable[(small, stream)] = segment
            self.segments += 1
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        for attempt in range(2):  # the second after releasing the cache (which may unmap the free end)
            tail = self._tail(segment)
            have = tail.size if tail is not None and not tail.allocated else 0
            more = -(-(size - have) // page) * page
            if attempt == 0:
                self._release_for(more)
        self._grant(more, stream, small)
        segment.size += more
        if have:
            assert tail is not None
            self._unlist(tail)
            tail.size += more
            return tail
        block = _Block(segment.address + segment.size - more, more, stream, small, segment)
        block.prev = tail
        if tail is not None:
            tail.next = block
        else:
            segment.first = block
        return block

    @staticmethod
    def _tail(segment: _Segment) -> _Block | None:
        block = segment.first
        while block is not None and block.next is not None:
            block = block.next
        return block

    def _unmap_tail(self, segment: _Segment) -> None:
        tail = self._tail(segment)
        if tail is None or tail.allocated:
            return
        page = SMALL_SEGMENT if tail.small else LARGE_SEGMENT
        # the pages wholly inside the free block at the end
        start = -(-(tail.address - segment.address) // page) * page
        unmapped = segment.size - start
        if unmapped <= 0:
            return
        self._unlist(tail)
        segment.size -= unmapped
        self._released(tail, unmapped)
        tail.size -= unmapped
        if tail.size:
            self._list(tail)
        elif tail.prev is not None:
            tail.prev.next = None
        else:
            segment.first = None

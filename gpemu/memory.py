"""GPU memory of the emulated devices: one :class:`MemoryTracker` per device.

Every emulated tensor holds a :class:`Block` for its storage; views and in-place results share
their base's block, and a block is returned to the tracker when the last tensor using it dies
(the block's ``__del__``), which is how PyTorch's caching allocator sees it too.

Model of the caching allocator (enough for ``memory_allocated``/``memory_reserved`` and OOM):

* every request is rounded up to a multiple of 512 bytes (the allocator's minimum block);
* reserved memory grows in 2 MiB segments to cover what is allocated and is kept when blocks are
  freed (the cache); ``empty_cache()`` shrinks it back to what is in use;
* a request that cannot be covered within the device's capacity, even after the cache is
  emptied, raises ``torch.cuda.OutOfMemoryError`` with PyTorch's message, before anything is
  changed, so catching it and retrying with a smaller batch works.

CUDA graphs: while a graph is captured, the device's allocations come from the graph's private
pool (:class:`PrivatePool`); memory freed back to a pool stays reserved for it, unusable by other
allocations, until every graph using the pool is reset or deleted.

Fragmentation is not modelled. Memory samples for the recorder are taken at forward/backward
boundaries by the replay path (never per op).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

from .units import format_bytes

__all__ = [
    "MemoryTracker",
    "Block",
    "GroupBlock",
    "SubBlock",
    "PeakScope",
    "PrivatePool",
    "PoolBlock",
    "install",
    "round_size",
    "MIN_BLOCK",
    "SEGMENT",
]

MIN_BLOCK = 512
SEGMENT = 2 * 1024 * 1024


def round_size(nbytes: int) -> int:
    """Bytes the caching allocator really hands out for a request of ``nbytes``."""
    if nbytes <= 0:
        return 0
    return (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK


def _round_segment(nbytes: int) -> int:
    return (nbytes + SEGMENT - 1) // SEGMENT * SEGMENT


class Block:
    """One allocation on an emulated device; freed when the last tensor holding it dies."""

    __slots__ = ("tracker", "size", "__weakref__")
    parent = None  # a share of a group allocation has one (SubBlock)
    pool: PrivatePool | None = None  # a CUDA graph's private pool it came from (PoolBlock)

    def __init__(self, tracker: MemoryTracker, size: int) -> None:
        self.tracker = tracker
        self.size = size

    @property
    def address(self) -> int:
        """A fake device address, unique while the block lives (data_ptr() tells storages apart)."""
        return id(self) << 4

    def resize(self, nbytes: int) -> None:
        """Its storage resized to ``nbytes`` (``untyped_storage().resize_``): freed at 0, else a new
        allocation of that size replaces it (CUDA allocates the new buffer, copies, then frees the
        old one: both count at the peak). OutOfMemoryError before any change."""
        size = round_size(nbytes)
        old = self.size
        if size == old:
            return
        tracker = self.tracker
        if size:
            tracker._account(size)
        if old:
            tracker._release(old)
        self.size = size

    def __del__(self) -> None:
        size = self.size
        if not size:  # (an empty request or a storage resized to 0 holds no allocation)
            return
        try:  # (MemoryTracker._release inline: every emulated tensor's memory goes back here)
            tracker = self.tracker
            tracker.allocated -= size
            tracker.num_allocs -= 1
            tracker.num_frees += 1
        except Exception:  # interpreter shutdown: nothing left to account for
            pass

    def __deepcopy__(self, memo: dict) -> Block:
        # A copy of a tensor needs its own storage: new allocation of the same size.
        return self.tracker.allocate(self.size)

    def __reduce__(self) -> Any:
        raise TypeError("an emulated GPU memory block cannot be pickled")


class PoolBlock(Block):
    """An allocation from a CUDA graph's private pool: when it dies, its bytes go back to the pool."""

    __slots__ = ("pool",)

    def __init__(self, tracker: MemoryTracker, size: int, pool: PrivatePool) -> None:
        super().__init__(tracker, size)
        self.pool = pool

    def __del__(self) -> None:
        try:
            pool = self.pool
            if pool is not None:
                pool.give(self.size)
        except Exception:  # interpreter shutdown
            pass


class PrivatePool:
    """A CUDA graph's private memory pool on one device: what a capture allocates comes from it
    (graphs given the same ``pool`` handle share one), and what its tensors free stays in it.

    ``size``: the bytes the pool holds (its high-water mark); ``live``: those in live tensors. The
    rest is reserved for the pool's graphs (the tracker's ``pool_spare``) until :meth:`release`, when no
    graph uses the pool any more: then it goes back to the caching allocator, and so do the
    pool's live tensors' bytes when they die."""

    __slots__ = ("tracker", "size", "live", "users", "open", "__weakref__")

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        self.size = 0
        self.live = 0
        self.users = 0  # graphs holding the pool (gpemu.graphs)
        self.open = True

    def take(self, size: int) -> None:
        """Account an allocation of ``size`` rounded bytes from the pool: from its free bytes
        first, the rest as new memory of the device (OOM before any change)."""
        t = self.tracker
        from_pool = min(size, self.size - self.live) if self.open else 0
        new_alloc = t.allocated + size
        spare = t.pool_spare - from_pool
        if new_alloc + spare > t.reserved:
            t._grow(new_alloc + spare, size)
        t.allocated = new_alloc
        t.pool_spare = spare
        if new_alloc > t.peak_allocated:
            t.peak_allocated = new_alloc
        t.num_allocs += 1
        t.num_alloc_calls += 1
        self.size += size - from_pool
        self.live += size

    def give(self, size: int) -> None:
        """A tensor of the pool died: its bytes stay with the pool while it is open."""
        t = self.tracker
        t.allocated -= size
        t.num_allocs -= 1
        t.num_frees += 1
        self.live -= size
        if self.open:
            t.pool_spare += size
        else:
            self.size -= size

    def release(self) -> None:
        """No graph uses the pool any more: its free bytes go back to the caching allocator."""
        if self.open:
            self.tracker.pool_spare -= self.size - self.live
            self.size = self.live
            self.open = False

    def reopen(self) -> None:
        """A graph captures into the pool again (its handle was passed to a new capture)."""
        self.open = True


class GroupBlock(Block):
    """The one allocation behind a group (:meth:`MemoryTracker.allocate_group`). Besides dying
    with its last share like any block, it can be given back and taken again as a whole while
    its shares live on: the gradient sets of ``gpemu.fastpaths.gradients`` drop a module's
    gradients at ``zero_grad`` and hand the same wrappers out at the next backward, and this
    keeps that to one tracker call each way instead of one object per parameter."""

    __slots__ = ("held", "hidden", "exposed", "owner", "pool")

    def __init__(self, tracker: MemoryTracker, size: int) -> None:
        super().__init__(tracker, size)
        self.pool = tracker.pool  # a CUDA graph's pool while one is captured
        self.held = True
        # Kept here for the gradient sets (read by the emulated tensor's ``grad`` property, which
        # reaches a gradient's group through its block): ``hidden``, the shares are attached
        # to their parameters but read as None (given back by a zero_grad, see
        # gpemu.fastpaths.gradients); ``exposed``, a share was handed to Python code since the
        # group was last checked; ``owner``, a weak reference to what manages the group (with
        # a ``materialize()`` method that detaches hidden shares for real).
        self.hidden = False
        self.exposed = False
        self.owner: Any = None

    def release(self) -> None:
        """Give the memory back now (as if every share had died); the shares stay usable."""
        if self.held:
            self.held = False
            self._give_back()

    def reacquire(self) -> None:
        """Take the memory again, as a new allocation of the same size (OOM before any change)."""
        if not self.held:
            self.tracker._account(self.size)
            self.pool = self.tracker.pool
            self.held = True

    def _give_back(self) -> None:
        if self.pool is not None:
            self.pool.give(self.size)
        else:
            self.tracker._release(self.size)

    def __del__(self) -> None:
        if self.held:
            try:
                self._give_back()
            except Exception:  # interpreter shutdown
                pass


class SubBlock:
    """One tensor's share of a group allocation (:meth:`MemoryTracker.allocate_group`): it keeps
    the group's :class:`Block` alive; the memory returns when every share has died."""

    __slots__ = ("parent", "offset", "size", "__weakref__")

    def __init__(self, parent: Block, offset: int, size: int) -> None:
        self.parent = parent
        self.offset = offset
        self.size = size

    @property
    def address(self) -> int:
        return self.parent.address + self.offset

    @property
    def tracker(self) -> MemoryTracker:
        return self.parent.tracker

    def __deepcopy__(self, memo: dict) -> Block:
        return self.parent.tracker.allocate(self.size)

    def resize(self, nbytes: int) -> None:
        raise NotImplementedError(
            "gpemu: resizing the storage of a gradient kept in a shared group allocation is not emulated; "
            "give the parameter a gradient of its own first (p.grad = p.grad.clone())"
        )

    def __reduce__(self) -> Any:
        raise TypeError("an emulated GPU memory block cannot be pickled")


class PeakScope:
    """What :meth:`MemoryTracker.peak_scope` measured: ``peak``, allocated bytes at the highest."""

    __slots__ = ("peak",)

    def __init__(self) -> None:
        self.peak = 0


class MemoryTracker:
    """Allocated/reserved/peak bytes of one emulated GPU; raises CUDA's OOM at its capacity."""

    def __init__(self, device: int, capacity: int, recorder: Any = None) -> None:
        if capacity <= 0:
            raise ValueError(f"GPU memory capacity must be positive, got {capacity!r} bytes")
        self.device = device
        self.total = int(capacity)  # the GPU's memory
        self.capacity = int(capacity)  # what this process may use (set_fraction lowers it)
        self.recorder = recorder
        self.allocated = 0
        # The allocated total up to which an allocation needs nothing but counting (reserved
        # memory less what graphs' pools hold; -1 while a pool is capturing): the hot paths'
        # one comparison, kept by the setters of ``reserved``, ``pool_spare`` and ``pool``.
        self.fits_below = 0
        self._reserved = 0
        self._pool_spare = 0
        self._pool: PrivatePool | None = None
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.sampled_peak = 0  # the highest allocation a memory sample has shown (see sample)
        self.num_allocs = 0  # live blocks
        self.num_alloc_calls = 0  # total allocations (memory_stats "allocation.all.allocated")
        self.num_frees = 0
        self.num_ooms = 0
        self.num_alloc_retries = 0

    # CUDA graphs (gpemu.graphs): ``pool``, the private pool allocations come from while a graph
    # is captured, and ``pool_spare``, the bytes pools hold beyond their live tensors (reserved,
    # not allocated).
    @property
    def reserved(self) -> int:
        return self._reserved

    @reserved.setter
    def reserved(self, value: int) -> None:
        self._reserved = value
        self._set_fits()

    @property
    def pool_spare(self) -> int:
        return self._pool_spare

    @pool_spare.setter
    def pool_spare(self, value: int) -> None:
        self._pool_spare = value
        self._set_fits()

    @property
    def pool(self) -> PrivatePool | None:
        return self._pool

    @pool.setter
    def pool(self, value: PrivatePool | None) -> None:
        self._pool = value
        self._set_fits()

    def _set_fits(self) -> None:
        self.fits_below = -1 if self._pool is not None else self._reserved - self._pool_spare

    # ------------------------------------------------------------------ hot path
    def allocate(self, nbytes: int) -> Block:
        """Account one allocation; return its :class:`Block` (freed when garbage)."""
        # (round_size and _account inline: every emulated tensor's allocation comes here; an
        # empty request, a pool's or one that grows the reservation takes _allocate_rest)
        size = (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK
        new_alloc = self.allocated + size
        if new_alloc > self.fits_below or size <= 0:
            return self._allocate_rest(size)
        self.allocated = new_alloc
        if new_alloc > self.peak_allocated:
            self.peak_allocated = new_alloc
        self.num_allocs += 1
        self.num_alloc_calls += 1
        return Block(self, size)

    def _allocate_rest(self, size: int) -> Block:
        """:meth:`allocate` of ``size`` rounded bytes beyond its one comparison."""
        if size <= 0:
            return Block(self, 0)  # (CUDA's allocator hands out nothing for an empty request)
        pool = self._pool
        if pool is not None:
            pool.take(size)
            return PoolBlock(self, size, pool)
        self._account(size)
        return Block(self, size)

    def _account(self, size: int) -> None:
        """Count an allocation of ``size`` already-rounded bytes (no block object)."""
        if self._pool is not None:
            self._pool.take(size)
            return
        new_alloc = self.allocated + size
        if new_alloc > self.fits_below:
            self._grow(new_alloc + self._pool_spare, size)
        self.allocated = new_alloc
        if new_alloc > self.peak_allocated:
            self.peak_allocated = new_alloc
        self.num_allocs += 1
        self.num_alloc_calls += 1

    def allocate_group(self, sizes: list[int], rounded: bool = False) -> list[SubBlock | None]:
        """Account several allocations made together (the parameter gradients of one backward) in
        ONE tracker call: same bytes as separate requests, but one block shared by all, freed
        when the last of them dies. ``None`` for a zero-byte request. ``rounded=True``: the sizes
        are already :func:`round_size` results (the replayed backward caches them)."""
        charged = sizes if rounded else [round_size(n) for n in sizes]
        total = sum(charged)
        if not total:
            return [None] * len(sizes)
        self._account(total)
        parent = GroupBlock(self, total)
        out: list[SubBlock | None] = []
        offset = 0
        for size in charged:
            out.append(SubBlock(parent, offset, size) if size else None)
            offset += size
        return out

    def _grow(self, footprint: int, size: int) -> None:
        """Reserve memory for ``footprint`` bytes (allocated plus held by graph pools)."""
        reserved = _round_segment(footprint)
        if reserved > self.capacity:
            # Like the caching allocator: release cached segments and retry before failing.
            self.num_alloc_retries += 1
            if footprint > self.capacity:
                self.num_ooms += 1
                raise torch.cuda.OutOfMemoryError(self.oom_message(size))
            reserved = footprint
        self.reserved = reserved
        if reserved > self.peak_reserved:
            self.peak_reserved = reserved

    def _release(self, size: int) -> None:
        self.allocated -= size
        self.num_allocs -= 1
        self.num_frees += 1

    def touch(self, extra: int) -> None:
        """Memory used for a moment on top of what is allocated (workspace, temporaries of a
        replayed forward/backward): raises the peak, and OOMs if it does not fit."""
        if extra <= 0:
            return
        # allocate() and the block's immediate free, without making the block (hot path): the
        # counts of one allocation and one free; allocated is back where it was
        size = (extra + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK
        new_alloc = self.allocated + size
        if new_alloc > self.fits_below:
            pool = self._pool
            if pool is not None:
                pool.take(size)
                pool.give(size)
                return
            self._grow(new_alloc + self._pool_spare, size)
        if new_alloc > self.peak_allocated:
            self.peak_allocated = new_alloc
        self.num_alloc_calls += 1
        self.num_frees += 1

    @contextmanager
    def peak_scope(self) -> Iterator[PeakScope]:
        """``with tracker.peak_scope() as scope:`` measures the peak of the work inside alone:
        the peak restarts at what is allocated on entry; on exit ``scope.peak`` holds the inside's
        peak and the tracker's peak is the larger of it and the peak before (fast paths record
        what a call used for a moment this way)."""
        scope = PeakScope()
        outer = self.peak_allocated
        self.peak_allocated = self.allocated
        try:
            yield scope
        finally:
            scope.peak = self.peak_allocated
            self.peak_allocated = max(outer, scope.peak)

    def set_fraction(self, fraction: float) -> None:
        """Like torch.cuda.set_per_process_memory_fraction(): allocations beyond
        ``fraction * total`` raise OOM."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.capacity = int(self.total * fraction)

    # ------------------------------------------------------------------ queries
    @property
    def free(self) -> int:
        return max(self.total - self.reserved, 0)

    def reset_peak(self) -> None:
        """Like torch.cuda.reset_peak_memory_stats(): the peaks restart from the current use."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.sampled_peak = self.allocated  # later peaks below the old one show in samples too

    def reset_accumulated(self) -> None:
        """Like torch.cuda.reset_accumulated_memory_stats(): the historical counters (allocations
        and frees made, allocation retries, OOMs) restart from zero; current use and peaks stay."""
        self.num_alloc_calls = 0
        self.num_frees = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    def empty_cache(self) -> None:
        """Like torch.cuda.empty_cache(): give unused cached segments back (not those that CUDA
        graphs' pools hold)."""
        self.reserved = _round_segment(self.allocated + self.pool_spare)

    def sample(self) -> None:
        """Append (allocated, reserved) now to the run's recorder (forward/backward boundaries).

        A peak reached since the previous sample and never shown by one (an optimizer's first
        step makes its state and frees its temporaries between two samples) is appended first, at
        the same time: otherwise the trace and its plot stay below the summary's peak. Read from
        ``peak_allocated``, so the allocation paths pay nothing for it."""
        rec = self.recorder
        if rec is not None:
            t = time.perf_counter()
            peak = self.peak_allocated
            if peak > self.sampled_peak:
                self.sampled_peak = peak
                if peak > self.allocated:
                    rec.memory_sample(self.device, t, peak, max(self.reserved, peak))
            rec.memory_sample(self.device, t, self.allocated, self.reserved)

    def stats(self) -> dict[str, int]:
        """A subset of torch.cuda.memory_stats() with the same key names."""
        out: dict[str, int] = {}
        for pool in ("all", "large_pool", "small_pool"):
            # The model keeps no small/large split: both report the totals under "all" and
            # zero elsewhere, so sums over pools stay right.
            scale = 1 if pool == "all" else 0
            out[f"allocated_bytes.{pool}.current"] = self.allocated * scale
            out[f"allocated_bytes.{pool}.peak"] = self.peak_allocated * scale
            out[f"reserved_bytes.{pool}.current"] = self.reserved * scale
            out[f"reserved_bytes.{pool}.peak"] = self.peak_reserved * scale
            out[f"active_bytes.{pool}.current"] = self.allocated * scale
            out[f"active_bytes.{pool}.peak"] = self.peak_allocated * scale
            out[f"allocation.{pool}.current"] = self.num_allocs * scale
            out[f"allocation.{pool}.allocated"] = self.num_alloc_calls * scale
            out[f"allocation.{pool}.freed"] = self.num_frees * scale
        out["num_alloc_retries"] = self.num_alloc_retries
        out["num_ooms"] = self.num_ooms
        return out

    def oom_message(self, size: int) -> str:
        free = max(self.total - self.reserved, 0)
        limit = ""
        if self.capacity < self.total:
            limit = f"this process is limited to {format_bytes(self.capacity)} (set_per_process_memory_fraction). "
        return (
            f"CUDA out of memory. Tried to allocate {format_bytes(size)}. GPU {self.device} has a total "
            f"capacity of {format_bytes(self.total)} of which {format_bytes(free)} is free. {limit}"
            f"Including non-PyTorch memory, this process has {format_bytes(self.reserved)} memory in use. "
            f"Of the allocated memory {format_bytes(self.allocated)} is allocated by PyTorch, and "
            f"{format_bytes(self.reserved - self.allocated)} is reserved by PyTorch but unallocated. "
            "If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
            "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables) "
            "(gpemu: emulated device)"
        )

    def __repr__(self) -> str:
        return (
            f"MemoryTracker(cuda:{self.device}, allocated={format_bytes(self.allocated)}, "
            f"reserved={format_bytes(self.reserved)}, peak={format_bytes(self.peak_allocated)}, "
            f"capacity={format_bytes(self.capacity)})"
        )


def install(rt: Runtime) -> None:
    """One tracker per emulated device (``rt.memory``), sized from the GPU spec
    (``rt.gpus[i].memory_bytes``)."""
    rt.memory = [MemoryTracker(i, int(spec.memory_bytes), rt.recorder) for i, spec in enumerate(rt.gpus)]

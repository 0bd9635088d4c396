"""Page-locked ("pinned") host memory for ``Tensor.pin_memory()`` on a CPU-only machine.

On a real GPU machine ``pin_memory()`` copies a batch into memory the CUDA host allocator
obtained with ``cudaHostAlloc``: page-locked, cached in power-of-two blocks, reused, and never
given back to the OS while the process lives. The GPEmu paper found that leaving this out
changes what a training loop does on the host (pageable batches are allocated and freed every
iteration, and Python's GC runs inside the loop): an AlexNet epoch was 20% slower than on the
real GPU until pinned memory was emulated. So this module gives ``pin_memory()`` the same kind
of memory for real: ``mmap`` + libc ``mlock`` blocks in a caching pool.

* :class:`PinnedHostPool` (one per process, :func:`host_pool`): power-of-two size classes
  like CUDA's ``CachingHostAllocator``; a block returns to the free list when the last tensor
  using it dies (a finalizer on the array that backs the tensor's storage); blocks are never
  unmapped. Where ``mlock`` is refused (an unprivileged user under ``RLIMIT_MEMLOCK``) the pool
  keeps working with unlocked memory and says so once, with the fix.
* :func:`install` (component ``gpemu.integrations.pinned_memory``) patches
  ``Tensor.pin_memory`` and ``Tensor.is_pinned`` through ``rt.patcher``. With
  ``config.pinned`` False, ``pin_memory()`` makes a plain pageable copy (for comparisons).

DataLoader(pin_memory=True) calls ``pin_memory()`` from its pin thread in the main process
(workers only produce batches), so the pool is shared by threads and guarded by a lock.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import resource
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.recorder import Recorder
    from gpemu.runtime import Runtime

__all__ = [
    "PinnedHostPool",
    "PinnedState",
    "PoolStats",
    "host_pool",
    "is_pinned",
    "pin",
    "locked_bytes",
    "install",
    "MLOCK_ADVICE",
]

PAGE_SIZE = mmap.PAGESIZE
_warned = False
_warning: str | None = None  # the one message said about locking, for later runs' notes
MLOCK_ADVICE = (
    "raise the locked-memory limit (`ulimit -l unlimited`, or a 'memlock' line in "
    "/etc/security/limits.conf, or LimitMEMLOCK=infinity for a systemd service), or give the "
    "process CAP_IPC_LOCK (e.g. `docker run --cap-add IPC_LOCK`)"
)


def _load_libc() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mlock.restype = ctypes.c_int
    return libc


_libc = _load_libc()


def size_class(nbytes: int) -> int:
    """The block size a request of ``nbytes`` gets: the next power of two, at least one page.

    Mirrors CUDA's host allocator, which rounds every request up to a power of two: a
    64x3x224x224 fp32 batch (36.75 MiB) takes a 64 MiB block.
    """
    if nbytes < 0:
        raise ValueError(f"pinned allocation size must be >= 0 bytes, got {nbytes}")
    size = max(nbytes, PAGE_SIZE)
    return 1 << (size - 1).bit_length()


class _Block:
    """One mmap'd region of a size class. Lives as long as the process."""

    __slots__ = ("size", "mapping", "address", "locked", "in_use")

    def __init__(self, size: int, mapping: mmap.mmap, address: int, locked: bool) -> None:
        self.size = size
        self.mapping = mapping
        self.address = address
        self.locked = locked
        self.in_use = False


@dataclass(frozen=True)
class PoolStats:
    """What the pinned pool holds. ``misses`` counts blocks obtained from the OS."""

    blocks: int  # blocks ever obtained (never returned)
    blocks_in_use: int  # blocks backing live tensors
    bytes_reserved: int  # sum of block sizes
    bytes_in_use: int  # sum of sizes of blocks backing live tensors
    bytes_locked: int  # bytes actually page-locked with mlock
    hits: int  # requests served from the free list
    misses: int  # requests that needed a new block
    lock_failures: int  # blocks mlock refused (memory stays usable, just not locked)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class PinnedHostPool:
    """Caching pool of page-locked host blocks, safe to use from several threads."""

    def __init__(self, lock_memory: bool = True, notify: Callable[[str], None] | None = None) -> None:
        self.lock_memory = lock_memory
        self._notify = notify
        self._lock = threading.Lock()
        self._free: dict[int, list[_Block]] = collections.defaultdict(list)
        self._blocks: list[_Block] = []
        self._starts: list[int] = []  # sorted block start addresses, for is_pinned lookups
        self._by_start: dict[int, _Block] = {}
        # Finalizers may run inside GC at any point, even while this thread holds _lock;
        # they only append here (atomic) and the pool drains the queue under its lock.
        self._released: collections.deque[_Block] = collections.deque()
        self._hits = 0
        self._misses = 0
        self._lock_failures = 0
        self._bytes_locked = 0
        self.warning: str | None = None
        key = id(self)
        _all_pools[key] = weakref.ref(self, lambda _ref: _all_pools.pop(key, None))

    # ------------------------------------------------------------------ allocation
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` on a pinned block; the block is reused once it dies."""
        size = size_class(nbytes)
        with self._lock:
            self._drain_released()
            free = self._free.get(size)
            if free:
                block = free.pop()
                self._hits += 1
            else:
                block = self._new_block(size)
                self._misses += 1
            block.in_use = True
        # numpy arrays accept weak references and torch.frombuffer keeps the array alive for
        # as long as any storage view uses it, so the finalizer fires when the last tensor dies.
        array = np.frombuffer(block.mapping, dtype=np.uint8, count=max(nbytes, 0))
        weakref.finalize(array, self._release, block)  # also keeps the pool alive meanwhile
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(array, dtype=torch.uint8)

    def _new_block(self, size: int) -> _Block:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # A ctypes view exports the buffer, which also keeps the mapping from ever being closed.
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        locked = False
        if self.lock_memory:
            if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) == 0:
                locked = True
                self._bytes_locked += size
            else:
                err = ctypes.get_errno()
                self._lock_failures += 1
                self._warn_unlocked(err, size)
        if not locked:
            # Fault every page in now, as mlock would have: first use then costs the same
            # whether or not locking was allowed.
            populate = getattr(mmap, "MADV_POPULATE_WRITE", None)
            try:
                if populate is None:
                    raise OSError
                mapping.madvise(populate)
            except OSError:
                for off in range(0, size, PAGE_SIZE):
                    mapping[off] = 0
        block = _Block(size, mapping, address, locked)
        self._blocks.append(block)
        bisect.insort(self._starts, address)
        self._by_start[address] = block
        _has_blocks[0] = True
        return block

    def _warn_unlocked(self, err: int, size: int) -> None:
        global _warned
        if _warned:  # once per process, however many pools and blocks fail
            return
        _warned = True
        try:
            limit = _memlock_limit_text()
        except Exception:  # pragma: no cover - informational only
            limit = "unknown"
        why = os.strerror(err) if err else "unknown error"
        warning = self.warning = (
            f"pinned memory: mlock of a {size / 2**20:.1f} MiB block failed ({errno.errorcode.get(err, err)}: {why}; "
            f"RLIMIT_MEMLOCK {limit}, uid {os.getuid()}). pin_memory() keeps working with "
            f"ordinary (unlocked) memory, so the host may page it out. To lock it: {MLOCK_ADVICE}."
        )
        global _warning
        _warning = warning
        notify = self._notify
        if notify is not None:
            notify(warning)
        else:
            print(f"[gpemu] {warning}", file=sys.stderr, flush=True)

    def _release(self, block: _Block) -> None:
        self._released.append(block)  # no lock: may run inside GC while this thread holds it

    def _drain_released(self) -> None:
        while self._released:
            block = self._released.popleft()
            block.in_use = False
            self._free[block.size].append(block)

    # ------------------------------------------------------------------ queries
    def owns(self, address: int) -> bool:
        """Whether ``address`` lies inside one of the pool's blocks."""
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return False
            block = self._by_start[self._starts[i]]
            return address < block.address + block.size

    def stats(self) -> PoolStats:
        with self._lock:
            self._drain_released()
            in_use = [b for b in self._blocks if b.in_use]
            return PoolStats(
                blocks=len(self._blocks),
                blocks_in_use=len(in_use),
                bytes_reserved=sum(b.size for b in self._blocks),
                bytes_in_use=sum(b.size for b in in_use),
                bytes_locked=self._bytes_locked,
                hits=self._hits,
                misses=self._misses,
                lock_failures=self._lock_failures,
            )

    def set_notify(self, notify: Callable[[str], None] | None) -> None:
        self._notify = notify

    def _after_fork_in_child(self) -> None:
        # A forked child (a DataLoader worker) inherits the mappings but not the locks
        # (mlock is not inherited), and may inherit _lock held by the parent's pin thread.
        self._lock = threading.Lock()
        self._bytes_locked = 0
        for block in self._blocks:
            block.locked = False


_pool: PinnedHostPool | None = None
# Every pool of this process, for is_pinned(): weak references, by the pool's id (a WeakSet's own
# iteration costs ~2 us, and is_pinned runs on every input copy).
_all_pools: dict[int, weakref.ref[PinnedHostPool]] = {}
# Whether any pool of this process ever mapped a block: until then no tensor can be pinned, and
# is_pinned (asked on every input copy) answers at once.
_has_blocks = [False]
_pool_lock = threading.Lock()


def host_pool() -> PinnedHostPool:
    """The process's pinned pool (created on first use, kept for the life of the process)."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = PinnedHostPool()
    return _pool


def _reset_pool_in_child() -> None:
    if _pool is not None:
        _pool._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_pool_in_child)


def _memlock_limit_text() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def fmt(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v // 1024} KiB"

    return f"soft {fmt(soft)} / hard {fmt(hard)}"


def locked_bytes() -> int:
    """This process's page-locked bytes as the kernel counts them (VmLck in /proc/self/status)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------- tensor level
def is_pinned(tensor: torch.Tensor) -> bool:
    """True exactly for CPU tensors whose storage lives in the pinned pool."""
    if not _has_blocks[0]:  # no pinned memory in this process (the common case without pin_memory)
        return False
    if tensor.device.type != "cpu":
        return False
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    if ptr == 0:
        return False
    for ref in tuple(_all_pools.values()):
        pool = ref()
        if pool is not None and pool.owns(ptr):
            return True
    return False


def pin(tensor: torch.Tensor, pool: PinnedHostPool | None = None) -> torch.Tensor:
    """A copy of CPU ``tensor`` on pinned memory (``tensor`` itself if already pinned).

    Dense tensors keep their strides (as ``pin_memory()`` does); others become contiguous.
    """
    if tensor.device.type != "cpu" or tensor.is_sparse:
        raise RuntimeError(
            f"cannot pin '{tensor.type()}' on device {tensor.device}: only dense CPU tensors can be pinned"
        )
    if is_pinned(tensor):
        return tensor
    pool = pool or host_pool()
    size = tuple(tensor.shape)
    if tensor.numel() == 0:
        return torch.empty(size, dtype=tensor.dtype)
    if _dense(tensor):
        stride = tuple(tensor.stride())
    else:
        stride = _contiguous_strides(size)
    raw = pool.allocate(tensor.numel() * tensor.element_size())
    out = raw.view(tensor.dtype).as_strided(size, stride)
    out.copy_(tensor)  # differentiable, like torch's pin_memory()
    return out


def _dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill exactly numel() slots in some order."""
    pairs = sorted((st, s) for s, st in zip(tensor.shape, tensor.stride(), strict=False) if s != 1)
    expected = 1
    for st, s in pairs:
        if st != expected:
            return False
        expected *= s
    return True


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


# ---------------------------------------------------------------------- component
@dataclass
class PinnedState:
    """The pinned-memory component of one run (``rt.pinned``). The pool itself is the process's
    (as CUDA's host allocator is: locked pages are kept for reuse across runs)."""

    pool: PinnedHostPool
    enabled: bool
    pins: int = 0  # pin_memory() calls this run
    pin_seconds: float = 0.0  # host time they took
    recorder: Recorder | None = None  # the run's (pinned bytes are counted there)
    # The DataLoader pin thread and the main thread both pin.
    _stats_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def pin_memory(self, tensor: torch.Tensor, device: str | torch.device | None = None) -> torch.Tensor:
        """``Tensor.pin_memory()`` of this run: a copy on the pinned pool (a plain pageable copy
        with ``config.pinned`` False, what an emulator without pinned memory does)."""
        if tensor.device.type != "cpu":
            # An emulated cuda tensor (or any non-CPU one): same message CUDA gives.
            raise RuntimeError(f"cannot pin '{tensor.type()}' only dense CPU tensors can be pinned")
        start = time.perf_counter()
        out = pin(tensor, self.pool) if self.enabled else tensor.clone()
        elapsed = time.perf_counter() - start
        with self._stats_lock:
            self.pins += 1
            self.pin_seconds += elapsed
        if self.recorder is not None:
            self.recorder.add("pin_bytes", tensor.numel() * tensor.element_size())
        return out

    def is_pinned(self, tensor: torch.Tensor, device: str | torch.device | None = None) -> bool:
        """``Tensor.is_pinned()``: whether the tensor's storage lives in the pinned pool."""
        return is_pinned(tensor)


def _tensor_method(ours: Callable[..., object], original: Callable[..., object]) -> Callable[..., object]:
    """A ``torch.Tensor`` method that runs ``ours`` (named and documented as torch's ``original``)."""

    @functools.wraps(original)
    def method(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        return ours(tensor, *args, **kwargs)

    return method


def install(rt: Runtime) -> None:
    """Patch ``Tensor.pin_memory``/``Tensor.is_pinned`` for this run (through ``rt.patcher``) and
    let the transfers component ask whether a host tensor is pinned."""
    pool = host_pool()
    pool.set_notify(rt.say_once)
    state = rt.pinned = PinnedState(pool, bool(rt.config.pinned), recorder=rt.recorder)
    if rt.transfers is not None:
        rt.transfers.is_pinned = is_pinned
    rt.patcher.on_restore(lambda: pool.set_notify(None))
    if _warning:
        rt.recorder.note(_warning)  # this process already failed to lock before this run
    T = torch.Tensor
    rt.patcher.replace(T, "pin_memory", _tensor_method(state.pin_memory, T.pin_memory))
    rt.patcher.replace(T, "is_pinned", _tensor_method(state.is_pinned, T.is_pinned))

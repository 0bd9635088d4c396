"""DataLoader workers on virtual time: a batch carries the virtual time it became ready.

Note: why the batches carry their time. On virtual time every process runs on its own clock
(its CPU time, :mod:`.cpuclock`), and the real order in which a worker delivers batches on a busy
host says nothing about when it would have delivered them with cores of its own. So the messages
between the program and its workers carry times, as in a distributed simulation:

- the program stamps each index it sends with its host time (the worker cannot start fetching
  before it was asked): :class:`IndexSender` on ``_MultiProcessingDataLoaderIter._index_queues``;
- a worker (:class:`WorkerLoop`, torch's ``_worker_loop`` with its queues wrapped) moves its clock
  to that time, fetches (its CPU time counts, and blocking file I/O at its real duration,
  :class:`~.cpuclock.BlockedTime`) and sends the batch as a :class:`ReadyBatch` with its time;
- the pin-memory thread adds the CPU time of pinning after the later of the batch's time and the
  end of its previous pin (:meth:`ReadyBatch.pin_memory`);
- the program's host time jumps to the batch's time when it is later (it had to wait for it),
  recorded as a host wait with reason ``"data"``.

A worker started by ``fork`` continues from the program's time at the fork; one started by
``spawn`` from the program's time when it was started (carried in the pickled target) plus its
own start-up CPU time. With ``num_workers=0`` the program's own fetch adds its blocking file I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .cpuclock import BlockedTime, CpuTimeClock, process_clock

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

    from ..runtime import Runtime

__all__ = ["ReadyBatch", "StampedIndex", "WorkerLoop", "IndexSender", "install"]


class StampedIndex:
    """An index message's payload with the program's host time when it was sent."""

    __slots__ = ("index", "at")

    def __init__(self, index: Any, at: float) -> None:
        self.index = index
        self.at = at

    def __reduce__(self) -> Any:
        return (StampedIndex, (self.index, self.at))


class _PinLane(threading.local):
    free_at = float("-inf")  # when this pin-memory thread finished its last batch (virtual)


_PIN = _PinLane()


class ReadyBatch:
    """A worker's batch and the virtual time it became ready (what travels to the program)."""

    __slots__ = ("data", "ready")

    def __init__(self, data: Any, ready: float) -> None:
        self.data = data
        self.ready = ready

    def __reduce__(self) -> Any:
        return (ReadyBatch, (self.data, self.ready))

    def pin_memory(self, device: Any = None) -> ReadyBatch:
        """torch's pin-memory thread calls this: pin the batch; it is ready when this thread has
        pinned it, one batch after the other."""
        from torch.utils.data._utils.pin_memory import pin_memory

        cpu = time.thread_time()
        data = pin_memory(self.data, device)
        start = self.ready if self.ready > _PIN.free_at else _PIN.free_at
        _PIN.free_at = start + (time.thread_time() - cpu)
        return ReadyBatch(data, _PIN.free_at)


def _plain_data(idx: Any, data: Any) -> bool:
    """A batch of a worker (not an acknowledgement, an exception or an end-of-data marker)."""
    from torch._utils import ExceptionWrapper
    from torch.utils.data._utils.worker import _IterableDatasetStopIteration

    return isinstance(idx, int) and not isinstance(data, (ExceptionWrapper, _IterableDatasetStopIteration))


class _Forward:
    """Forwards everything but the wrapped methods to the queue it wraps."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


class IndexSender(_Forward):
    """The program's end of one worker's index queue: stamps each index with the host time."""

    def __init__(self, queue: Any, host_now: Callable[[], float]) -> None:
        super().__init__(queue)
        self.host_now = host_now

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int):
            item = (item[0], StampedIndex(item[1], self.host_now()))
        self.queue.put(item, *args, **kwargs)


class _IndexReceiver(_Forward):
    """A worker's end of its index queue: its clock moves to the time it was asked."""

    def __init__(self, queue: Any, clock: CpuTimeClock, blocked: BlockedTime) -> None:
        super().__init__(queue)
        self.clock = clock
        self.blocked = blocked

    def get(self, *args: Any, **kwargs: Any) -> Any:
        item = self.queue.get(*args, **kwargs)
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], StampedIndex):
            self.clock.wait_until(item[1].at)
            item = (item[0], item[1].index)
        self.blocked.start()  # the fetch begins
        return item


class _BatchSender(_Forward):
    """A worker's end of the result queue: each batch leaves with the worker's time."""

    def __init__(self, queue: Any, clock: CpuTimeClock, blocked: BlockedTime) -> None:
        super().__init__(queue)
        self.clock = clock
        self.blocked = blocked

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(item, tuple) and len(item) == 2 and _plain_data(*item):
            self.clock.advance(self.blocked.seconds())  # blocking file I/O of the fetch
            item = (item[0], ReadyBatch(item[1], self.clock.now()))
        self.queue.put(item, *args, **kwargs)


class WorkerLoop:
    """torch's DataLoader worker loop with its queues on virtual time (see the module's
    docstring). ``start``: the program's host time when the worker was started (spawned workers;
    a forked one continues from the fork). Pickled (spawn) with the program's time then."""

    def __init__(
        self, original: Callable[..., None], host_now: Callable[[], float] | None, start: float | None
    ) -> None:
        self.original = original
        self.host_now = host_now
        self.start = start

    def __reduce__(self) -> Any:
        at = self.host_now() if self.host_now is not None else self.start
        return (_unpickle_worker_loop, (at,))

    def __call__(self, dataset_kind: Any, dataset: Any, index_queue: Any, data_queue: Any, *rest: Any) -> None:
        clock = process_clock()
        if self.start is not None:  # spawned: from the program's time at the start, plus our own
            clock.wait_until(self.start + time.process_time())
        blocked = BlockedTime()
        self.original(
            dataset_kind,
            dataset,
            _IndexReceiver(index_queue, clock, blocked),
            _BatchSender(data_queue, clock, blocked),
            *rest,
        )


def _unpickle_worker_loop(start: float | None) -> WorkerLoop:
    from torch.utils.data._utils import worker

    original = worker._worker_loop
    if isinstance(original, WorkerLoop):  # (this process is patched too)
        original = original.original
    return WorkerLoop(original, None, start)


def _patch_worker(rt: Runtime, module: ModuleType) -> None:
    host_now = rt.engine.now
    rt.patcher.replace(module, "_worker_loop", WorkerLoop(module._worker_loop, host_now, None))


def _patch_loader(rt: Runtime, clock: CpuTimeClock, module: ModuleType) -> None:
    """The program's side: stamped indices, arriving batches, blocking I/O of its own fetches."""
    engine = rt.engine
    multi = module._MultiProcessingDataLoaderIter
    single = module._SingleProcessDataLoaderIter
    reset, process_data, next_data = multi._reset, multi._process_data, single._next_data

    def _reset(self: Any, loader: Any, first_iter: bool = False) -> None:
        self._index_queues = [
            q if isinstance(q, IndexSender) else IndexSender(q, engine.now) for q in self._index_queues
        ]
        reset(self, loader, first_iter)

    def _process_data(self: Any, data: Any, worker_idx: int) -> Any:
        if isinstance(data, ReadyBatch):
            engine.arrive(data.ready, "data")
            data = data.data
        return process_data(self, data, worker_idx)

    def _next_data(self: Any) -> Any:
        blocked = BlockedTime()
        data = next_data(self)
        clock.advance(blocked.seconds())
        return data

    rt.patcher.replace(multi, "_reset", _reset)
    rt.patcher.replace(multi, "_process_data", _process_data)
    rt.patcher.replace(single, "_next_data", _next_data)


def install(rt: Runtime, clock: CpuTimeClock) -> None:
    """DataLoader workers, the pin-memory thread and the program's fetches on virtual time."""
    rt.patcher.after_import("torch.utils.data._utils.worker", lambda m: _patch_worker(rt, m))
    rt.patcher.after_import("torch.utils.data.dataloader", lambda m: _patch_loader(rt, clock, m))

"""CUDA graphs on emulated GPUs (component ``gpemu.graphs``): ``torch.cuda.CUDAGraph``, graph
memory pools, capture and replay.

torch's own ``torch.cuda.graph`` context manager and ``torch.cuda.make_graphed_callables`` are
Python over a few pieces of its C extension that the CPU build lacks (``_CUDAGraph``,
``_graph_pool_handle``, ``_host_emptyCache``); this module stands in for those, so torch's Python
runs unchanged:

* **capture** (:meth:`EmuCUDAGraph.capture_begin` ... :meth:`EmuCUDAGraph.capture_end`): the
  region's ops run as emulated ops, but the GPU work enqueued on the capturing stream is recorded
  instead of charged (:meth:`gpemu.time.TimeEngine.begin_capture`), sync points fail as CUDA makes
  them fail, and the device's allocations come from the graph's private pool
  (:class:`gpemu.memory.PrivatePool`): the tensors made inside are the graph's static tensors;
* **replay**: the recorded kernels are charged as one launch: issued together at the host time of
  ``replay()``, they run back to back with no per-kernel launch gaps; nothing is allocated, the
  static outputs are simply overwritten (their values are placeholders either way). A captured
  backward pass and optimizer step count at each replay, so a captured training step is still
  one iteration;
* **memory**: the pool keeps what the capture used at its highest, reserved, until every graph
  using it is reset or deleted.
"""

from __future__ import annotations

import itertools
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .memory import PrivatePool
from .time import BACKWARD_MARK, CAPTURE_INVALIDATED, ITERATION_END, CapturedWork

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime
    from .time import VirtualStream

__all__ = ["install", "GraphState", "EmuCUDAGraph", "PoolHandle"]

PoolHandle = tuple[int, int]  # torch's MempoolId_t: (graph id, 0) for a graph's own pool, (0, n) for a handle


class GraphState:
    """The CUDA graphs of one run (``rt.graphs``): private pools by handle and device, and the
    replay of recorded work."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.pools: dict[tuple[PoolHandle, int], PrivatePool] = {}
        self._ids = itertools.count(1)  # graph ids and pool handles, as CUDA's are: unique per process
        self.graph_class = type("CUDAGraph", (EmuCUDAGraph,), {"state": self, "__module__": "torch.cuda"})

    def new_id(self) -> int:
        return next(self._ids)

    def graph_pool_handle(self) -> PoolHandle:
        """``torch.cuda.graph_pool_handle()``: a new pool that graphs may share."""
        return (0, self.new_id())

    def host_empty_cache(self) -> None:
        """``torch._C._host_emptyCache`` (``torch.cuda.graph`` calls it): the emulated pinned
        pool keeps its pages, as ``torch.accelerator.memory.empty_host_cache`` does here."""

    def use_pool(self, handle: PoolHandle, device: int) -> PrivatePool:
        """The pool ``handle`` names on ``device`` (made on first use), with one more graph using it."""
        key = (handle, device)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = PrivatePool(self.rt.memory[device])
        pool.users += 1
        return pool

    def drop_pool(self, handle: PoolHandle, device: int, pool: PrivatePool) -> None:
        """A graph stops using ``pool``; the last one gives its free memory back."""
        pool.users -= 1
        if pool.users <= 0:
            pool.release()
            if self.pools.get((handle, device)) is pool:
                del self.pools[(handle, device)]

    def replay(self, work: tuple[CapturedWork, ...], device: int) -> None:
        """Charge recorded work on ``device``'s current stream as one launch (one emulator entry:
        every kernel is issued at the same host time, so they run back to back)."""
        engine = self.rt.engine
        engine.charge_host(engine.launch_seconds(1))  # (cudaGraphLaunch: one launch's host time)
        engine.call(self._launch, work, device)

    def _launch(self, work: tuple[CapturedWork, ...], device: int) -> None:
        engine, ts = self.rt.engine, self.rt.tensors
        for item in work:
            if item.kind == BACKWARD_MARK:
                engine.note_backward(device)
            elif item.kind == ITERATION_END:
                engine.end_iteration(device)
            else:
                # (a graph replayed inside a module that is charged as a whole is covered by it)
                ts.charge_span(item.seconds, device, item.kind, item.name)


class EmuCUDAGraph:
    """``torch.cuda.CUDAGraph`` on an emulated GPU (each run binds a subclass to its
    :class:`GraphState`). The methods are torch's, with torch's errors."""

    state: GraphState

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = bool(keep_graph)
        self.graph_id = self.state.new_id()
        self._work: tuple[CapturedWork, ...] | None = None  # a successful capture's work
        self._instantiated = False
        self._stream: VirtualStream | None = None  # while capturing
        self._device = 0
        self._handle: PoolHandle | None = None
        self._pool: PrivatePool | None = None
        self._debug = False

    # ------------------------------------------------------------------ capture
    def capture_begin(
        self, pool: PoolHandle | None = None, capture_error_mode: str = "global", check_input_liveness: bool = False
    ) -> None:
        """Begin capturing the current stream's work into this graph (``torch.cuda.graph`` calls it)."""
        if self._work is not None or self._stream is not None:
            raise RuntimeError(
                "This CUDAGraph instance already owns a captured graph. To capture a new graph, create a new instance."
            )
        handle = _check_handle(pool) if pool is not None else (self.graph_id, 0)
        rt = self.state.rt
        device = rt.current_device
        tracker = rt.memory[device]
        if tracker.pool is not None:
            raise RuntimeError(f"gpemu: another CUDA graph is being captured on cuda:{device}; capture one at a time")
        stream = rt.engine.stream(device)
        rt.engine.begin_capture(stream, capture_error_mode)  # (refuses the default stream, bad modes)
        if check_input_liveness:
            rt.say_once("CUDA graph input liveness is not checked on emulated GPUs (check_input_liveness ignored)")
        self._stream, self._device, self._handle = stream, device, handle
        self._pool = tracker.pool = self.state.use_pool(handle, device)

    def capture_end(self) -> None:
        """End the capture: the graph holds what the stream recorded (torch's errors when the
        capture was invalidated by a refused call)."""
        stream = self._stream
        if stream is None:
            raise RuntimeError("Called CUDAGraph::capture_end without a preceding capture_begin")
        rt = self.state.rt
        capture = rt.engine.end_capture(stream)
        rt.memory[self._device].pool = None
        self._stream = None
        if capture.invalid is not None:
            self._drop_pool()
            raise RuntimeError(CAPTURE_INVALIDATED)
        self._work = tuple(capture.work)
        if not any(w.seconds > 0 for w in self._work):
            warnings.warn(
                "The CUDA Graph is empty. This usually means that the graph was attempted to be captured "
                "on wrong device or stream.",
                UserWarning,
                stacklevel=2,
            )
        if not self.keep_graph:
            self._instantiated = True

    def instantiate(self) -> None:
        if self._work is None:
            raise RuntimeError("Called CUDAGraph::instantiate without a preceding successful capture.")
        self._instantiated = True

    # ------------------------------------------------------------------ replay and release
    def replay(self) -> None:
        """Charge the captured work as one launch on the current stream."""
        if self._work is None:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        self._instantiated = True
        self.state.replay(self._work, self._device)

    def reset(self) -> None:
        """Delete the captured graph; its pool's memory is released once no graph uses it."""
        if self._stream is not None:
            raise RuntimeError("Called CUDAGraph::reset while the graph is being captured")
        self._work = None
        self._instantiated = False
        self._drop_pool()

    def pool(self) -> PoolHandle:
        """The id of this graph's memory pool (another capture may share it)."""
        if self._handle is None:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self._handle

    def _drop_pool(self) -> None:
        pool, handle = self._pool, self._handle
        self._pool = None
        if pool is not None and handle is not None:
            self.state.drop_pool(handle, self._device, pool)

    def __del__(self) -> None:
        try:
            if self._stream is None:
                self._drop_pool()
        except Exception:  # interpreter shutdown
            pass

    # ------------------------------------------------------------------ debugging surface
    def enable_debug_mode(self) -> None:
        self._debug = True

    def debug_dump(self, debug_path: str) -> None:
        """Writes the recorded kernels (one line each: seconds, kind, name): an emulated graph has no
        CUDA graph to dump."""
        if not self._debug:
            raise RuntimeError("CUDA Graphs debug not enabled, set with [graph].enable_debug_mode()")
        with open(debug_path, "w") as out:
            for w in self._work or ():
                out.write(f"{w.seconds:.9f}\t{w.kind}\t{w.name}\n")

    def raw_cuda_graph(self) -> int:
        raise RuntimeError("gpemu: an emulated CUDA graph has no cudaGraph_t (raw_cuda_graph)")

    def raw_cuda_graph_exec(self) -> int:
        raise RuntimeError("gpemu: an emulated CUDA graph has no cudaGraphExec_t (raw_cuda_graph_exec)")

    def get_graph_data(self) -> dict:
        raise RuntimeError("gpemu: an emulated CUDA graph has no CUDA graph topology (get_graph_data)")

    @property
    def captured_seconds(self) -> float:
        """The GPU time of one replay (0 before a capture)."""
        return sum(w.seconds for w in self._work or ())


def _check_handle(pool: Any) -> PoolHandle:
    if isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in pool):
        return (int(pool[0]), int(pool[1]))
    raise TypeError(
        f"pool must be a handle from torch.cuda.graph_pool_handle() or another graph's pool(), got {pool!r}"
    )


def install(rt: Runtime) -> None:
    """The run's graphs (``rt.graphs``); ``torch.cuda.CUDAGraph``, ``graph_pool_handle`` and the
    C pieces torch's ``torch.cuda.graph`` uses, through ``rt.patcher``."""
    import torch.cuda.graphs as graphs

    state = rt.graphs = GraphState(rt)
    p = rt.patcher
    p.replace_everywhere_many(
        [
            (graphs.CUDAGraph, state.graph_class),
            (graphs.graph_pool_handle, state.graph_pool_handle),
            (graphs._graph_pool_handle, state.graph_pool_handle),
            (graphs._cuda_isCurrentStreamCapturing, rt.cuda.is_current_stream_capturing),
        ]
    )
    p.replace(torch._C, "_host_emptyCache", state.host_empty_cache)
    # torch.cuda.graph keeps the capture stream it made first for the whole process: a stream of
    # this run's engine is made on the first capture.
    p.replace(graphs.graph, "default_capture_stream", None)

"""DDP's gradient reducer, emulated: the bucketed all-reduce of every synchronising backward.

Stands for DDP's C++ ``dist.Reducer`` over emulated parameters (see :class:`EmulatedReducer`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..costmodel.comm import Collective, CommPath, collective_cost, gradient_buckets, overlapped_all_reduce_end
from ..runtime import current
from .meeting import lockstep, tensor_bytes
from .run_parts import RunParts

if TYPE_CHECKING:  # pragma: no cover
    from ..time import VirtualStream

__all__ = ["EmulatedReducer", "GradientBucket", "MeasuredComm"]

# The exposed all-reduce seconds a DDP measured for (device, world size), or None; looked up
# through a weak reference (the reducer must not keep its DDP alive).
MeasuredComm = Callable[[], Callable[[int, int], float | None] | None]


class GradientBucket:
    """What ``EmulatedReducer._get_zeros_like_grad_buckets`` hands out (a joined rank mirrors one
    gradient synchronisation per bucket)."""

    def __init__(self, index: int, nbytes: int) -> None:
        self._index = index
        self.nbytes = nbytes

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True


class EmulatedReducer:
    """Stands for DDP's C++ ``dist.Reducer`` over emulated parameters: what torch's DDP Python
    code and libraries call on it (``prepare_for_forward/backward``, ``_rebuild_buckets``,
    ``_delay_all_reduce``, join's ``_get_zeros_like_grad_buckets``/``_run_comm_hook``, ...).

    A backward pass after ``prepare_for_backward`` synchronises: when the first gradient is
    ready the backward's GPU start is noted; when the pass ends, the bucketed all-reduce is
    charged as a ``comm`` span (only the part that outlasts the backward, buckets starting as
    their gradients are ready) and the ranks meet once. The flat gradient buckets are allocated
    on the GPU (a second copy of the gradients unless ``gradient_as_bucket_view``)."""

    def __init__(
        self,
        parts: RunParts,
        process_group: ProcessGroup,
        params: list[torch.Tensor],
        bucket_cap: int,
        find_unused: bool,
        as_view: bool,
        measured_comm: MeasuredComm,
    ) -> None:
        rt = parts.rt
        self.parts = parts
        self.rt = rt
        self.measured_comm = measured_comm
        self.process_group = process_group
        self.params = params
        self.world = dist.get_world_size(self.process_group)
        self.bucket_cap = bucket_cap
        self.find_unused = find_unused
        self.as_view = as_view
        self.static_graph = False
        # Gradients become ready roughly in reverse registration order; DDP buckets them so.
        self.bucket_bytes = gradient_buckets([tensor_bytes(p) for p in reversed(params)], bucket_cap)
        self.grad_bytes = sum(self.bucket_bytes)
        first = params[0] if params else None
        self.device = (first.device.index or 0) if first is not None and first.device.type == "cuda" else None
        self.expect_sync = False
        self.iterations = 0
        self.comm_seconds = 0.0
        self.last_comm_seconds = 0.0
        self.logger: Any = None
        self._queued = False
        self._backward_start: float | None = None
        self._lock = threading.Lock()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self.memory = None
        if rt.memory and self.device is not None and not as_view:
            self.memory = rt.memory[self.device].allocate(self.grad_bytes)

    # -- what torch's DDP and libraries call --------------------------------------------------
    def prepare_for_forward(self) -> None:
        pass

    def prepare_for_backward(self, outputs: Any = ()) -> None:
        self.expect_sync = True

    def _rebuild_buckets(self) -> bool:
        return False

    def _push_all_rebuilt_params(self) -> None:
        pass

    def _set_forward_pass_work_handle(self, work: Any, divide_by_initial_world_size: bool) -> None:
        pass

    def _delay_all_reduce(self) -> None:
        pass  # static graph's first iteration: the emulated all-reduce runs at the end anyway

    def _set_static_graph(self) -> None:
        self.static_graph = True

    def _ddp_graph_static(self) -> bool:
        return True

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        pass

    def _set_mixed_precision_param_dtype(self, dtype: torch.dtype) -> None:
        pass

    def _set_sparse_metadata(self, global_unique_ids: Any) -> None:
        pass

    def _install_post_backward_futures(self, futures: Any) -> None:
        for fut in futures or ():
            if hasattr(fut, "wait"):
                fut.wait()

    def _set_optimizer_in_backward(self) -> None:
        pass

    def _set_grads_to_none(self, params: Any = None) -> None:
        pass

    def _check_reducer_finalized(self) -> None:
        if self._queued:
            raise RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")

    def _reset_state(self) -> None:
        self.expect_sync = False

    def _update_process_group(self, group: ProcessGroup) -> None:
        self.process_group = group
        self.world = dist.get_world_size(group)

    def _remove_autograd_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _get_local_used_map(self) -> torch.Tensor:
        return torch.ones(len(self.params), dtype=torch.int32)

    def _get_zeros_like_grad_buckets(self) -> list[GradientBucket]:
        # One synchronisation per backward (see _finish_backward): one bucket to mirror.
        return [GradientBucket(0, self.grad_bytes)]

    def _run_comm_hook(self, bucket: Any) -> torch.futures.Future:
        """A joined rank (``DistributedDataParallel.join``) mirrors the gradient synchronisation of
        the ranks still training: it meets them once, with zero gradients."""
        stream = self._stream()
        finish = 0.0
        if stream is not None:
            finish = (
                max(stream.busy_until, self.parts.engine.now())
                + collective_cost(Collective.ALL_REDUCE, self.grad_bytes, self._path()).seconds
            )
        lockstep(self.process_group, finish)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([torch.zeros(0)])
        return fut

    def _run_allreduce_hook(self, bucket: Any) -> torch.futures.Future:
        return self._run_comm_hook(bucket)

    def get_backward_stats(self) -> list[int]:
        return []

    def set_logger(self, logger: Any) -> None:
        self.logger = logger

    # -- the emulated synchronisation -----------------------------------------------------------
    def _path(self) -> CommPath:
        """What the process group's ranks have between them (the gradients' all-reduce crosses it)."""
        return self.parts.placement.path(self.process_group)

    def _stream(self) -> VirtualStream | None:
        return None if self.device is None else self.parts.engine.stream(self.device)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.expect_sync:
            return
        with self._lock:
            if self._queued:
                return
            self._queued = True
            stream = self._stream()
            # The first gradient is ready: GPU time of the backward pass started about now.
            self._backward_start = stream.busy_until if stream is not None else None
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of a synchronising backward: charge the (exposed) all-reduce, meet the peers."""
        with self._lock:
            self._queued = False
            self.expect_sync = False
        rt = self.rt
        if current() is not rt:  # gpemu was unpatched while this reducer lived on
            return
        self.iterations += 1
        rt.recorder.add("ddp_gradient_syncs", 1.0)
        stream = self._stream()
        if stream is None or self.device is None:
            lockstep(self.process_group, 0.0)
            return
        backward_end = max(stream.busy_until, self.parts.engine.now())
        backward_start = self._backward_start if self._backward_start is not None else backward_end
        backward_start = min(backward_start, backward_end)
        measured = self.measured_comm()
        exposed_by_measure = measured(self.device, self.world) if measured is not None else None
        path = self._path()
        if exposed_by_measure is not None:
            own = backward_end + exposed_by_measure
        else:
            own = overlapped_all_reduce_end(
                backward_start, backward_end, self.bucket_bytes, self.world, path, self.parts.placement.overlap_k
            )
        # Ranks wait for the slowest one: the all-reduce ends when the last rank's ends. (Issued
        # when the backward ended: the message's own host time is the emulator's.)
        finish = lockstep(self.process_group, own)
        self._record(path, finish - own)
        exposed = max(0.0, finish - max(stream.busy_until, backward_end))
        self.last_comm_seconds = exposed
        self.comm_seconds += exposed
        if exposed > 0:
            name = f"DDP gradient all-reduce ({collective_cost(Collective.ALL_REDUCE, 1, path).links})"
            stream.enqueue(exposed, "comm", name, 0, backward_end)

    def _record(self, path: CommPath, waited: float) -> None:
        """Counters for the summary: the buckets' all-reduce time alone (overlapped or not), per
        link, and the time spent waiting for slower ranks."""
        costs = [collective_cost(Collective.ALL_REDUCE, size, path) for size in self.bucket_bytes]
        key = f"all_reduce/{costs[0].links}" if costs else "all_reduce/-"
        self.rt.recorder.add_many(
            ("ddp_allreduce_bytes", float(self.grad_bytes)),
            (f"comm_seconds/{key}", sum(c.seconds for c in costs)),
            (f"comm_bytes/{key}", float(self.grad_bytes)),
            (f"comm_count/{key}", float(len(costs))),
            ("comm_wait_seconds", max(0.0, waited)),
        )

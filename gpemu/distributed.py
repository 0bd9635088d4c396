"""torch.distributed on emulated GPUs (component ``gpemu.distributed``).

* ``init_process_group('nccl')`` and ``new_group(backend='nccl')`` use gloo instead (also inside
  ``'cuda:nccl,cpu:gloo'`` strings): NCCL does not exist on the CPU build, gloo works between
  local processes, so ranks really rendezvous and really exchange small messages. The C layer's
  accelerator (``torch._C._get_accelerator``, which torch.distributed asks for its default
  device: FSDP2's mesh, ``barrier``) is the emulated CUDA.
* **Collectives on emulated tensors** (c10d's ``all_reduce``, ``broadcast``, ``reduce``,
  ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``reduce_scatter``,
  ``scatter``, ``gather``, ``all_to_all(_single)``, and torch's functional collectives
  ``torch.ops._c10d_functional.*`` that DTensor and FSDP2 use, which reach the emulated tensor's
  dispatch as ops) are charged on the device's current stream by a ring model over the GPU
  interconnect, and the ranks meet in ONE small real gloo message per collective: the latest
  finish time (a collective ends when the last rank's ends) and whether every rank knows the
  values. Only then, and only for known values (:mod:`gpemu.hostvalues`), a second message
  carries them, so ``dist.all_reduce(torch.tensor([correct, seen], device='cuda'))`` is exact
  and an unknown tensor of any size costs one 16-byte message.
* ``DistributedDataParallel`` builds an :class:`EmulatedDDP`: a subclass that runs torch's own
  DDP Python code (constructor, ``forward`` with its input moves and buffer syncs, ``join``,
  ``no_sync``, static graph, logging data) over emulated stand-ins for the C++ parts it cannot
  use with meta-backed tensors: the reducer (:class:`EmulatedReducer`: at the end of every
  synchronising backward it charges the bucketed gradient all-reduce, overlapped with the
  backward pass, and the ranks meet once), the logger (:class:`EmulatedLogger`), and the
  coalesced broadcast / parameter check of construction.
* ``DTensor`` over emulated local tensors reports their device (its C-level wrapper says
  ``meta``), so FSDP2 (``fully_shard``) and tensor parallelism see CUDA parameters.
* ``nn.DataParallel`` scatters, broadcasts, gathers and reduces by copies between emulated
  devices; the replicas' identical work is charged on every device without running each replica
  op by op on the host (see :func:`_install_data_parallel`).

Ring times (estimated): all-reduce ``2 (n-1)/n * bytes / bw + 2 (n-1) * latency``; all-gather,
reduce-scatter and broadcast half of that (of the full tensor's bytes); all-to-all
``(n-1)/n * bytes / bw + (n-1) * latency``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.util
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import distributed_c10d as _c10d
from torch.nn.parallel import DistributedDataParallel as _TorchDDP
from torch.utils._pytree import tree_flatten, tree_unflatten

from .costmodel.gpus import find_gpu
from .device import EmuTensor, from_meta, host_shadow, peer_copy, set_host_shadow
from .hostvalues import SHADOW_MAX_ELEMENTS
from .runtime import current

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = [
    "install",
    "EmulatedDDP",
    "EmulatedReducer",
    "EmulatedLogger",
    "map_backend",
    "allreduce_seconds",
    "allgather_seconds",
    "reduce_scatter_seconds",
    "broadcast_seconds",
    "all_to_all_seconds",
    "interconnect_bandwidth",
]

# NCCL's all-reduce bus bandwidth within a node reaches about 80% of the NVLink bandwidth per
# direction (the datasheet's total / 2): nccl-tests on DGX A100 ~230 of 300 GB/s, on H100 SXM
# ~360-370 of 450 GB/s.
_NCCL_NVLINK_FRACTION = 0.8
# For a GPU whose datasheet NVLink figure is unknown (a database row without it): by the name's
# form factor.
_NVLINK_BUS_BANDWIDTH = (("SXM4", 230e9), ("SXM5", 360e9), ("SXM2", 130e9))
_RING_STEP_LATENCY = 8e-6  # seconds per ring step (NCCL's small-message latency within a node)
_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024

# The unpatched c10d functions (this module is imported before install patches them).
_ORIG = {
    name: getattr(_c10d, name)
    for name in (
        "init_process_group",
        "new_group",
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_single",
        "all_gather_into_tensor",
        "_all_gather_base",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "reduce_scatter",
        "scatter",
        "gather",
        "all_to_all_single",
        "all_to_all",
        "barrier",
        "isend",
        "irecv",
        "send",
        "recv",
    )
    if hasattr(_c10d, name)
}
# The single-tensor all-gather and reduce-scatter every other name calls (``all_gather_single``
# since torch 2.13; ``all_gather_into_tensor`` calls it). Host tensors go to these, never to a
# name that would call back into a patched one.
_ALL_GATHER = _ORIG.get("all_gather_single") or _ORIG["all_gather_into_tensor"]
_REDUCE_SCATTER = _ORIG.get("reduce_scatter_single") or _ORIG["reduce_scatter_tensor"]
_MAX = dist.ReduceOp.MAX


# --------------------------------------------------------------------------------------------
# backends, bandwidth, the ring model
# --------------------------------------------------------------------------------------------
def map_backend(backend: Any) -> Any:
    """'nccl' -> 'gloo', 'cuda:nccl,cpu:gloo' -> 'cuda:gloo,cpu:gloo'; other names unchanged."""
    if backend is None:
        return None
    text = str(backend)
    if ":" not in text:
        return "gloo" if text.lower() == "nccl" else backend
    parts = []
    for item in text.split(","):
        device, _, name = item.partition(":")
        parts.append(f"{device.strip()}:{'gloo' if name.strip().lower() == 'nccl' else name.strip()}")
    return ",".join(parts)


def interconnect_bandwidth(spec: Any) -> float:
    """Bus bandwidth of the GPU-to-GPU path of this GPU model (bytes/s): NVLink where it joins
    every GPU of a node (SXM boards), else PCIe at the host link's pinned rate. A bridge joins
    two cards only (H100 PCIe, Quadro RTX 6000): a ring over more GPUs crosses PCIe, so PCIe."""
    own = getattr(spec, "interconnect_bandwidth", None)
    if own:
        return float(own)
    pcie = float(getattr(spec, "host_link_bandwidth_pinned", 12e9) or 12e9)
    nvlink = getattr(spec, "nvlink_bandwidth", None)
    if nvlink is None:
        name = str(getattr(spec, "name", "")).upper()
        return next((bw for fragment, bw in _NVLINK_BUS_BANDWIDTH if fragment in name), pcie)
    sheet = find_gpu(str(getattr(spec, "name", "")))
    if not nvlink or (sheet is not None and sheet.nvlink_bridge):
        return pcie
    return max(_NCCL_NVLINK_FRACTION * float(nvlink) / 2, pcie)


def allreduce_seconds(nbytes: int, world_size: int, bus_bandwidth: float) -> float:
    """Ring all-reduce time of ``nbytes`` among ``world_size`` GPUs."""
    if world_size <= 1 or nbytes <= 0:
        return 0.0
    n = world_size
    return 2 * (n - 1) / n * nbytes / bus_bandwidth + 2 * (n - 1) * _RING_STEP_LATENCY


def allgather_seconds(total_bytes: int, world_size: int, bus_bandwidth: float) -> float:
    """Ring all-gather time; ``total_bytes``: the gathered (output) tensor's size."""
    return allreduce_seconds(total_bytes, world_size, bus_bandwidth) / 2


def reduce_scatter_seconds(total_bytes: int, world_size: int, bus_bandwidth: float) -> float:
    """Ring reduce-scatter time; ``total_bytes``: the full (input) tensor's size."""
    return allreduce_seconds(total_bytes, world_size, bus_bandwidth) / 2


def broadcast_seconds(nbytes: int, world_size: int, bus_bandwidth: float) -> float:
    """Pipelined ring broadcast time of ``nbytes``."""
    return allreduce_seconds(nbytes, world_size, bus_bandwidth) / 2


def all_to_all_seconds(nbytes: int, world_size: int, bus_bandwidth: float) -> float:
    """All-to-all time; ``nbytes``: what one rank sends in all (a share (n-1)/n leaves the GPU)."""
    return allreduce_seconds(nbytes, world_size, bus_bandwidth) / 2


def _is_emulated(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------
# ranks meet: time and known values
# --------------------------------------------------------------------------------------------
def _meet(group: Any, finish: float, knows: bool = True) -> tuple[float, bool, Any]:
    """One real gloo all-reduce (MAX) of a 16-byte host tensor among the group's ranks: returns
    the latest finish time, whether every rank knows its values, and the (completed) work."""
    t = torch.tensor([finish, 0.0 if knows else 1.0], dtype=torch.float64)
    work = _ORIG["all_reduce"](t, op=_MAX, group=group, async_op=True)
    work.wait()
    return float(t[0]), t[1].item() == 0.0, work


def _lockstep(group: Any, value: float) -> float:
    """The group's latest ``value`` (one real gloo message): ranks wait for the slowest."""
    return _meet(group, value)[0]


def _knows(t: Any) -> bool:
    # (complex values would need two reals per element on the wire: left unknown)
    return (
        isinstance(t, EmuTensor)
        and t.numel() <= SHADOW_MAX_ELEMENTS
        and not t.dtype.is_complex
        and host_shadow(t) is not None
    )


def _proxy_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if (t.dtype.is_floating_point or t.dtype.is_complex) else torch.int64


def _proxy(t: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
    """A flat host stand-in of ``t`` for gloo: its known values (zeros where this rank has none),
    as float64 or int64 (gloo reduces both; they hold every value a host shadow may have)."""
    if value is None:
        value = host_shadow(t) if isinstance(t, EmuTensor) else (t if t.device.type == "cpu" else None)
    dtype = _proxy_dtype(t)
    if value is None:
        return torch.zeros(t.numel(), dtype=dtype)
    return value.detach().reshape(-1).to(dtype).clone()


def _store(t: Any, value: torch.Tensor | None) -> None:
    """Give ``t`` (emulated or host) the value a collective left in it (None: unknown)."""
    if isinstance(t, EmuTensor):
        set_host_shadow(t, None if value is None else value.reshape(t.shape))
    elif isinstance(t, torch.Tensor) and value is not None and t.numel() == value.numel():
        with torch.no_grad():
            t.copy_(value.reshape(t.shape))


def _values_op(op: Any) -> tuple[Any, bool]:
    """(the reduce op gloo runs on the values, divide by world size after) for a c10d op;
    (None, False) for ops whose values are not reproduced (PREMUL_SUM's factor is opaque)."""
    if op is None or op == dist.ReduceOp.SUM:
        return dist.ReduceOp.SUM, False
    if op == dist.ReduceOp.AVG:
        return dist.ReduceOp.SUM, True
    for name in ("MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"):
        if op == getattr(dist.ReduceOp, name):
            return op, False
    return None, False


_FUNCOL_OPS = {
    "sum": ("SUM", False),
    "avg": ("SUM", True),
    "max": ("MAX", False),
    "min": ("MIN", False),
    "product": ("PRODUCT", False),
    "band": ("BAND", False),
    "bor": ("BOR", False),
    "bxor": ("BXOR", False),
}


def _outside(group: Any) -> bool:
    """This rank is not a member of ``group``: c10d's collectives do nothing here (as torch's)."""
    return group is not None and _c10d._rank_not_in_group(group)


def _group_rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()


class _Comms:
    """Charging emulated collectives of one run (closed over by the patched functions)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def bandwidth(self, dev: int) -> float:
        return interconnect_bandwidth(self.rt.gpus[dev])

    def run(self, dev: int, seconds: float, name: str, group: Any, knows: bool) -> tuple[bool, Any]:
        """Charge ``seconds`` of communication on ``dev``'s current stream, ending when the last
        rank's ends; returns (every rank knows the values, the meeting's work)."""
        engine = self.rt.engine
        stream = engine.stream(dev)
        start = max(stream.busy_until, engine.now())
        finish, everyone, work = _meet(group, start + seconds, knows)
        # Issued at ``start``: the host time the message itself took is the emulator's (NCCL
        # would have returned to the program at once), waiting for a later rank is the GPU's.
        if finish > start:
            stream.enqueue(finish - start, "comm", name, 0, start)
        self.rt.recorder.add_many(("comm_collectives", 1.0), ("comm_messages", 1.0))
        return everyone, work

    def values(self) -> None:
        self.rt.recorder.add("comm_messages", 1.0)


# --------------------------------------------------------------------------------------------
# emulated DistributedDataParallel
# --------------------------------------------------------------------------------------------
class _Bucket:
    """What ``EmulatedReducer._get_zeros_like_grad_buckets`` hands out (a joined rank mirrors one
    gradient synchronisation per bucket)."""

    def __init__(self, index: int, nbytes: int) -> None:
        self._index = index
        self.nbytes = nbytes

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True


class _LoggingData:
    """``dist.Logger._get_ddp_logging_data()``'s result: two maps of strings and ints."""

    def __init__(self, strs_map: dict[str, str], ints_map: dict[str, int]) -> None:
        self.strs_map = strs_map
        self.ints_map = ints_map


class EmulatedLogger:
    """Stands for DDP's C++ ``dist.Logger``: construction data, runtime statistics (iteration,
    communication time of the emulated timeline in ns), errors; ``_get_ddp_logging_data`` keys as
    the real one's."""

    def __init__(self, reducer: EmulatedReducer) -> None:
        self.reducer = reducer
        self.strs: dict[str, str] = {}
        self.ints: dict[str, int] = {}

    def set_construction_data_and_log(
        self,
        module_name: str,
        device_ids: Any,
        output_device: int,
        broadcast_buffers: bool,
        has_sync_bn: bool = False,
        static_graph: bool = False,
    ) -> None:
        r = self.reducer
        self.strs.update(
            module_name=module_name,
            device_ids=", ".join(str(d) for d in device_ids),
            backend_name=str(dist.get_backend(r.process_group)),
            dtypes=", ".join(sorted({str(p.dtype).replace("torch.", "") for p in r.params})),
            bucket_sizes=", ".join(str(b) for b in r.bucket_bytes),
        )
        self.ints.update(
            world_size=r.world,
            rank=_group_rank(r.process_group),
            output_device=int(output_device),
            broadcast_buffers=int(bool(broadcast_buffers)),
            has_sync_bn=int(bool(has_sync_bn)),
            static_graph=int(bool(static_graph)),
            bucket_cap_bytes=int(r.bucket_cap),
            find_unused_parameters=int(r.find_unused),
            gradient_as_bucket_view=int(r.as_view),
            is_multi_device_module=0,
            num_parameter_tensors=len(r.params),
            total_parameter_size_bytes=int(sum(r.bucket_bytes)),
            iteration=0,
        )

    def set_runtime_stats_and_log(self) -> None:
        r = self.reducer
        self.ints["iteration"] = r.iterations
        if r.iterations:
            self.ints.update(
                num_buckets_reduced=len(r.bucket_bytes),
                unused_parameter_size=0,
                has_rebuilt_buckets=0,
                backward_comm_time=int(r.last_comm_seconds * 1e9),
                avg_backward_comm_time=int(r.comm_seconds / r.iterations * 1e9),
            )
            if r.find_unused and not r.static_graph:
                # The emulated reducer always sees every parameter used: the graph is static.
                self.ints["can_set_static_graph"] = 1

    def set_error_and_log(self, message: str) -> None:
        self.strs["error"] = str(message)

    def _set_comm_hook_name(self, name: str) -> None:
        self.strs["comm_hook"] = str(name)

    def _set_uneven_input_join(self) -> None:
        self.ints["join_uneven_inputs"] = 1

    def _set_static_graph(self) -> None:
        self.ints["static_graph"] = 1

    def _get_ddp_logging_data(self) -> _LoggingData:
        return _LoggingData(dict(self.strs), dict(self.ints))


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
        self, ddp: EmulatedDDP, params: list[torch.Tensor], bucket_cap: int, find_unused: bool, as_view: bool
    ) -> None:
        rt = ddp._gpemu_rt
        self.rt = rt
        self._ddp = weakref.ref(ddp)
        self.process_group = ddp.process_group
        self.params = params
        self.world = dist.get_world_size(self.process_group)
        self.bucket_cap = bucket_cap
        self.find_unused = find_unused
        self.as_view = as_view
        self.static_graph = False
        # Gradients become ready roughly in reverse registration order; DDP buckets them so.
        self.bucket_bytes = _buckets([_tensor_bytes(p) for p in reversed(params)], bucket_cap)
        self.grad_bytes = sum(self.bucket_bytes)
        first = params[0] if params else None
        self.device = (first.device.index or 0) if first is not None and first.device.type == "cuda" else None
        self.expect_sync = False
        self.iterations = 0
        self.comm_seconds = 0.0
        self.last_comm_seconds = 0.0
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

    def _update_process_group(self, group: Any) -> None:
        self.process_group = group
        self.world = dist.get_world_size(group)

    def _remove_autograd_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _get_local_used_map(self) -> torch.Tensor:
        return torch.ones(len(self.params), dtype=torch.int32)

    def _get_zeros_like_grad_buckets(self) -> list[_Bucket]:
        # One synchronisation per backward (see _finish_backward): one bucket to mirror.
        return [_Bucket(0, self.grad_bytes)]

    def _run_comm_hook(self, bucket: Any) -> torch.futures.Future:
        """A joined rank (``DistributedDataParallel.join``) mirrors the gradient synchronisation of
        the ranks still training: it meets them once, with zero gradients."""
        stream = self._stream()
        finish = 0.0
        if stream is not None:
            engine = self.rt.engine
            finish = max(stream.busy_until, engine.now()) + allreduce_seconds(
                self.grad_bytes, self.world, self._bandwidth()
            )
        _lockstep(self.process_group, finish)
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
    def _bandwidth(self) -> float:
        if self.device is None:
            return 12e9
        return interconnect_bandwidth(self.rt.gpus[self.device])

    def _stream(self) -> Any:
        engine = self.rt.engine
        if engine is None or self.device is None:
            return None
        return engine.stream(self.device)

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
        if stream is None:
            _lockstep(self.process_group, 0.0)
            return
        engine = rt.engine
        backward_end = max(stream.busy_until, engine.now())
        backward_start = self._backward_start if self._backward_start is not None else backward_end
        backward_start = min(backward_start, backward_end)
        ddp = self._ddp()
        measured = ddp._gpemu_measured_comm() if ddp is not None else None
        if measured is not None:
            finish = backward_end + measured
        else:
            finish = _overlapped_finish(backward_start, backward_end, self.bucket_bytes, self.world, self._bandwidth())
        # Ranks wait for the slowest one: the all-reduce ends when the last rank's ends. (Issued
        # when the backward ended: the message's own host time is the emulator's.)
        finish = _lockstep(self.process_group, finish)
        rt.recorder.add("ddp_allreduce_bytes", float(self.grad_bytes))
        exposed = max(0.0, finish - max(stream.busy_until, backward_end))
        self.last_comm_seconds = exposed
        self.comm_seconds += exposed
        if exposed > 0:
            stream.enqueue(exposed, "comm", "DDP gradient all-reduce", 0, backward_end)


class EmulatedDDP(_TorchDDP):
    """What ``DistributedDataParallel(module, ...)`` builds while gpemu is patched, for a module
    on emulated GPUs: torch's own DDP with :class:`EmulatedReducer` / :class:`EmulatedLogger`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        rt = current()
        if rt is None:
            raise RuntimeError("gpemu is not patched: EmulatedDDP needs an emulated run")
        object.__setattr__(self, "_gpemu_rt", rt)
        object.__setattr__(self, "_gpemu_batch", None)
        object.__setattr__(self, "_gpemu_measured", {})  # per-GPU batch -> exposed comm seconds
        super().__init__(*args, **kwargs)
        rt.say_once(
            "DistributedDataParallel is emulated: gradient all-reduce time is a ring estimate "
            "over the GPUs' interconnect; ranks stay in lock-step through real gloo messages"
        )

    # ---------------------------------------------------------------- the C++ parts, emulated
    def _ddp_init_helper(self, parameters: list, *args: Any, **kwargs: Any) -> None:
        cap = int(getattr(self, "bucket_bytes_cap", _DEFAULT_BUCKET_BYTES) or _DEFAULT_BUCKET_BYTES)
        self.reducer = EmulatedReducer(
            self, list(parameters), cap, bool(self.find_unused_parameters), bool(self.gradient_as_bucket_view)
        )
        self.logger = EmulatedLogger(self.reducer)
        self.reducer.set_logger(self.logger)
        has_sync_bn = any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())
        self.logger.set_construction_data_and_log(
            type(self.module).__name__,
            [] if self.device_ids is None else self.device_ids,
            -1 if self.output_device is None else self.output_device,
            bool(getattr(self, "forward_sync_buffers", getattr(self, "broadcast_buffers", True))),
            has_sync_bn,
            bool(args[2] if len(args) > 2 else kwargs.get("static_graph", False)),
        )
        self._passing_sync_batchnorm_handle(self.module)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        self._check_comm_hook(hook)
        self.logger._set_comm_hook_name(getattr(hook, "__qualname__", repr(hook)))
        self._comm_hooks.append((hook, state))
        self._gpemu_rt.say_once(
            "DDP communication hooks are accepted but not run: the all-reduce is emulated at full size"
        )

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        self.logger._set_comm_hook_name(str(comm_hook_type))
        self._gpemu_rt.say_once(
            "DDP communication hooks are accepted but not run: the all-reduce is emulated at full size"
        )

    def _match_unused_params_allreduce(self) -> None:
        pass  # the emulated reducer sends no used-parameter map a joined rank would have to mirror

    # ---------------------------------------------------------------- calls
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        # Torch's Module call machinery, not gpemu's patched __call__: the wrapped module (not this
        # wrapper) is the outermost module whose GPU time is charged and replayed, and this
        # wrapper's Python (input moves, buffer syncs, prepare_for_backward) runs on every call.
        first = next((a for a in (*inputs, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        if first is not None:
            object.__setattr__(self, "_gpemu_batch", int(first.shape[0]))
        return nn.Module._call_impl(self, *inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if not modules or modules.get("module") is None:
                raise
            return getattr(modules["module"], name)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in ("_gpemu_rt", "_gpemu_measured"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_gpemu_rt", current())
        object.__setattr__(self, "_gpemu_measured", {})
        super().__setstate__(state)

    # ---------------------------------------------------------------- measured communication
    def _gpemu_measured_comm(self) -> float | None:
        """Exposed communication from the database's measured DDP iterations, when there are some:
        ddp_iteration - forward - backward - optimizer step, for this model, GPU, world size and
        per-GPU batch. Looked up once per batch size (never on the hot path afterwards)."""
        batch = self._gpemu_batch
        reducer = self.reducer
        if batch is None or reducer.device is None:
            return None
        if batch in self._gpemu_measured:
            return self._gpemu_measured[batch]
        value = None
        rt = self._gpemu_rt
        device, world = reducer.device, reducer.world
        try:
            from .costs import backward_seconds, forward_seconds
            from .identify import identify

            identity = identify(rt, self.module)
            gpu = rt.gpus[device].name
            if identity.name and rt.db.has(gpu, identity.name, "ddp_iteration", world):
                iteration = rt.db.lookup(gpu, identity.name, batch, "ddp_iteration", world)
                fwd, _ = forward_seconds(rt, identity, batch, device)
                bwd, _ = backward_seconds(rt, identity, batch, device)
                step = (
                    rt.db.lookup(gpu, identity.name, batch, "optimizer_step").value
                    if rt.db.has(gpu, identity.name, "optimizer_step")
                    else 0.0
                )
                value = max(0.0, iteration.value - fwd - bwd - step)
                rt.say_once(
                    f"DDP all-reduce of {identity.name} on {world} x {gpu}: from the database's "
                    f"ddp_iteration ({iteration.provenance}) minus forward, backward and step"
                )
        except Exception as exc:  # the estimate below still applies
            if rt.config.debug:
                rt.say_once(f"DDP: measured all-reduce time unavailable ({exc!r}); using the ring estimate")
            value = None
        self._gpemu_measured[batch] = value
        return value


def _buckets(sizes: list[int], cap: int) -> list[int]:
    buckets: list[int] = []
    current_size = 0
    for size in sizes:
        current_size += size
        if current_size >= cap:
            buckets.append(current_size)
            current_size = 0
    if current_size:
        buckets.append(current_size)
    return buckets


def _overlapped_finish(start: float, end: float, buckets: list[int], world: int, bandwidth: float) -> float:
    """When the last bucket's all-reduce ends, buckets starting as their gradients are ready."""
    total = sum(buckets) or 1
    duration = end - start
    done = 0
    comm_free = start
    for size in buckets:
        done += size
        ready = start + duration * done / total
        comm_free = max(ready, comm_free) + allreduce_seconds(size, world, bandwidth)
    return max(comm_free, end)


_SUBCLASSES: dict[type, type] = {}


def _emulated_subclass(cls: type) -> type:
    """A user's DDP subclass with EmulatedDDP slotted in under it (its own methods still win)."""
    if cls is _TorchDDP:
        return EmulatedDDP
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls, EmulatedDDP), {"__module__": cls.__module__})
        _SUBCLASSES[cls] = sub
    return sub


# --------------------------------------------------------------------------------------------
# c10d collectives on emulated tensors
# --------------------------------------------------------------------------------------------
def _done(work: Any, async_op: bool) -> Any:
    return work if async_op else None


class _C10d(_Comms):
    """The c10d collectives: emulated tensors are charged and meet; host tensors go to gloo."""

    def world(self, group: Any) -> int:
        return dist.get_world_size(group)

    def dev(self, t: torch.Tensor) -> int:
        return t.device.index or 0

    def all_reduce(
        self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        if not _is_emulated(tensor):
            return _ORIG["all_reduce"](tensor, op=op, group=group, async_op=async_op)
        if _outside(group):
            return None
        dev, world = self.dev(tensor), self.world(group)
        vop, average = _values_op(op)
        everyone, work = self.run(
            dev,
            allreduce_seconds(_tensor_bytes(tensor), world, self.bandwidth(dev)),
            "all_reduce",
            group,
            _knows(tensor) and vop is not None,
        )
        value = None
        if everyone:
            value, work = self._reduced(tensor, vop, group, world if average else 1)
        _store(tensor, value)
        return _done(work, async_op)

    def _reduced(self, tensor: torch.Tensor, vop: Any, group: Any, divide: int) -> tuple[torch.Tensor, Any]:
        """The values every rank knows of ``tensor``, all-reduced for real over the gloo group
        (``divide``: by the world for an average), and the real work object."""
        value = _proxy(tensor)
        work = _ORIG["all_reduce"](value, op=vop, group=group, async_op=True)
        work.wait()
        self.values()
        return (value / divide if divide != 1 else value), work

    def all_reduce_coalesced(
        self, tensors: list, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        tensors = list(tensors)
        if not any(_is_emulated(t) for t in tensors):
            return _ORIG["all_reduce_coalesced"](tensors, op=op, group=group, async_op=async_op)
        if _outside(group):
            return None
        dev, world = self.dev(next(t for t in tensors if _is_emulated(t))), self.world(group)
        vop, average = _values_op(op)
        nbytes = sum(_tensor_bytes(t) for t in tensors)
        everyone, work = self.run(
            dev,
            allreduce_seconds(nbytes, world, self.bandwidth(dev)),
            "all_reduce_coalesced",
            group,
            all(_knows(t) or not _is_emulated(t) for t in tensors) and vop is not None,
        )
        for t in tensors:
            value = None
            if everyone:
                value, work = self._reduced(t, vop, group, world if average else 1)
            _store(t, value)
        return _done(work, async_op)

    def p2p_seconds(self, t: torch.Tensor, dev: int) -> float:
        return _tensor_bytes(t) / self.bandwidth(dev) + _RING_STEP_LATENCY

    def isend(
        self,
        tensor: torch.Tensor,
        dst: int | None = None,
        group: Any = None,
        tag: int = 0,
        group_dst: int | None = None,
    ) -> Any:
        if not _is_emulated(tensor):
            return _ORIG["isend"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        if _outside(group):
            return None
        # A header (when the transfer can end, whether values follow), then the known values.
        engine, dev = self.rt.engine, self.dev(tensor)
        stream = engine.stream(dev)
        start = max(stream.busy_until, engine.now())
        finish = start + self.p2p_seconds(tensor, dev)
        knows = _knows(tensor)
        header = torch.tensor([finish, 1.0 if knows else 0.0], dtype=torch.float64)
        work = _ORIG["isend"](header, dst=dst, group=group, tag=tag, group_dst=group_dst)
        work.wait()
        if knows:
            work = _ORIG["isend"](_proxy(tensor), dst=dst, group=group, tag=tag, group_dst=group_dst)
            work.wait()
            self.values()
        stream.enqueue(finish - start, "comm", "send", 0, start)
        self.rt.recorder.add_many(("comm_collectives", 1.0), ("comm_messages", 1.0))
        return work

    def irecv(
        self,
        tensor: torch.Tensor,
        src: int | None = None,
        group: Any = None,
        tag: int = 0,
        group_src: int | None = None,
    ) -> Any:
        if not _is_emulated(tensor):
            return _ORIG["irecv"](tensor, src=src, group=group, tag=tag, group_src=group_src)
        if _outside(group):
            return None
        engine, dev = self.rt.engine, self.dev(tensor)
        stream = engine.stream(dev)
        start = max(stream.busy_until, engine.now())
        header = torch.zeros(2, dtype=torch.float64)
        work = _ORIG["irecv"](header, src=src, group=group, tag=tag, group_src=group_src)
        work.wait()
        value = None
        if header[1].item():
            if src is None and group_src is None:  # received from any rank: the values come from it
                src = work._source_rank()
            value = _proxy(tensor)
            work = _ORIG["irecv"](value, src=src, group=group, tag=tag, group_src=group_src)
            work.wait()
            self.values()
        finish = max(float(header[0]), start + self.p2p_seconds(tensor, dev))
        stream.enqueue(finish - start, "comm", "recv", 0, start)
        self.rt.recorder.add_many(("comm_collectives", 1.0), ("comm_messages", 1.0))
        _store(tensor, value)
        return work

    def send(
        self,
        tensor: torch.Tensor,
        dst: int | None = None,
        group: Any = None,
        tag: int = 0,
        group_dst: int | None = None,
    ) -> None:
        if not _is_emulated(tensor):
            return _ORIG["send"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        if _outside(group):
            return None
        self.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
        return None

    def recv(
        self,
        tensor: torch.Tensor,
        src: int | None = None,
        group: Any = None,
        tag: int = 0,
        group_src: int | None = None,
    ) -> int:
        if not _is_emulated(tensor):
            return _ORIG["recv"](tensor, src=src, group=group, tag=tag, group_src=group_src)
        if _outside(group):
            return -1
        work = self.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)
        if src is None and group_src is None:
            return work._source_rank()
        return src if src is not None else dist.get_global_rank(group or dist.group.WORLD, group_src)

    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int | None = None,
        group: Any = None,
        async_op: bool = False,
        group_src: int | None = None,
    ) -> Any:
        if not _is_emulated(tensor):
            return _ORIG["broadcast"](tensor, src=src, group=group, async_op=async_op, group_src=group_src)
        if _outside(group):
            return None
        dev = self.dev(tensor)
        is_src = (_group_rank(group) == group_src) if group_src is not None else (dist.get_rank() == src)
        everyone, work = self.run(
            dev,
            broadcast_seconds(_tensor_bytes(tensor), self.world(group), self.bandwidth(dev)),
            "broadcast",
            group,
            _knows(tensor) if is_src else True,
        )
        value = None
        if everyone:
            value = _proxy(tensor) if is_src else torch.zeros(tensor.numel(), dtype=_proxy_dtype(tensor))
            work = _ORIG["broadcast"](value, src=src, group=group, async_op=True, group_src=group_src)
            work.wait()
            self.values()
        _store(tensor, value)
        return _done(work, async_op)

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int | None = None,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
        group_dst: int | None = None,
    ) -> Any:
        if not _is_emulated(tensor):
            return _ORIG["reduce"](tensor, dst=dst, op=op, group=group, async_op=async_op, group_dst=group_dst)
        if _outside(group):
            return None
        dev, world = self.dev(tensor), self.world(group)
        vop, average = _values_op(op)
        is_dst = (_group_rank(group) == group_dst) if group_dst is not None else (dist.get_rank() == dst)
        everyone, work = self.run(
            dev,
            broadcast_seconds(_tensor_bytes(tensor), world, self.bandwidth(dev)),
            "reduce",
            group,
            _knows(tensor) and vop is not None,
        )
        if everyone:
            value = _proxy(tensor)
            work = _ORIG["all_reduce"](value, op=vop, group=group, async_op=True)
            work.wait()
            self.values()
            if is_dst:
                _store(tensor, value / world if average else value)
        elif is_dst:
            _store(tensor, None)
        return _done(work, async_op)

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        if not (_is_emulated(tensor) or any(_is_emulated(t) for t in tensor_list)):
            return _ORIG["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
        if _outside(group):
            return None
        dev, world = self.dev(tensor if _is_emulated(tensor) else tensor_list[0]), self.world(group)
        everyone, work = self.run(
            dev,
            allgather_seconds(_tensor_bytes(tensor) * world, world, self.bandwidth(dev)),
            "all_gather",
            group,
            _knows(tensor) or not _is_emulated(tensor),
        )
        if everyone:
            proxy = _proxy(tensor)
            outs = [torch.zeros_like(proxy) for _ in tensor_list]
            work = _ORIG["all_gather"](outs, proxy, group=group, async_op=True)
            work.wait()
            self.values()
            for dst, value in zip(tensor_list, outs, strict=False):
                _store(dst, value)
        else:
            for dst in tensor_list:
                _store(dst, None)
        return _done(work, async_op)

    def all_gather_into_tensor(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        if not (_is_emulated(input_tensor) or _is_emulated(output_tensor)):
            return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)
        if _outside(group):
            return None
        dev = self.dev(output_tensor if _is_emulated(output_tensor) else input_tensor)
        everyone, work = self.run(
            dev,
            allgather_seconds(_tensor_bytes(output_tensor), self.world(group), self.bandwidth(dev)),
            "all_gather_into_tensor",
            group,
            _knows(input_tensor) and output_tensor.numel() <= SHADOW_MAX_ELEMENTS,
        )
        value = None
        if everyone:
            proxy = _proxy(input_tensor)
            value = torch.zeros(output_tensor.numel(), dtype=proxy.dtype)
            work = _ALL_GATHER(value, proxy, group=group, async_op=True)
            work.wait()
            self.values()
        _store(output_tensor, value)
        return _done(work, async_op)

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if not (_is_emulated(input) or _is_emulated(output)):
            return _REDUCE_SCATTER(output, input, op=op, group=group, async_op=async_op)
        if _outside(group):
            return None
        return self._reduce_scatter(output, input, op, group, async_op, "reduce_scatter_tensor")

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if not (_is_emulated(output) or any(_is_emulated(t) for t in input_list)):
            return _ORIG["reduce_scatter"](output, input_list, op=op, group=group, async_op=async_op)
        if _outside(group):
            return None
        values = [host_shadow(t) if isinstance(t, EmuTensor) else t for t in input_list]
        known = all(v is not None for v in values) and sum(t.numel() for t in input_list) <= SHADOW_MAX_ELEMENTS
        joined = torch.cat([_proxy(t, v) for t, v in zip(input_list, values, strict=False)]) if known else None
        nbytes = sum(_tensor_bytes(t) for t in input_list)
        return self._reduce_scatter(output, None, op, group, async_op, "reduce_scatter", joined, nbytes, known)

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor | None,
        op: Any,
        group: Any,
        async_op: bool,
        name: str,
        joined: torch.Tensor | None = None,
        nbytes: int | None = None,
        known: bool | None = None,
    ) -> Any:
        dev = self.dev(output if _is_emulated(output) else input)
        world = self.world(group)
        vop, average = _values_op(op)
        if input is not None:
            nbytes = _tensor_bytes(input)
            known = _knows(input)
            joined = _proxy(input) if known else None
        everyone, work = self.run(
            dev,
            reduce_scatter_seconds(nbytes, world, self.bandwidth(dev)),
            name,
            group,
            bool(known) and vop is not None,
        )
        value = None
        if everyone:
            # (gloo has no reduce-scatter of every dtype: an all-reduce, then this rank's share)
            work = _ORIG["all_reduce"](joined, op=vop, group=group, async_op=True)
            work.wait()
            self.values()
            rank, share = _group_rank(group), output.numel()
            value = joined[rank * share : (rank + 1) * share]
            if average:
                value = value / world
        _store(output, value)
        return _done(work, async_op)

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list | None = None,
        src: int | None = None,
        group: Any = None,
        async_op: bool = False,
        group_src: int | None = None,
    ) -> Any:
        if not (_is_emulated(tensor) or any(_is_emulated(t) for t in scatter_list or ())):
            return _ORIG["scatter"](tensor, scatter_list, src=src, group=group, async_op=async_op, group_src=group_src)
        if _outside(group):
            return None
        dev, world = self.dev(tensor), self.world(group)
        is_src = (_group_rank(group) == group_src) if group_src is not None else (dist.get_rank() == src)
        share = tensor.numel()
        knows = True
        if is_src:
            knows = (
                bool(scatter_list)
                and all(_knows(t) or not _is_emulated(t) for t in scatter_list)
                and share * world <= SHADOW_MAX_ELEMENTS
            )
        everyone, work = self.run(
            dev, broadcast_seconds(_tensor_bytes(tensor) * world, world, self.bandwidth(dev)), "scatter", group, knows
        )
        value = None
        if everyone:
            dtype = _proxy_dtype(tensor)
            joined = torch.cat([_proxy(t) for t in scatter_list]) if is_src else torch.zeros(share * world, dtype=dtype)
            work = _ORIG["broadcast"](joined.to(dtype), src=src, group=group, async_op=True, group_src=group_src)
            work.wait()
            self.values()
            rank = _group_rank(group)
            value = joined[rank * share : (rank + 1) * share]
        _store(tensor, value)
        return _done(work, async_op)

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list | None = None,
        dst: int | None = None,
        group: Any = None,
        async_op: bool = False,
        group_dst: int | None = None,
    ) -> Any:
        if not (_is_emulated(tensor) or any(_is_emulated(t) for t in gather_list or ())):
            return _ORIG["gather"](tensor, gather_list, dst=dst, group=group, async_op=async_op, group_dst=group_dst)
        if _outside(group):
            return None
        dev, world = self.dev(tensor), self.world(group)
        everyone, work = self.run(
            dev,
            broadcast_seconds(_tensor_bytes(tensor) * world, world, self.bandwidth(dev)),
            "gather",
            group,
            _knows(tensor),
        )
        outs = None
        if everyone:
            proxy = _proxy(tensor)
            outs = [torch.zeros_like(proxy) for _ in range(world)]
            work = _ORIG["all_gather"](outs, proxy, group=group, async_op=True)
            work.wait()
            self.values()
        for i, t in enumerate(gather_list or ()):
            _store(t, outs[i] if outs is not None else None)
        return _done(work, async_op)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if not (_is_emulated(input) or _is_emulated(output)):
            return _ORIG["all_to_all_single"](
                output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
            )
        if _outside(group):
            return None
        dev = self.dev(output if _is_emulated(output) else input)
        _, work = self.run(
            dev,
            all_to_all_seconds(_tensor_bytes(input), self.world(group), self.bandwidth(dev)),
            "all_to_all_single",
            group,
            False,
        )
        _store(output, None)
        return _done(work, async_op)

    def all_to_all(
        self, output_tensor_list: list, input_tensor_list: list, group: Any = None, async_op: bool = False
    ) -> Any:
        if not any(_is_emulated(t) for t in (*output_tensor_list, *input_tensor_list)):
            return _ORIG["all_to_all"](output_tensor_list, input_tensor_list, group=group, async_op=async_op)
        if _outside(group):
            return None
        first = next(t for t in (*output_tensor_list, *input_tensor_list) if _is_emulated(t))
        dev = self.dev(first)
        nbytes = sum(_tensor_bytes(t) for t in input_tensor_list)
        _, work = self.run(
            dev, all_to_all_seconds(nbytes, self.world(group), self.bandwidth(dev)), "all_to_all", group, False
        )
        for t in output_tensor_list:
            _store(t, None)
        return _done(work, async_op)

    def barrier(self, group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
        # gloo has no per-device barrier; the device list only matters to NCCL.
        return _ORIG["barrier"](group=group, async_op=async_op)

    # ---------------------------------------------------------------- DDP's C++ collectives
    def broadcast_coalesced(self, original: Callable) -> Callable:
        def _broadcast_coalesced(process_group: Any, tensors: list, buffer_size: int, src: int = 0) -> Any:
            tensors = list(tensors)
            emulated = [t for t in tensors if _is_emulated(t)]
            if not emulated:
                return original(process_group, tensors, buffer_size, src)
            # Parameters and buffers of a model (DDP's construction and buffer syncs): their values
            # are never known, so the ranks meet once and the time is charged.
            dev = self.dev(emulated[0])
            nbytes = sum(_tensor_bytes(t) for t in emulated)
            self.run(
                dev,
                broadcast_seconds(nbytes, dist.get_world_size(process_group), self.bandwidth(dev)),
                "broadcast parameters and buffers",
                process_group,
                False,
            )
            return None

        return _broadcast_coalesced

    def verify_params(self, original: Callable) -> Callable:
        def _verify_params_across_processes(process_group: Any, tensors: list, logger: Any = None) -> Any:
            tensors = list(tensors)
            if not any(_is_emulated(t) for t in tensors):
                return original(process_group, tensors, logger)
            # Every rank must wrap the same model: compare the parameter count and shapes in one
            # message (the most and the least of each over the ranks).
            shapes = repr([tuple(t.shape) for t in tensors]).encode()
            digest = float(int.from_bytes(hashlib.sha1(shapes).digest()[:6], "big"))
            count = float(len(tensors))
            t = torch.tensor([count, digest, -count, -digest], dtype=torch.float64)
            _ORIG["all_reduce"](t, op=_MAX, group=process_group)
            if t[0] != -t[2] or t[1] != -t[3]:
                message = (
                    "DDP expects same model across all ranks, but ranks have different parameters "
                    f"(this rank: {len(tensors)} parameters; the largest count among ranks: {int(t[0])})"
                )
                if logger is not None:
                    logger.set_error_and_log(message)
                raise RuntimeError(message)
            return None

        return _verify_params_across_processes


# --------------------------------------------------------------------------------------------
# functional collectives (torch.ops._c10d_functional): DTensor, FSDP2, tensor parallelism
# --------------------------------------------------------------------------------------------
def _meta_like(x: Any) -> Any:
    if isinstance(x, EmuTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta_like(v) for v in x)
    return x


def _resolve_group(name: Any) -> Any:
    if isinstance(name, dist.ProcessGroup):
        return name
    return _c10d._resolve_process_group(name)


class _Functional(_Comms):
    """Handlers for ``torch.ops._c10d_functional.*`` on emulated tensors (see
    ``TensorState.op_handlers``): the output is what the op's meta kernel says; the time and the
    meeting are those of the c10d collective; a collective's result is ready when it returns, so
    ``wait_tensor`` has nothing left to wait for (stream order already holds)."""

    def outputs(self, func: Any, args: tuple, kwargs: dict, dev: int) -> Any:
        mout = func(*_meta_like(list(args)), **{k: _meta_like(v) for k, v in kwargs.items()})
        ts = self.rt.tensors
        leaves, spec = tree_flatten(mout)
        return tree_unflatten([from_meta(ts, m, dev) if isinstance(m, torch.Tensor) else m for m in leaves], spec)

    def reduce(self, value: torch.Tensor, reduce_op: str, group: Any) -> torch.Tensor:
        name, average = _FUNCOL_OPS[reduce_op]
        work = _ORIG["all_reduce"](value, op=getattr(dist.ReduceOp, name), group=group, async_op=True)
        work.wait()
        self.values()
        return value / dist.get_world_size(group) if average else value

    def all_reduce(self, func: Any, args: tuple, kwargs: dict, inplace: bool = False) -> Any:
        inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        reduce_op, group = args[1], _resolve_group(args[2])
        dev = inputs[0].device.index or 0
        world = dist.get_world_size(group)
        seconds = sum(allreduce_seconds(_tensor_bytes(t), world, self.bandwidth(dev)) for t in inputs)
        everyone, _ = self.run(
            dev, seconds, "all_reduce", group, reduce_op in _FUNCOL_OPS and all(_knows(t) for t in inputs)
        )
        out = args[0] if inplace else self.outputs(func, args, kwargs, dev)
        outs = out if isinstance(out, (list, tuple)) else [out]
        for src, dst in zip(inputs, outs, strict=False):
            _store(dst, self.reduce(_proxy(src), reduce_op, group) if everyone else None)
        return out

    def all_gather(self, func: Any, args: tuple, kwargs: dict) -> Any:
        inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        world, group = int(args[1]), _resolve_group(args[2])
        dev = inputs[0].device.index or 0
        seconds = sum(allgather_seconds(_tensor_bytes(t) * world, world, self.bandwidth(dev)) for t in inputs)
        everyone, _ = self.run(
            dev,
            seconds,
            "all_gather_into_tensor",
            group,
            all(_knows(t) and t.numel() * world <= SHADOW_MAX_ELEMENTS for t in inputs),
        )
        out = kwargs["out"] if "out" in kwargs else self.outputs(func, args, kwargs, dev)
        outs = out if isinstance(out, (list, tuple)) else [out]
        for src, dst in zip(inputs, outs, strict=False):
            value = None
            if everyone:
                proxy = _proxy(src)
                value = torch.zeros(proxy.numel() * world, dtype=proxy.dtype)
                work = _ALL_GATHER(value, proxy, group=group, async_op=True)
                work.wait()
                self.values()
            _store(dst, value)
        return out

    def reduce_scatter(self, func: Any, args: tuple, kwargs: dict) -> Any:
        inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        reduce_op, group = args[1], _resolve_group(args[3])
        world = dist.get_world_size(group)
        dev = inputs[0].device.index or 0
        seconds = sum(reduce_scatter_seconds(_tensor_bytes(t), world, self.bandwidth(dev)) for t in inputs)
        everyone, _ = self.run(
            dev, seconds, "reduce_scatter_tensor", group, reduce_op in _FUNCOL_OPS and all(_knows(t) for t in inputs)
        )
        out = self.outputs(func, args, kwargs, dev)
        outs = out if isinstance(out, (list, tuple)) else [out]
        rank = _group_rank(group)
        for src, dst in zip(inputs, outs, strict=False):
            value = None
            if everyone:
                full = self.reduce(_proxy(src), reduce_op, group)
                share = dst.numel()
                value = full[rank * share : (rank + 1) * share]
            _store(dst, value)
        return out

    def all_to_all(self, func: Any, args: tuple, kwargs: dict) -> Any:
        group = _resolve_group(args[3])
        dev = args[0].device.index or 0
        self.run(
            dev,
            all_to_all_seconds(_tensor_bytes(args[0]), dist.get_world_size(group), self.bandwidth(dev)),
            "all_to_all_single",
            group,
            False,
        )
        return self.outputs(func, args, kwargs, dev)

    def broadcast(self, func: Any, args: tuple, kwargs: dict, inplace: bool = False) -> Any:
        tensor, src, group = args[0], int(args[1]), _resolve_group(args[2])
        dev = tensor.device.index or 0
        is_src = _group_rank(group) == src
        everyone, _ = self.run(
            dev,
            broadcast_seconds(_tensor_bytes(tensor), dist.get_world_size(group), self.bandwidth(dev)),
            "broadcast",
            group,
            _knows(tensor) if is_src else True,
        )
        out = tensor if inplace else self.outputs(func, args, kwargs, dev)
        value = None
        if everyone:
            value = _proxy(tensor) if is_src else torch.zeros(tensor.numel(), dtype=_proxy_dtype(tensor))
            work = _ORIG["broadcast"](value, group=group, group_src=src, async_op=True)
            work.wait()
            self.values()
        _store(out, value)
        return out

    def handlers(self) -> dict[int, Callable]:
        """id(op) -> handler, for the functional collectives this torch has."""
        table: dict[int, Callable] = {}

        def add(namespace: str, name: str, handler: Callable) -> None:
            ns = getattr(torch.ops, namespace, None)
            try:
                packet = getattr(ns, name)
            except (AttributeError, RuntimeError):
                return
            for overload in packet.overloads():
                table[id(getattr(packet, overload))] = handler

        for ns in ("_c10d_functional", "_c10d_functional_autograd"):
            add(ns, "all_reduce", self.all_reduce)
            add(ns, "all_reduce_coalesced", self.all_reduce)
            add(ns, "all_reduce_", lambda f, a, k: self.all_reduce(f, a, k, inplace=True))
            add(ns, "all_reduce_coalesced_", lambda f, a, k: self.all_reduce(f, a, k, inplace=True))
            add(ns, "all_gather_into_tensor", self.all_gather)
            add(ns, "all_gather_into_tensor_out", self.all_gather)
            add(ns, "all_gather_into_tensor_coalesced", self.all_gather)
            add(ns, "reduce_scatter_tensor", self.reduce_scatter)
            add(ns, "reduce_scatter_tensor_coalesced", self.reduce_scatter)
            add(ns, "all_to_all_single", self.all_to_all)
            add(ns, "broadcast", self.broadcast)
            add(ns, "broadcast_", lambda f, a, k: self.broadcast(f, a, k, inplace=True))
            add(ns, "wait_tensor", lambda f, a, k: a[0])
        return table


# --------------------------------------------------------------------------------------------
# DTensor over emulated local tensors
# --------------------------------------------------------------------------------------------
class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after module ``name`` is executed (importing it is slow,
    so gpemu does not import it; a program that uses it does)."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name = name
        self.callback = callback
        self.busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        run, callback = loader.exec_module, self.callback

        def exec_module(module: Any) -> None:
            run(module)
            callback(module)

        loader.exec_module = exec_module
        return spec


def _patch_dtensor(rt: Runtime, module: Any) -> None:
    """``DTensor`` reports the device of an emulated local tensor (its C-level wrapper is made on
    the local tensor's real device, ``meta``), so parameters sharded by FSDP2 or tensor
    parallelism are CUDA parameters to optimizers, ``Module.to``, FSDP's checks and the user."""
    cls = module.DTensor
    base_device = torch.Tensor.device

    def local_emulated(self: Any) -> Any:
        local = self.__dict__.get("_local_tensor") if hasattr(self, "__dict__") else None
        if local is None:
            try:
                local = self._local_tensor
            except AttributeError:
                return None
        return local if isinstance(local, EmuTensor) else None

    def device(self: Any) -> torch.device:
        local = local_emulated(self)
        return local.device if local is not None else base_device.__get__(self)

    def is_cuda(self: Any) -> bool:
        return local_emulated(self) is not None or base_device.__get__(self).type == "cuda"

    def is_meta(self: Any) -> bool:
        return local_emulated(self) is None and base_device.__get__(self).type == "meta"

    def get_device(self: Any) -> int:
        local = local_emulated(self)
        return local.get_device() if local is not None else torch.Tensor.get_device(self)

    rt.patcher.replace(cls, "device", property(device))
    rt.patcher.replace(cls, "is_cuda", property(is_cuda))
    rt.patcher.replace(cls, "is_meta", property(is_meta))
    rt.patcher.replace(cls, "get_device", get_device)


# --------------------------------------------------------------------------------------------
# nn.DataParallel
# --------------------------------------------------------------------------------------------
def _has_hooks(module: nn.Module) -> bool:
    g = torch.nn.modules.module
    if (
        g._global_forward_hooks
        or g._global_forward_pre_hooks
        or g._global_backward_hooks
        or g._global_backward_pre_hooks
    ):
        return True
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in module.modules()
    )


def _leaf_spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.requires_grad)
    return x if isinstance(x, (int, float, bool, str, type(None))) else type(x)


class _MirrorPlan:
    """What device 0's call of the original module did, to be done again on device ``dev``."""

    __slots__ = ("rt", "dev", "dev0", "spans", "names", "since", "out_specs", "saved", "progress")

    def __init__(
        self, rt: Runtime, dev: int, dev0: int, spans: list, since: int, out_specs: list, saved: int, progress: dict
    ) -> None:
        self.rt, self.dev, self.dev0, self.spans, self.since = rt, dev, dev0, spans, since
        self.names = {name for _, name, _ in spans}
        self.out_specs, self.saved, self.progress = out_specs, saved, progress


class _Mirror(torch.autograd.Function):
    """One replica of ``nn.DataParallel`` on device ``plan.dev``: the same GPU work as device 0's
    call of the original module (replicas are identical copies on equal chunks), charged on its
    own device without running the replica on the host. Its backward charges device 0's backward
    spans of that call at the end of the backward pass (when they are known), on its own device,
    from the time the replica's backward was issued."""

    @staticmethod
    def forward(ctx: Any, plan: _MirrorPlan, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        rt = plan.rt
        stream = rt.engine.stream(plan.dev)
        for kind, name, seconds in plan.spans:
            stream.enqueue(seconds, kind, name)
        mem = rt.memory[plan.dev]
        ctx.plan = plan
        ctx.saved = mem.allocate(plan.saved) if plan.saved > 0 else None  # its saved activations
        ctx.shapes = [(t.shape, t.dtype) for t in tensors]
        ts = rt.tensors
        outs = []
        for shape, stride, offset, dtype, nbytes, _grad in plan.out_specs:
            outs.append(ts.wrap(shape, stride, offset, dtype, plan.dev, mem.allocate(nbytes) if nbytes else None))
        ctx.mark_non_differentiable(*[o for o, spec in zip(outs, plan.out_specs, strict=False) if not spec[5]])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        plan = ctx.plan
        ctx.saved = None  # the saved activations are freed by the backward
        rt = plan.rt
        issued = rt.engine.now()

        def charge() -> None:
            spans, done = rt.recorder.spans, plan.progress
            first = max(plan.since, done.get(plan.dev, 0))
            stream = rt.engine.stream(plan.dev)
            for i in range(first, len(spans)):
                s = spans[i]
                if s.device == plan.dev0 and s.kind == "backward" and s.name in plan.names:
                    stream.enqueue(s.end - s.start, s.kind, s.name, 0, issued)
            done[plan.dev] = len(spans)

        torch.autograd.Variable._execution_engine.queue_callback(charge)
        ts = rt.tensors
        out = [None]
        for (shape, dtype), needed in zip(ctx.shapes, ctx.needs_input_grad[1:], strict=False):
            out.append(from_meta(ts, torch.empty(shape, dtype=dtype, device="meta"), plan.dev) if needed else None)
        return tuple(out)


class _Replicas(list):
    """What ``DataParallel.replicate`` returns while gpemu is patched: the module itself for the
    first device and placeholders for the others, until ``parallel_apply`` decides how the
    replicas run (torch's replicas, made then, or mirrors of device 0)."""

    def __init__(self, module: nn.Module, devices: list[int], detach: bool) -> None:
        super().__init__([module] + [None] * (len(devices) - 1))
        self.module, self.devices, self.detach = module, devices, detach


def _install_data_parallel(rt: Runtime) -> None:
    """torch.nn.DataParallel across emulated GPUs.

    Its scatter/broadcast/gather/reduce primitives are C functions of the CUDA build; here they
    become copies between emulated devices (each charged as a transfer by the device layer).

    Replicas: ``DataParallel`` replicates the module every step (new module objects holding
    broadcast copies of the parameters) and runs them in threads. Here device 0 runs the ORIGINAL
    module on its chunk (so the replay fast path and the model's measured or recorded time
    apply), and when that call was charged as whole-module work (no per-op pricing) each other
    replica is a :class:`_Mirror` of it on its own device: the same spans, outputs shaped as device
    0's, its saved-activation memory, and gradients for its input chunk and parameter copies (so
    DataParallel's gradient reduction to device 0 happens as usual). Replicas run op by op as
    they are when the mirror does not apply: chunks of other shapes than device 0's, module hooks
    (they would fire once, not per replica), a first call priced op by op, or a sharing backend.
    """
    from torch.nn.parallel import _functions, comm
    from torch.nn.parallel.replicate import _broadcast_coalesced_reshape
    from torch.nn.parallel.replicate import replicate as torch_replicate

    # (the package re-exports the function under the module's name)
    parallel_apply_module = importlib.import_module("torch.nn.parallel.parallel_apply")

    device_index = rt.cuda.device_index
    progress: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()

    def cuda(index: int) -> torch.device:
        return torch.device("cuda", index)

    def indices(devices: Any) -> list[int]:
        return [device_index(d) for d in devices]

    def copy_to(t: torch.Tensor, d: int) -> torch.Tensor:
        # (inside the autograd Functions of torch.nn.parallel: a plain copy between emulated GPUs)
        if isinstance(t, EmuTensor):
            return t if t.get_device() == d else peer_copy(t, d)
        return t.to(cuda(d), non_blocking=True)

    def broadcast_coalesced(tensors: Any, devices: Any, buffer_size: int = 10485760) -> list:
        return [[copy_to(t, d) for t in tensors] for d in indices(devices)]

    def scatter(
        tensor: torch.Tensor,
        devices: Any = None,
        chunk_sizes: Any = None,
        dim: int = 0,
        streams: Any = None,
        *,
        out: Any = None,
    ) -> tuple:
        if out is not None:
            chunks = tensor.split([o.shape[dim] for o in out], dim)
            for o, c in zip(out, chunks, strict=False):
                o.copy_(c, non_blocking=True)
            return tuple(out)
        devs = indices(devices)
        chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devs), dim)
        outputs = []
        for i, (c, d) in enumerate(zip(chunks, devs, strict=False)):
            with torch.cuda.stream(streams[i]) if streams else contextlib.nullcontext():
                outputs.append(c.to(cuda(d), non_blocking=True) if c.device != cuda(d) else c.contiguous())
        return tuple(outputs)

    def gather(tensors: Any, dim: int = 0, destination: Any = None, *, out: Any = None) -> torch.Tensor:
        if out is not None:
            return torch.cat([t.to(out.device, non_blocking=True) for t in tensors], dim, out=out)
        if destination == -1 or destination == "cpu":
            target = torch.device("cpu")
        else:
            target = cuda(device_index(destination))
        return torch.cat([t.to(target, non_blocking=True) for t in tensors], dim)

    def reduce_add_coalesced(inputs: Any, destination: Any = None, buffer_size: int = 10485760) -> tuple:
        target = device_index(destination)
        result = []
        for group in zip(*inputs, strict=False):
            total = None
            for t in group:
                t = copy_to(t, target)
                total = t if total is None else total + t
            result.append(total)
        return tuple(result)

    def run_replica(module: nn.Module, args: Any, kwargs: dict, device: Any) -> Any:
        if device is None:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else rt.current_device
        if not isinstance(args, (list, tuple)):
            args = (args,)
        with torch.cuda.device(device_index(device)):
            return module(*args, **kwargs)

    def mirrorable(origin: nn.Module, inputs: Any, kwargs_tup: Any) -> bool:
        """Whether the other replicas can be mirrors of device 0 (before running anything)."""
        if rt.sharing is not None or rt.engine is None or _has_hooks(origin):
            return False
        leaves0, spec0 = tree_flatten((inputs[0], kwargs_tup[0]))
        key0 = [_leaf_spec(x) for x in leaves0]
        for args, kwargs in zip(inputs[1:], kwargs_tup[1:], strict=False):
            leaves, spec = tree_flatten((args, kwargs))
            if spec != spec0 or [_leaf_spec(x) for x in leaves] != key0:
                return False
        return True

    def replicas_of(deferred: _Replicas) -> list:
        """torch's replicas for the devices after the first (the same as DataParallel makes)."""
        return torch_replicate(deferred.module, deferred.devices[1:], deferred.detach)

    def apply_deferred(deferred: _Replicas, inputs: Any, kwargs_tup: Any, devices: list) -> list:
        origin = deferred.module
        devs = [device_index(d) for d in devices]
        dev0 = devs[0]
        if not mirrorable(origin, inputs, kwargs_tup):
            replicas = [origin, *replicas_of(deferred)]
            return [run_replica(m, a, k, d) for m, a, k, d in zip(replicas, inputs, kwargs_tup, devs, strict=False)]
        spans = rt.recorder.spans
        mem0 = rt.memory[dev0]
        before_spans, before_mem = len(spans), mem0.allocated
        out0 = run_replica(origin, inputs[0], kwargs_tup[0], dev0)
        own = [s for s in spans[before_spans:] if s.device == dev0]
        out_leaves, out_spec = tree_flatten(out0)
        tensors = [o for o in out_leaves if isinstance(o, torch.Tensor)]
        if not own or any(s.kind != "forward" for s in own) or not all(isinstance(o, EmuTensor) for o in tensors):
            # Device 0's work was priced op by op (a first call): the replicas run as they are.
            replicas = replicas_of(deferred)
            return [out0] + [
                run_replica(m, a, k, d)
                for m, a, k, d in zip(replicas, inputs[1:], kwargs_tup[1:], devs[1:], strict=False)
            ]
        # The parameters and buffers are broadcast as replicate() does (the parameter copies carry
        # each replica's gradients back); the replica modules themselves are not needed.
        # (Buffer copies, which replicate() also makes, would be dropped at once: not made.)
        copies = _broadcast_coalesced_reshape(list(origin.parameters()), devs[1:], deferred.detach)
        out_specs = [
            (tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, _tensor_bytes(o), o.requires_grad)
            for o in tensors
        ]
        saved = max(0, mem0.allocated - before_mem - sum(spec[4] for spec in out_specs))
        plan_spans = [(s.kind, s.name, s.end - s.start) for s in own]
        done = progress.setdefault(origin, {})
        since = len(spans)
        outputs = [out0]
        for j, (args, kwargs, dev) in enumerate(zip(inputs[1:], kwargs_tup[1:], devs[1:], strict=False)):
            plan = _MirrorPlan(rt, dev, dev0, plan_spans, since, out_specs, saved, done)
            grads_from = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
            grads_from += [p for p in copies[j] if isinstance(p, torch.Tensor)]
            mirrored_out = iter(_Mirror.apply(plan, *grads_from))
            outputs.append(
                tree_unflatten([next(mirrored_out) if isinstance(o, torch.Tensor) else o for o in out_leaves], out_spec)
            )
        rt.recorder.add("dp_mirrored_replicas", float(len(devs) - 1))
        return outputs

    def parallel_apply(modules: Any, inputs: Any, kwargs_tup: Any = None, devices: Any = None) -> list:
        if kwargs_tup is None:
            kwargs_tup = ({},) * len(modules)
        if isinstance(modules, _Replicas):
            return apply_deferred(modules, inputs, kwargs_tup, list(devices or modules.devices))
        if devices is None:
            devices = [None] * len(modules)
        return [run_replica(m, a, k, d) for m, a, k, d in zip(modules, inputs, kwargs_tup, devices, strict=False)]

    rt.patcher.replace_everywhere_many(
        (getattr(module, name), new)
        for module, name, new in (
            (comm, "broadcast_coalesced", broadcast_coalesced),
            (comm, "scatter", scatter),
            (comm, "gather", gather),
            (comm, "reduce_add_coalesced", reduce_add_coalesced),
            (parallel_apply_module, "parallel_apply", parallel_apply),
        )
    )
    # The background copy streams of torch's Scatter, one per device (as torch keeps them): a
    # batch copied from the host does not wait for the device's compute stream.
    side_streams: dict[int, Any] = {}

    def get_stream(device: Any) -> Any:
        index = device_index(device)
        if index not in side_streams:
            side_streams[index] = rt.cuda.Stream(device=index)
        return side_streams[index]

    rt.patcher.replace(_functions, "_get_stream", get_stream)

    def scatter_forward(ctx: Any, target_gpus: Any, chunk_sizes: Any, dim: int, input: torch.Tensor) -> tuple:
        # torch's version, without torch.device(int) (C-level parsing that needs a real accelerator).
        target_gpus = indices(target_gpus)
        ctx.dim = dim
        ctx.input_device = input.get_device() if input.device.type != "cpu" else -1
        streams = [get_stream(d) for d in target_gpus] if ctx.input_device == -1 else None
        outputs = scatter(input, target_gpus, chunk_sizes, dim, streams)
        if streams is not None:  # the compute streams wait for the copies (GPU side)
            for d, stream in zip(target_gpus, streams, strict=False):
                with torch.cuda.device(d):
                    torch.cuda.current_stream().wait_stream(stream)
        return outputs

    rt.patcher.replace(_functions.Scatter, "forward", staticmethod(scatter_forward))

    def replicate(self: nn.DataParallel, module: nn.Module, device_ids: Any) -> list:
        if type(self).parallel_apply is not nn.DataParallel.parallel_apply:
            return torch_replicate(module, device_ids, not torch.is_grad_enabled())  # a subclass's own apply
        # Deferred to parallel_apply, which knows the inputs: it decides between running the
        # replicas and mirroring device 0 (no replica modules are made then).
        return _Replicas(module, [device_index(d) for d in device_ids], not torch.is_grad_enabled())

    rt.patcher.replace(nn.DataParallel, "replicate", replicate)

    def data_parallel_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # The wrapper itself is not the unit whose GPU time is charged: each replica's work is
        # charged on its own device (a batch/N share each), so N emulated GPUs work in parallel.
        return nn.Module._call_impl(self, *args, **kwargs)

    rt.patcher.replace(nn.DataParallel, "__call__", data_parallel_call)


# --------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------
def install(rt: Runtime) -> None:
    original_init = _ORIG["init_process_group"]
    original_new_group = _ORIG["new_group"]

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        device_id = kwargs.pop("device_id", None)  # gloo cannot bind a (meta-backed) CUDA device
        mapped = map_backend(backend) if backend is not None else "gloo"
        if backend is not None and mapped != backend:
            rt.say_once(f"torch.distributed backend {backend!r} runs as {mapped!r} (NCCL needs real GPUs)")
        original_init(mapped, *args, **kwargs)
        if device_id is not None:
            index = device_id if isinstance(device_id, int) else torch.device(device_id).index
            if index is not None:
                rt.current_device = rt.check_device(index)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_id", None)
        if "backend" in kwargs:
            kwargs["backend"] = map_backend(kwargs["backend"])
        elif len(args) >= 3:
            args = (*args[:2], map_backend(args[2]), *args[3:])
        return original_new_group(*args, **kwargs)

    def is_nccl_available() -> bool:
        return True

    c10d = _C10d(rt)
    replacements: dict[str, Any] = {
        "init_process_group": init_process_group,
        "new_group": new_group,
        "is_nccl_available": is_nccl_available,
    }
    for name in (
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "reduce_scatter",
        "scatter",
        "gather",
        "all_to_all_single",
        "all_to_all",
        "barrier",
        "isend",
        "irecv",
        "send",
        "recv",
    ):
        replacements[name] = getattr(c10d, name)
    # Other names of the single-tensor all-gather and reduce-scatter, where this torch has them.
    for name, ours in (
        ("all_gather_single", c10d.all_gather_into_tensor),
        ("_all_gather_base", c10d.all_gather_into_tensor),
        ("reduce_scatter_single", c10d.reduce_scatter_tensor),
        ("_reduce_scatter_base", c10d.reduce_scatter_tensor),
    ):
        if name in _ORIG:
            replacements[name] = ours
    # One pass over torch's modules replaces every by-name copy (torch.distributed re-exports
    # c10d's functions; other modules import them by name).
    rt.patcher.replace_everywhere_many(
        [(getattr(_c10d, name), new) for name, new in replacements.items() if getattr(_c10d, name, None) is not None]
    )
    for name, new in replacements.items():
        if getattr(dist, name, None) is not new:
            rt.patcher.replace(dist, name, new)
    # The C++ collectives DDP's Python calls at construction and for buffer syncs.
    for name, make in (
        ("_broadcast_coalesced", c10d.broadcast_coalesced),
        ("_verify_params_across_processes", c10d.verify_params),
    ):
        original = getattr(dist, name, None)
        if original is not None:
            rt.patcher.replace(dist, name, make(original))
    # torch.distributed asks the C layer which accelerator the machine has (default meshes,
    # barrier devices, backend choice): the emulated CUDA.
    rt.patcher.replace(torch._C, "_get_accelerator", lambda: rt.cuda.current_accelerator())

    # Functional collectives reach the emulated tensor's dispatch as ops.
    handlers = _Functional(rt).handlers()
    rt.tensors.op_handlers.update(handlers)
    rt.patcher.on_restore(lambda: [rt.tensors.op_handlers.pop(k, None) for k in handlers])

    # DTensor reports an emulated local tensor's device (now, or when a program imports it).
    dtensor_module = "torch.distributed.tensor._api"
    if dtensor_module in sys.modules:
        _patch_dtensor(rt, sys.modules[dtensor_module])
    else:
        finder = _AfterImport(dtensor_module, lambda module: _patch_dtensor(rt, module) if current() is rt else None)
        sys.meta_path.insert(0, finder)
        rt.patcher.on_restore(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)

    # DistributedDataParallel(...) builds an EmulatedDDP, also for names imported before patch().
    def ddp_new(cls: type, *args: Any, **kwargs: Any) -> Any:
        module = args[0] if args else kwargs.get("module")
        on_gpu = isinstance(module, nn.Module) and any(_is_emulated(p) for p in module.parameters())
        if not on_gpu and not issubclass(cls, EmulatedDDP):
            return nn.Module.__new__(cls)  # a CPU model: torch's own DDP works over gloo
        if not issubclass(cls, EmulatedDDP):
            cls = _emulated_subclass(cls)
        return nn.Module.__new__(cls)

    rt.patcher.replace(_TorchDDP, "__new__", ddp_new)
    _install_data_parallel(rt)

    # torchrun sets LOCAL_RANK: each local rank starts on "its" emulated GPU when there is one.
    try:
        local_rank = dist.get_node_local_rank()
    except (RuntimeError, ValueError, AttributeError):
        local_rank = None  # not started by torchrun
    if isinstance(local_rank, int) and 0 <= local_rank < rt.num_devices:
        rt.current_device = local_rank

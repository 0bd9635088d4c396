"""torch.distributed on emulated GPUs (component ``gpemu.distributed``).

* ``init_process_group('nccl')`` and ``new_group(backend='nccl')`` use gloo instead (also inside
  ``'cuda:nccl,cpu:gloo'`` strings): NCCL does not exist on the CPU build, gloo works between
  local processes, so ranks really rendezvous and really exchange small messages.
* ``DistributedDataParallel`` cannot wrap meta-backed parameters (its constructor reads values
  and its reducer asserts in backward). Constructing it while gpemu is patched gives an
  :class:`EmulatedDDP` instead: a ``DistributedDataParallel`` subclass that wraps the module
  (``.module``, ``no_sync()``, ``state_dict`` keys with ``module.``), and at the end of every
  synchronising backward charges the gradient all-reduce as a ``comm`` span on the device's
  stream, keeping ranks in lock-step with one real 8-byte gloo all-reduce per iteration.
* Collectives that scripts call on emulated tensors (``dist.all_reduce(loss)`` for metrics)
  run a real gloo collective on a small CPU proxy (so every rank still matches collectives),
  charge their GPU time, and never crash.

All-reduce time (estimated): ring all-reduce, per bucket
``2 (n-1)/n * bytes / bus_bandwidth + 2 (n-1) * latency``, buckets launched as the backward
pass produces their gradients (DDP's 25 MiB buckets overlap with backward), so only the part
of communication that outlasts the backward pass shows in the iteration.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from .hostvalues import SHADOW_MAX_ELEMENTS
from .runtime import current
from .tensor import host_shadow, set_host_shadow

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "EmulatedDDP", "map_backend", "allreduce_seconds", "interconnect_bandwidth"]

# NCCL bus bandwidth between GPUs of one node (bytes/s) where the GPUs have NVLink; PCIe GPUs
# exchange data over PCIe at about their host-link bandwidth.
_NVLINK_BUS_BANDWIDTH = (("SXM4", 230e9), ("SXM5", 360e9), ("H100", 360e9), ("H200", 360e9), ("SXM2", 130e9))
_RING_STEP_LATENCY = 8e-6  # seconds per ring step (NCCL's small-message latency within a node)
_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


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
    """Bus bandwidth of the GPU-to-GPU path of this GPU model (bytes/s)."""
    own = getattr(spec, "interconnect_bandwidth", None)
    if own:
        return float(own)
    name = str(getattr(spec, "name", "")).upper()
    for fragment, bandwidth in _NVLINK_BUS_BANDWIDTH:
        if fragment in name:
            return bandwidth
    return float(getattr(spec, "host_link_bandwidth_pinned", 12e9) or 12e9)


def allreduce_seconds(nbytes: int, world_size: int, bus_bandwidth: float) -> float:
    """Ring all-reduce time of ``nbytes`` among ``world_size`` GPUs."""
    if world_size <= 1 or nbytes <= 0:
        return 0.0
    n = world_size
    return 2 * (n - 1) / n * nbytes / bus_bandwidth + 2 * (n - 1) * _RING_STEP_LATENCY


def _is_emulated(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------
# emulated DistributedDataParallel
# --------------------------------------------------------------------------------------------
class EmulatedDDP(_TorchDDP):
    """What ``DistributedDataParallel(module, ...)`` builds while gpemu is patched."""

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group: Any = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, delay_all_reduce_named_params: Any = None,
                 param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False) -> None:
        nn.Module.__init__(self)
        rt = current()
        if rt is None:
            raise RuntimeError("gpemu is not patched: EmulatedDDP needs an emulated run")
        self._gpemu_rt = rt
        if not dist.is_initialized():
            raise ValueError("Default process group has not been initialized, please make sure to call "
                             "init_process_group.")
        if not any(p.requires_grad for p in module.parameters()):
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                               "parameter that requires a gradient.")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.device_ids = list(device_ids) if device_ids else None
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.bucket_bytes_cap = int((bucket_cap_mb or 25) * 1024 * 1024)
        params = [p for p in module.parameters() if p.requires_grad]
        first = next(iter(module.parameters()))
        self.device = first.device
        self._gpemu_device = (first.device.index or 0) if first.device.type == "cuda" else None
        self._gpemu_world = dist.get_world_size(self.process_group)
        # Gradients become ready roughly in reverse registration order; DDP buckets them so.
        self._gpemu_bucket_bytes = _buckets([_tensor_bytes(p) for p in reversed(params)], self.bucket_bytes_cap)
        self._gpemu_grad_bytes = sum(self._gpemu_bucket_bytes)
        self._gpemu_sync_this_backward = False
        self._gpemu_queued = False
        self._gpemu_batch: int | None = None
        self._gpemu_measured: dict[int, float | None] = {}  # per-GPU batch -> exposed comm seconds
        self._gpemu_backward_start: float | None = None
        self._gpemu_lock = threading.Lock()
        self._gpemu_hooks = [p.register_post_accumulate_grad_hook(self._gpemu_on_grad_ready) for p in params]
        # The reducer's flat bucket buffers are a second copy of the gradients on the GPU
        # (unless gradient_as_bucket_view makes the gradients views into them).
        self._gpemu_buckets_memory = None
        trackers = rt.memory
        if trackers and self._gpemu_device is not None and not gradient_as_bucket_view:
            self._gpemu_buckets_memory = trackers[self._gpemu_device].allocate(self._gpemu_grad_bytes)
        if init_sync:
            # DDP broadcasts rank 0's parameters and buffers at construction.
            state_bytes = sum(_tensor_bytes(t) for t in module.state_dict().values() if isinstance(t, torch.Tensor))
            self._gpemu_charge(allreduce_seconds(state_bytes, self._gpemu_world, self._gpemu_bandwidth()) / 2,
                               "DDP broadcast parameters")
            _lockstep(self.process_group, 0.0)
        rt.say_once("DistributedDataParallel is emulated: gradient all-reduce time is a ring estimate "
                    "over the GPUs' interconnect; ranks stay in lock-step through real gloo messages")

    # ---------------------------------------------------------------- torch DDP surface
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        # Runs on every call, also when gpemu replays the model's recorded forward: the wrapped
        # module (not this wrapper) is the outermost module whose GPU time is charged, and it is
        # what gets identified against the profile database.
        self._gpemu_sync_this_backward = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._gpemu_backward_start = None
        first = next((a for a in (*inputs, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        if first is not None:
            self._gpemu_batch = int(first.shape[0])
        return nn.Module._call_impl(self, *inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        yield

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        rt = self._gpemu_rt
        if rt is not None:
            rt.say_once("DDP communication hooks are accepted but not run (the all-reduce is emulated)")

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        self.register_comm_hook(None, None)

    def _set_static_graph(self) -> None:
        self.static_graph = True

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_gpemu_rt", None)
        state.pop("process_group", None)
        state.pop("_gpemu_hooks", None)
        state.pop("_gpemu_lock", None)
        state.pop("_gpemu_buckets_memory", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._gpemu_rt = current()
        self.process_group = dist.group.WORLD
        self._gpemu_lock = threading.Lock()
        self._gpemu_hooks = []
        self._gpemu_buckets_memory = None

    # ---------------------------------------------------------------- emulation
    def _gpemu_bandwidth(self) -> float:
        rt = self._gpemu_rt
        if rt is None or self._gpemu_device is None:
            return 12e9
        return interconnect_bandwidth(rt.gpus[self._gpemu_device])

    def _gpemu_stream(self):
        rt = self._gpemu_rt
        engine = rt.engine if rt is not None else None
        if engine is None or self._gpemu_device is None:
            return None
        return engine.stream(self._gpemu_device)

    def _gpemu_charge(self, seconds: float, name: str) -> None:
        stream = self._gpemu_stream()
        if stream is not None and seconds > 0:
            stream.enqueue(seconds, "comm", name)

    def _gpemu_on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._gpemu_sync_this_backward:
            return
        with self._gpemu_lock:
            if self._gpemu_queued:
                return
            self._gpemu_queued = True
            stream = self._gpemu_stream()
            # The first gradient is ready: GPU time of the backward pass started about now.
            self._gpemu_backward_start = stream.busy_until if stream is not None else None
        torch.autograd.Variable._execution_engine.queue_callback(self._gpemu_finish_backward)

    def _gpemu_finish_backward(self) -> None:
        """End of a synchronising backward: charge the (exposed) all-reduce, meet the peers."""
        with self._gpemu_lock:
            self._gpemu_queued = False
            self._gpemu_sync_this_backward = False
        rt = self._gpemu_rt
        if rt is None or current() is not rt:  # gpemu was unpatched while this wrapper lived on
            return
        rt.recorder.add("ddp_gradient_syncs", 1.0)
        stream = self._gpemu_stream()
        if stream is None:
            _lockstep(self.process_group, 0.0)
            return
        engine = rt.engine
        backward_end = max(stream.busy_until, engine.now())
        backward_start = self._gpemu_backward_start if self._gpemu_backward_start is not None else backward_end
        backward_start = min(backward_start, backward_end)
        measured = self._gpemu_measured_comm()
        if measured is not None:
            finish = backward_end + measured
        else:
            finish = _overlapped_finish(backward_start, backward_end, self._gpemu_bucket_bytes,
                                        self._gpemu_world, self._gpemu_bandwidth())
        # Ranks wait for the slowest one: the all-reduce ends when the last rank's ends.
        finish = _lockstep(self.process_group, finish)
        start = max(stream.busy_until, engine.now())
        rt.recorder.add("ddp_allreduce_bytes", float(self._gpemu_grad_bytes))
        self._gpemu_charge(max(0.0, finish - start), "DDP gradient all-reduce")


    def _gpemu_measured_comm(self) -> float | None:
        """Exposed communication from the database's measured DDP iterations, when there are some:
        ddp_iteration - forward - backward - optimizer step, for this model, GPU, world size and
        per-GPU batch. Looked up once per batch size (never on the hot path afterwards)."""
        batch = self._gpemu_batch
        if batch is None or self._gpemu_device is None:
            return None
        if batch in self._gpemu_measured:
            return self._gpemu_measured[batch]
        value = None
        rt = self._gpemu_rt
        try:
            from .costs import backward_seconds, forward_seconds
            from .identify import identify

            identity = identify(rt, self.module)
            gpu = rt.gpus[self._gpemu_device].name
            if identity.name and rt.db.has(gpu, identity.name, "ddp_iteration", self._gpemu_world):
                iteration = rt.db.lookup(gpu, identity.name, batch, "ddp_iteration", self._gpemu_world)
                fwd, _ = forward_seconds(rt, identity, batch, self._gpemu_device)
                bwd, _ = backward_seconds(rt, identity, batch, self._gpemu_device)
                step = (rt.db.lookup(gpu, identity.name, batch, "optimizer_step").value
                        if rt.db.has(gpu, identity.name, "optimizer_step") else 0.0)
                value = max(0.0, iteration.value - fwd - bwd - step)
                rt.say_once(f"DDP all-reduce of {identity.name} on {self._gpemu_world} x {gpu}: from the database's "
                            f"ddp_iteration ({iteration.provenance}) minus forward, backward and step")
        except Exception as exc:  # the estimate below still applies
            if rt.config.debug:
                rt.say_once(f"DDP: measured all-reduce time unavailable ({exc!r}); using the ring estimate")
            value = None
        self._gpemu_measured[batch] = value
        return value


def _buckets(sizes: list[int], cap: int) -> list[int]:
    buckets: list[int] = []
    current = 0
    for size in sizes:
        current += size
        if current >= cap:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
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


def _lockstep(group: Any, value: float) -> float:
    """One real gloo all-reduce (MAX of an 8-byte float) among the group's ranks."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # a host tensor: gloo's own all-reduce
    return float(t.item())


# --------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------
def install(rt: "Runtime") -> None:
    from torch.distributed import distributed_c10d as c10d

    _ORIGINALS = {name: getattr(c10d, name) for name in
                  ("init_process_group", "new_group", "all_reduce", "broadcast", "reduce", "all_gather",
                   "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")}
    original_init = _ORIGINALS["init_process_group"]
    original_new_group = _ORIGINALS["new_group"]

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

    def charge(tensor: torch.Tensor, seconds: float, name: str) -> None:
        engine = rt.engine
        if engine is not None and seconds > 0:
            engine.stream(tensor.device.index or 0).enqueue(seconds, "comm", name)

    def world(group: Any) -> int:
        return dist.get_world_size(group)

    def bandwidth(tensor: torch.Tensor) -> float:
        return interconnect_bandwidth(rt.gpus[tensor.device.index or 0])

    def proxy_of(tensor: torch.Tensor) -> torch.Tensor:
        """A CPU stand-in carrying the host-side value where the device layer keeps one.

        Its size depends only on the tensor's shape, so every rank sends the same message even
        when only some ranks know the values (mismatched gloo messages abort a rank).
        """
        if tensor.numel() > SHADOW_MAX_ELEMENTS:
            return torch.zeros(1, dtype=torch.float64)
        host = host_shadow(tensor)
        if host is not None:
            return host.detach().to(torch.float64).reshape(-1).clone()
        return torch.zeros(tensor.numel(), dtype=torch.float64)

    def finish(tensor: torch.Tensor, proxy: torch.Tensor, work: Any) -> Any:
        if work is not None and not hasattr(work, "wait"):
            work = None
        if work is not None:
            work.wait()
        set_host_shadow(tensor, proxy)
        return work

    def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
        if not _is_emulated(tensor):
            return _ORIGINALS["all_reduce"](tensor, op=op, group=group, async_op=async_op)
        charge(tensor, allreduce_seconds(_tensor_bytes(tensor), world(group), bandwidth(tensor)), "all_reduce")
        proxy = proxy_of(tensor)
        work = _ORIGINALS["all_reduce"](proxy, op=op, group=group, async_op=async_op)
        return finish(tensor, proxy, work)

    def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None, async_op: bool = False,
                  group_src: int | None = None):
        if not _is_emulated(tensor):
            return _ORIGINALS["broadcast"](tensor, src=src, group=group, async_op=async_op, group_src=group_src)
        charge(tensor, allreduce_seconds(_tensor_bytes(tensor), world(group), bandwidth(tensor)) / 2, "broadcast")
        proxy = proxy_of(tensor)
        work = _ORIGINALS["broadcast"](proxy, src=src, group=group, async_op=async_op, group_src=group_src)
        return finish(tensor, proxy, work)

    def reduce(tensor: torch.Tensor, dst: int | None = None, op: Any = dist.ReduceOp.SUM, group: Any = None,
               async_op: bool = False, group_dst: int | None = None):
        if not _is_emulated(tensor):
            return _ORIGINALS["reduce"](tensor, dst=dst, op=op, group=group, async_op=async_op, group_dst=group_dst)
        charge(tensor, allreduce_seconds(_tensor_bytes(tensor), world(group), bandwidth(tensor)) / 2, "reduce")
        proxy = proxy_of(tensor)
        work = _ORIGINALS["reduce"](proxy, dst=dst, op=op, group=group, async_op=async_op, group_dst=group_dst)
        return finish(tensor, proxy, work)

    def all_gather(tensor_list: list, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        if not _is_emulated(tensor):
            return _ORIGINALS["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
        charge(tensor, allreduce_seconds(_tensor_bytes(tensor), world(group), bandwidth(tensor)) / 2, "all_gather")
        proxy = proxy_of(tensor)
        outs = [torch.zeros_like(proxy) for _ in tensor_list]
        work = _ORIGINALS["all_gather"](outs, proxy, group=group, async_op=async_op)
        if work is not None and hasattr(work, "wait"):
            work.wait()
        for dst, value in zip(tensor_list, outs):
            if _is_emulated(dst):
                set_host_shadow(dst, value)
            elif isinstance(dst, torch.Tensor) and dst.numel() == value.numel():
                dst.copy_(value.reshape(dst.shape))
        return work

    def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                               async_op: bool = False):
        if not (_is_emulated(input) or _is_emulated(output)):
            return _ORIGINALS["all_gather_into_tensor"](output, input, group=group, async_op=async_op)
        charge(output, allreduce_seconds(_tensor_bytes(output), world(group), bandwidth(output)) / 2,
               "all_gather_into_tensor")
        return _ORIGINALS["all_reduce"](torch.zeros(1), group=group, async_op=async_op)

    def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                              group: Any = None, async_op: bool = False):
        if not (_is_emulated(input) or _is_emulated(output)):
            return _ORIGINALS["reduce_scatter_tensor"](output, input, op=op, group=group, async_op=async_op)
        charge(output, allreduce_seconds(_tensor_bytes(input), world(group), bandwidth(input)) / 2,
               "reduce_scatter_tensor")
        return _ORIGINALS["all_reduce"](torch.zeros(1), group=group, async_op=async_op)

    def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None):
        # gloo has no per-device barrier; the device list only matters to NCCL.
        return _ORIGINALS["barrier"](group=group, async_op=async_op)

    replacements = {
        "init_process_group": init_process_group, "new_group": new_group, "is_nccl_available": is_nccl_available,
        "all_reduce": all_reduce, "broadcast": broadcast, "reduce": reduce, "all_gather": all_gather,
        "all_gather_into_tensor": all_gather_into_tensor, "reduce_scatter_tensor": reduce_scatter_tensor,
        "barrier": barrier,
    }
    # One pass over torch's modules replaces every by-name copy (torch.distributed re-exports
    # c10d's functions; other modules import them by name).
    rt.patcher.replace_everywhere_many([(getattr(c10d, name), new) for name, new in replacements.items()])
    for name, new in replacements.items():
        if getattr(dist, name, None) is not new:
            rt.patcher.replace(dist, name, new)

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


def _install_data_parallel(rt: "Runtime") -> None:
    """torch.nn.DataParallel across emulated GPUs.

    Its scatter/broadcast/gather/reduce primitives are C functions of the CUDA build; here they
    become copies between emulated devices (each charged as a transfer by the device layer).
    Replicas run one after another on the host thread: each device's GPU work still goes to its
    own stream, so the emulated GPUs work in parallel as with real threads.
    """
    import importlib

    from torch.nn.parallel import _functions, comm

    # (the package re-exports the function under the module's name)
    parallel_apply_module = importlib.import_module("torch.nn.parallel.parallel_apply")

    device_index = rt.cuda.device_index

    def cuda(index: int) -> torch.device:
        return torch.device("cuda", index)

    def indices(devices: Any) -> list[int]:
        return [device_index(d) for d in devices]

    def broadcast_coalesced(tensors: Any, devices: Any, buffer_size: int = 10485760) -> list:
        out = []
        for d in indices(devices):
            out.append([t if t.device == cuda(d) else t.to(cuda(d), non_blocking=True) for t in tensors])
        return out

    def scatter(tensor: torch.Tensor, devices: Any = None, chunk_sizes: Any = None, dim: int = 0,
                streams: Any = None, *, out: Any = None) -> tuple:
        if out is not None:
            chunks = tensor.split([o.shape[dim] for o in out], dim)
            for o, c in zip(out, chunks):
                o.copy_(c, non_blocking=True)
            return tuple(out)
        devs = indices(devices)
        chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devs), dim)
        return tuple(c.to(cuda(d), non_blocking=True) if c.device != cuda(d) else c.contiguous()
                     for c, d in zip(chunks, devs))

    def gather(tensors: Any, dim: int = 0, destination: Any = None, *, out: Any = None) -> torch.Tensor:
        if out is not None:
            return torch.cat([t.to(out.device, non_blocking=True) for t in tensors], dim, out=out)
        if destination == -1 or destination == "cpu":
            target = torch.device("cpu")
        else:
            target = cuda(device_index(destination))
        return torch.cat([t.to(target, non_blocking=True) for t in tensors], dim)

    def reduce_add_coalesced(inputs: Any, destination: Any = None, buffer_size: int = 10485760) -> tuple:
        target = cuda(device_index(destination))
        result = []
        for group in zip(*inputs):
            total = None
            for t in group:
                t = t.to(target, non_blocking=True)
                total = t if total is None else total + t
            result.append(total)
        return tuple(result)

    def parallel_apply(modules: Any, inputs: Any, kwargs_tup: Any = None, devices: Any = None) -> list:
        if kwargs_tup is None:
            kwargs_tup = ({},) * len(modules)
        if devices is None:
            devices = [None] * len(modules)
        outputs = []
        for module, args, kwargs, device in zip(modules, inputs, kwargs_tup, devices):
            if device is None:
                first = next(iter(module.parameters()), None)
                device = first.device if first is not None else rt.current_device
            if not isinstance(args, (list, tuple)):
                args = (args,)
            with torch.cuda.device(device_index(device)):
                outputs.append(module(*args, **kwargs))
        return outputs

    rt.patcher.replace_everywhere_many(
        (getattr(module, name), new)
        for module, name, new in ((comm, "broadcast_coalesced", broadcast_coalesced), (comm, "scatter", scatter),
                                  (comm, "gather", gather), (comm, "reduce_add_coalesced", reduce_add_coalesced),
                                  (parallel_apply_module, "parallel_apply", parallel_apply)))
    # Background copy streams of the CUDA build: copies go on the devices' current streams.
    rt.patcher.replace(_functions, "_get_stream", lambda device: None)

    def scatter_forward(ctx: Any, target_gpus: Any, chunk_sizes: Any, dim: int, input: torch.Tensor) -> tuple:
        # torch's version builds torch.device(int) (C-level parsing that needs a real
        # accelerator) to pick copy streams; the emulated copies need none.
        target_gpus = indices(target_gpus)
        ctx.dim = dim
        ctx.input_device = input.get_device() if input.device.type != "cpu" else -1
        return scatter(input, target_gpus, chunk_sizes, dim)

    rt.patcher.replace(_functions.Scatter, "forward", staticmethod(scatter_forward))

    def data_parallel_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # The wrapper itself is not the unit whose GPU time is charged: each replica's work is
        # charged on its own device (a batch/N share each), so N emulated GPUs work in parallel.
        return nn.Module._call_impl(self, *args, **kwargs)

    rt.patcher.replace(nn.DataParallel, "__call__", data_parallel_call)


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




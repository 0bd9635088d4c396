"""``DistributedDataParallel`` on emulated GPUs: torch's own DDP over emulated C++ parts.

``DistributedDataParallel(module, ...)`` builds an :class:`EmulatedDDP` for a module on emulated
GPUs (also for names imported before ``patch()``, and for a user's DDP subclass): a subclass that
runs torch's own DDP Python code (constructor, ``forward`` with its input moves and buffer syncs,
``join``, ``no_sync``, static graph, logging data) over emulated stand-ins for the C++ parts it
cannot use with meta-backed tensors: the reducer (:class:`.reducer.EmulatedReducer`), the logger
(:class:`EmulatedLogger`), and the coalesced broadcast / parameter check of construction
(:class:`ConstructionCollectives`).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ..costmodel.comm import Collective
from ..costs import backward_seconds, forward_seconds
from ..identify import identify
from ..runtime import current
from .collectives import Call, Collectives
from .meeting import ORIGINAL, any_emulated, device_of, group_rank, is_emulated, tensor_bytes
from .reducer import EmulatedReducer
from .run_parts import RunParts

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

__all__ = ["EmulatedDDP", "EmulatedLogger", "ConstructionCollectives", "ddp_new", "DDP_CONSTRUCTION"]

_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
_HOOKS_NOTE = "DDP communication hooks are accepted but not run: the all-reduce is emulated at full size"
# torch.distributed's C++ collectives DDP's Python calls -> the ConstructionCollectives method.
DDP_CONSTRUCTION = {
    "_broadcast_coalesced": "broadcast_coalesced",
    "_verify_params_across_processes": "verify_params_across_processes",
}
_ORIGINAL_CONSTRUCTION: dict[str, Callable[..., Any]] = {
    name: getattr(dist, name) for name in DDP_CONSTRUCTION if getattr(dist, name, None) is not None
}


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
            rank=group_rank(r.process_group),
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


class EmulatedDDP(TorchDDP):
    """What ``DistributedDataParallel(module, ...)`` builds while gpemu is patched, for a module
    on emulated GPUs: torch's own DDP with :class:`EmulatedReducer` / :class:`EmulatedLogger`."""

    _gpemu_rt: Runtime | None
    _gpemu_batch: int | None
    _gpemu_measured: dict[int, float | None]  # per-GPU batch -> exposed comm seconds

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        rt = current()
        if rt is None:
            raise RuntimeError("gpemu is not patched: EmulatedDDP needs an emulated run")
        object.__setattr__(self, "_gpemu_rt", rt)
        object.__setattr__(self, "_gpemu_batch", None)
        object.__setattr__(self, "_gpemu_measured", {})
        super().__init__(*args, **kwargs)
        rt.say_once(
            "DistributedDataParallel is emulated: the gradient all-reduce is priced as NCCL runs it over "
            "the cluster's links (`gpemu topo`); ranks stay in lock-step through real gloo messages"
        )

    # ---------------------------------------------------------------- the C++ parts, emulated
    def _ddp_init_helper(self, parameters: list, *args: Any, **kwargs: Any) -> None:
        rt = self._gpemu_rt
        if rt is None:
            raise RuntimeError("gpemu is not patched: EmulatedDDP needs an emulated run")
        cap = int(getattr(self, "bucket_bytes_cap", _DEFAULT_BUCKET_BYTES) or _DEFAULT_BUCKET_BYTES)
        reducer = EmulatedReducer(
            RunParts.of(rt),
            self.process_group,
            list(parameters),
            cap,
            bool(self.find_unused_parameters),
            bool(self.gradient_as_bucket_view),
            weakref.WeakMethod(self._gpemu_measured_comm),  # (the reducer must not keep this alive)
        )
        logger = EmulatedLogger(reducer)
        reducer.set_logger(logger)
        # (torch annotates its C++ Reducer and Logger; the emulated ones stand for them)
        self.reducer = reducer  # type: ignore[assignment]
        self.logger = logger  # type: ignore[assignment]
        has_sync_bn = any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())
        logger.set_construction_data_and_log(
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
        self._name_comm_hook(getattr(hook, "__qualname__", repr(hook)))
        self._comm_hooks.append((hook, state))

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        self._name_comm_hook(str(comm_hook_type))

    def _name_comm_hook(self, name: str) -> None:
        logger = self.logger
        if isinstance(logger, EmulatedLogger):
            logger._set_comm_hook_name(name)
        if self._gpemu_rt is not None:
            self._gpemu_rt.say_once(_HOOKS_NOTE)

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
    def _gpemu_measured_comm(self, device: int, world: int) -> float | None:
        """Exposed communication from the database's measured DDP iterations, when there are some:
        ddp_iteration - forward - backward - optimizer step, for this model, GPU, world size and
        per-GPU batch. Looked up once per batch size (never on the hot path afterwards)."""
        batch, rt = self._gpemu_batch, self._gpemu_rt
        if batch is None or rt is None:
            return None
        if batch in self._gpemu_measured:
            return self._gpemu_measured[batch]
        value = None
        try:
            value = _measured_exposed_comm(rt, self.module, device, world, batch)
        except Exception as exc:  # the estimate still applies
            if rt.config.debug:
                rt.say_once(f"DDP: measured all-reduce time unavailable ({exc!r}); using the NCCL estimate")
            value = None
        self._gpemu_measured[batch] = value
        return value


def _measured_exposed_comm(rt: Runtime, module: nn.Module, device: int, world: int, batch: int) -> float | None:
    """ddp_iteration - forward - backward - optimizer step from the database, or None."""
    identity = identify(rt, module)
    gpu = rt.gpus[device].name
    if not identity.name or not rt.db.has(gpu, identity.name, "ddp_iteration", world):
        return None
    iteration = rt.db.lookup(gpu, identity.name, batch, "ddp_iteration", world)
    fwd, _ = forward_seconds(rt, identity, batch, device)
    bwd, _ = backward_seconds(rt, identity, batch, device)
    step = (
        rt.db.lookup(gpu, identity.name, batch, "optimizer_step").value
        if rt.db.has(gpu, identity.name, "optimizer_step")
        else 0.0
    )
    rt.say_once(
        f"DDP all-reduce of {identity.name} on {world} x {gpu}: from the database's "
        f"ddp_iteration ({iteration.provenance}) minus forward, backward and step"
    )
    return max(0.0, iteration.value - fwd - bwd - step)


class ConstructionCollectives:
    """The C++ collectives torch's DDP Python calls at construction and for buffer syncs
    (``dist._broadcast_coalesced``, ``dist._verify_params_across_processes``), for emulated
    parameters and buffers; host tensors go to torch's own."""

    def __init__(self, shared: Collectives) -> None:
        self.shared = shared

    def broadcast_coalesced(self, process_group: ProcessGroup, tensors: list, buffer_size: int, src: int = 0) -> Any:
        tensors = list(tensors)
        emulated = [t for t in tensors if is_emulated(t)]
        if not emulated:
            return _ORIGINAL_CONSTRUCTION["_broadcast_coalesced"](process_group, tensors, buffer_size, src)
        # Parameters and buffers of a model: their values are never known, so the ranks meet once
        # and the time is charged.
        call = Call("broadcast parameters and buffers", process_group, device_of(emulated))
        nbytes = sum(tensor_bytes(t) for t in emulated)
        self.shared.charge(call, self.shared.price(Collective.BROADCAST, [nbytes], call), False)
        return None

    def verify_params_across_processes(self, process_group: ProcessGroup, tensors: list, logger: Any = None) -> Any:
        tensors = list(tensors)
        if not any_emulated(tensors):
            return _ORIGINAL_CONSTRUCTION["_verify_params_across_processes"](process_group, tensors, logger)
        # Every rank must wrap the same model: compare the parameter count and shapes in one
        # message (the most and the least of each over the ranks).
        shapes = repr([tuple(t.shape) for t in tensors]).encode()
        digest = float(int.from_bytes(hashlib.sha1(shapes).digest()[:6], "big"))
        count = float(len(tensors))
        t = torch.tensor([count, digest, -count, -digest], dtype=torch.float64)
        ORIGINAL["all_reduce"](t, op=dist.ReduceOp.MAX, group=process_group)
        if t[0] != -t[2] or t[1] != -t[3]:
            message = (
                "DDP expects same model across all ranks, but ranks have different parameters "
                f"(this rank: {len(tensors)} parameters; the largest count among ranks: {int(t[0])})"
            )
            if logger is not None:
                logger.set_error_and_log(message)
            raise RuntimeError(message)
        return None

    def replacements(self) -> dict[str, Callable[..., Any]]:
        """torch.distributed name -> this run's function, for the names this torch has."""
        return {name: getattr(self, ours) for name, ours in DDP_CONSTRUCTION.items() if name in _ORIGINAL_CONSTRUCTION}


_SUBCLASSES: dict[type, type] = {}  # a user's DDP subclass -> its emulated subclass (per process)


def _emulated_subclass(cls: type) -> type:
    """A user's DDP subclass with EmulatedDDP slotted in under it (its own methods still win)."""
    if cls is TorchDDP:
        return EmulatedDDP
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls, EmulatedDDP), {"__module__": cls.__module__})
        _SUBCLASSES[cls] = sub
    return sub


def ddp_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``DistributedDataParallel.__new__`` while patched: an :class:`EmulatedDDP` (or the user's
    subclass over it) for a module with parameters on emulated GPUs."""
    module = args[0] if args else kwargs.get("module")
    on_gpu = isinstance(module, nn.Module) and any(is_emulated(p) for p in module.parameters())
    if not on_gpu and not issubclass(cls, EmulatedDDP):
        return nn.Module.__new__(cls)  # a CPU model: torch's own DDP works over gloo
    if not issubclass(cls, EmulatedDDP):
        cls = _emulated_subclass(cls)
    return nn.Module.__new__(cls)

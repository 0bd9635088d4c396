"""torch.distributed on emulated GPUs (component ``gpemu.distributed``).

* ``init_process_group('nccl')`` and ``new_group(backend='nccl')`` use gloo instead
  (:mod:`.backend`), so ranks really rendezvous and really exchange small messages. The C layer's
  accelerator (``torch._C._get_accelerator``, which torch.distributed asks for its default device:
  FSDP2's mesh, ``barrier``) is the emulated CUDA.
* **Collectives on emulated tensors**, in c10d's form (:mod:`.c10d`: ``all_reduce``, ``broadcast``,
  ``reduce``, ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``reduce_scatter``, ``scatter``, ``gather``, ``all_to_all(_single)``, send / recv) and torch's
  functional form (:mod:`.functional`: ``torch.ops._c10d_functional.*``, which DTensor and FSDP2
  use), each written once (:mod:`.collectives`): priced by :mod:`gpemu.costmodel.comm` as NCCL
  would run them over the links of the run's cluster (:mod:`.placement`: each rank's node, learnt
  in one message after ``init_process_group``), charged on the device's current stream, and the ranks meet in ONE small
  real gloo message per collective (:mod:`.meeting`): the latest finish time and whether every
  rank knows the values. Only then, and only for known values (:mod:`gpemu.hostvalues`), a second
  message carries them, so ``dist.all_reduce(torch.tensor([correct, seen], device='cuda'))`` is
  exact and an unknown tensor of any size costs one 16-byte message.
* ``DistributedDataParallel`` builds an :class:`EmulatedDDP` (:mod:`.ddp`): torch's own DDP Python
  code over emulated stand-ins for its C++ parts, the reducer (:class:`EmulatedReducer`,
  :mod:`.reducer`: at the end of every synchronising backward it charges the bucketed gradient
  all-reduce, overlapped with the backward pass, and the ranks meet once), the logger
  (:class:`EmulatedLogger`), and the coalesced broadcast / parameter check of construction.
* ``DTensor`` over emulated local tensors reports their device (:mod:`.dtensor`), so FSDP2
  (``fully_shard``) and tensor parallelism see CUDA parameters.
* More GPUs than processes (``gpemu run --world-size N``): one process stands for its identical
  ranks on torch's fake process group, a real gloo group among the processes (:mod:`.folding`).
* Symmetric memory (async TP) is refused in one line that says what to turn off (:mod:`.symmetric`).
* ``nn.DataParallel`` scatters, broadcasts, gathers and reduces by copies between emulated
  devices (:mod:`.data_parallel`); the replicas' identical work is charged on every device
  without running each replica op by op on the host (:mod:`.replicas`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d_module
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from .backend import ProcessGroups, map_backend
from .c10d import C10d
from .collectives import Collectives
from .data_parallel import install_data_parallel
from .ddp import ConstructionCollectives, EmulatedDDP, EmulatedLogger, ddp_new
from .dtensor import DTENSOR_MODULE, patch_dtensor
from .functional import Functional
from .reducer import EmulatedReducer
from .run_parts import RunParts
from .symmetric import SYMMETRIC_MEMORY_MODULE, refuse_symmetric_memory

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

__all__ = ["install", "EmulatedDDP", "EmulatedReducer", "EmulatedLogger", "map_backend"]


def install(rt: Runtime) -> None:
    """Patch torch.distributed, DDP, DTensor and DataParallel for the run (through ``rt.patcher``)."""
    parts = RunParts.of(rt)
    shared = Collectives(parts)
    patcher = rt.patcher
    groups = ProcessGroups(rt, parts.placement)
    replacements = {**groups.replacements(), **C10d(shared).replacements()}
    # One pass over torch's modules replaces every by-name copy (torch.distributed re-exports
    # c10d's functions; other modules import them by name).
    patcher.replace_everywhere_many(
        [
            (getattr(c10d_module, name), new)
            for name, new in replacements.items()
            if getattr(c10d_module, name, None) is not None
        ]
    )
    for name, new in replacements.items():
        if getattr(dist, name, None) is not new:
            patcher.replace(dist, name, new)
    # What the program (and torch's pipeline schedules) read as a group's backend; c10d's own
    # calls keep the fake one.
    patcher.replace(dist, "get_backend", groups.get_backend)
    # The C++ collectives DDP's Python calls at construction and for buffer syncs.
    for name, new in ConstructionCollectives(shared).replacements().items():
        patcher.replace(dist, name, new)
    # torch.distributed asks the C layer which accelerator the machine has (default meshes,
    # barrier devices, backend choice): the emulated CUDA.
    patcher.replace(torch._C, "_get_accelerator", parts.cuda.current_accelerator)
    # Functional collectives reach the emulated tensor's dispatch as ops.
    handlers = Functional(shared).handlers()
    parts.tensors.op_handlers.update(handlers)
    patcher.on_restore(functools.partial(_forget, parts.tensors.op_handlers, handlers))
    # DTensor reports an emulated local tensor's device (now, or when a program imports it).
    patcher.after_import(DTENSOR_MODULE, functools.partial(patch_dtensor, patcher))
    # Symmetric memory (async TP) is refused in one line that says what to turn off.
    patcher.after_import(SYMMETRIC_MEMORY_MODULE, functools.partial(refuse_symmetric_memory, patcher))
    # DistributedDataParallel(...) builds an EmulatedDDP, also for names imported before patch().
    patcher.replace(TorchDDP, "__new__", ddp_new)
    install_data_parallel(parts)
    _start_on_local_rank(rt)


def _forget(table: dict[int, Callable[[Any, tuple, dict], Any]], handlers: dict[int, Any]) -> None:
    for key in handlers:
        table.pop(key, None)


def _start_on_local_rank(rt: Runtime) -> None:
    """torchrun sets LOCAL_RANK: each local rank starts on "its" emulated GPU when there is one."""
    try:
        local_rank = dist.get_node_local_rank()
    except (RuntimeError, ValueError, AttributeError):
        local_rank = None  # not started by torchrun
    if isinstance(local_rank, int) and 0 <= local_rank < rt.num_devices:
        rt.current_device = local_rank

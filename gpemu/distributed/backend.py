"""Process groups on emulated GPUs: NCCL runs as gloo.

``init_process_group('nccl')`` and ``new_group(backend='nccl')`` use gloo instead (also inside
``'cuda:nccl,cpu:gloo'`` strings): NCCL does not exist on the CPU build, gloo works between local
processes (and between machines or network namespaces: it binds where ``GLOO_SOCKET_IFNAME``
says), so ranks really rendezvous and really exchange small messages. Right after, the ranks
tell each other their nodes (:meth:`.placement.Placement.meet`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .folding import Fold, fold_store
from .meeting import ORIGINAL
from .placement import Placement

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

__all__ = ["map_backend", "ProcessGroups"]

ORIGINAL_GET_BACKEND = dist.get_backend  # (this module is imported before install patches it)


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


class ProcessGroups:
    """``init_process_group``, ``new_group`` and ``is_nccl_available`` of one run (patched in as
    bound methods)."""

    def __init__(self, rt: Runtime, placement: Placement) -> None:
        self.rt = rt
        self.placement = placement

    def replacements(self) -> dict[str, Callable[..., Any]]:
        return {
            "init_process_group": self.init_process_group,
            "new_group": self.new_group,
            "is_nccl_available": self.is_nccl_available,
        }

    def init_process_group(self, backend: Any = None, *args: Any, **kwargs: Any) -> None:
        rt = self.rt
        device_id = kwargs.pop("device_id", None)  # gloo cannot bind a (meta-backed) CUDA device
        fold = self.placement.fold
        if fold is not None:
            self._init_folded(fold, kwargs)
        else:
            mapped = map_backend(backend) if backend is not None else "gloo"
            if backend is not None and mapped != backend:
                rt.say_once(f"torch.distributed backend {backend!r} runs as {mapped!r} (NCCL needs real GPUs)")
            ORIGINAL["init_process_group"](mapped, *args, **kwargs)
        self.placement.meet()  # every rank learns every rank's node (one message)
        if device_id is not None:
            index = device_id if isinstance(device_id, int) else torch.device(device_id).index
            if index is not None:
                rt.current_device = rt.check_device(index)

    def _init_folded(self, fold: Fold, kwargs: dict[str, Any]) -> None:
        """More GPUs than processes: torch's fake process group of the whole world, this process
        as the rank it runs (whatever the program or torchrun said), then the processes' real
        group (:mod:`.folding`)."""
        said = kwargs.get("world_size", -1)
        if said not in (-1, None, fold.world):
            self.rt.say_once(f"init_process_group(world_size={said}) runs as {fold.world} ranks (--world-size)")
        for name in ("store", "init_method", "rank", "world_size"):
            kwargs.pop(name, None)
        ORIGINAL["init_process_group"]("fake", store=fold_store(), rank=fold.rank, world_size=fold.world, **kwargs)
        self.placement.fold_in(kwargs.get("timeout"))

    def new_group(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_id", None)
        if self.placement.fold is not None:  # subgroups of the fake world are fake too
            kwargs["backend"] = "fake"
            args = args[:2]
        elif "backend" in kwargs:
            kwargs["backend"] = map_backend(kwargs["backend"])
        elif len(args) >= 3:
            args = (*args[:2], map_backend(args[2]), *args[3:])
        return ORIGINAL["new_group"](*args, **kwargs)

    def is_nccl_available(self) -> bool:
        return True

    def get_backend(self, group: Any = None) -> Any:
        """``torch.distributed.get_backend`` as the program reads it: in a folded run a group whose
        ranks live in several processes says ``gloo``, what carries its messages (as in an unfolded
        run), not torch's fake backend (torch's pipeline schedules refuse to exchange shapes
        between stages over a fake group)."""
        backend = ORIGINAL_GET_BACKEND(group)
        fold = self.placement.fold
        if fold is None or fold.processes == 1 or backend != "fake":
            return backend
        ranks = range(fold.world) if group is None else dist.get_process_group_ranks(group)
        return "gloo" if len({fold.process_of(r) for r in ranks}) > 1 else backend

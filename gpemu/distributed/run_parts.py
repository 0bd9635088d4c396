"""The parts of a run that gpemu.distributed charges time on and builds tensors with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .placement import Placement

if TYPE_CHECKING:  # pragma: no cover
    from ..cuda_api import CudaSurface
    from ..device import TensorState
    from ..runtime import Runtime
    from ..time import TimeEngine

__all__ = ["RunParts"]


@dataclass(frozen=True)
class RunParts:
    """A run's components that gpemu.distributed uses, all installed before it (the order of
    ``gpemu.runtime.COMPONENTS``)."""

    rt: Runtime
    engine: TimeEngine
    tensors: TensorState
    cuda: CudaSurface
    placement: Placement

    @classmethod
    def of(cls, rt: Runtime) -> RunParts:
        """The run's parts; its :class:`Placement` is made once, by the component's install."""
        if rt.placement is None:
            rt.placement = Placement(rt)
        return cls(rt, rt.engine, rt.tensors, rt.cuda, rt.placement)

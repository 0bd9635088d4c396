"""The parts of a run that gpemu.distributed charges time on and builds tensors with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..cuda_api import CudaSurface
    from ..engine import TimeEngine
    from ..runtime import Runtime
    from ..tensor import TensorState

__all__ = ["RunParts"]


@dataclass(frozen=True)
class RunParts:
    """A run's components that gpemu.distributed uses, all installed before it (the order of
    ``gpemu.runtime.COMPONENTS``): checked once, so nothing after tests them for None."""

    rt: Runtime
    engine: TimeEngine
    tensors: TensorState
    cuda: CudaSurface

    @classmethod
    def of(cls, rt: Runtime) -> RunParts:
        if rt.engine is None or rt.tensors is None or rt.cuda is None:
            missing = [name for name in ("engine", "tensors", "cuda") if getattr(rt, name) is None]
            raise RuntimeError(
                f"gpemu.distributed needs the run's {', '.join(missing)} installed first "
                "(gpemu.engine, gpemu.tensor and gpemu.cuda_api come before it in gpemu.runtime.COMPONENTS)"
            )
        return cls(rt, rt.engine, rt.tensors, rt.cuda)

"""Which measured GPU stands in for a GPU the profile database has not measured.

A datasheet-only GPU (an H100, an added card) has no rows of its own. Its measured model times,
input and model transfer times and memory come from its **reference GPU**: the first GPU with
measurements along its generation's donor chain (:func:`gpemu.costmodel.gpus.donor_chain`; an H100
takes the A100's, a T4 the RTX 6000's). Forward and backward are then scaled to the GPU by the
cost model (:mod:`gpemu.costs`); the other kinds are used as measured there.

One function, so that a run (:mod:`gpemu.costs`, :mod:`gpemu.transfers`, :mod:`gpemu.model_time`)
and ``gpemu show`` make the same choice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .costmodel import gpu_sheet
from .costmodel.gpus import donor_chain

if TYPE_CHECKING:
    from .db import GpuSpec

__all__ = ["reference_gpu", "measured_on"]


def reference_gpu(db: Any, spec: GpuSpec) -> GpuSpec | None:
    """The database GPU whose measurements stand in for ``spec``: ``spec`` itself when the
    database has forward measurements on it, else the first measured GPU along its generation's
    donor chain; None when no related GPU has any."""
    measured = db.measured_gpus()
    if any(g.name == spec.name for g in measured):
        return spec
    generation = spec.generation or gpu_sheet(spec).generation
    for donor in donor_chain(generation):
        for g in measured:
            if (g.generation or gpu_sheet(g).generation) == donor:
                return g
    return None


def measured_on(db: Any, gpus: Iterable[GpuSpec | None], model: str, *kinds: str) -> GpuSpec | None:
    """The first of ``gpus`` (a device's GPU, then its reference GPU) whose database rows hold
    every one of ``kinds`` for ``model``: where a run takes those measurements from. None: none
    of them has them."""
    for gpu in gpus:
        if gpu is not None and all(db.has(gpu.name, model, kind) for kind in kinds):
            return gpu
    return None

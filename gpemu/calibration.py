"""A GPU's own op-level calibration: curves fitted on its kernels (``gpemu profile --ops``).

The shipped cost model (:mod:`gpemu.costmodel`) prices ops with curves fitted per GPU
*generation* on whole-model measurements of six GPUs; any other GPU borrows a donor generation's
curves. A lab with one GPU can time representative kernels of every op class on it; the profiler
fits that GPU's curves and stores them in the profile database (``op_curves``,
:mod:`gpemu.db.op_measurements`). This module reads them back for the emulator:
:func:`model_for` returns the model that prices ops for one GPU — the shipped model with that
GPU's calibrated curves put first.

Why here and not in gpemu.costmodel: the cost model is a pure library that never reads the
database (``.importlinter``); this module sits above it and gpemu.db, below gpemu.costs.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError

from .costmodel import CostModel, GpuSheet, default_model
from .costmodel.curve import Curve
from .db.op_measurements import OpCurveRow, read_curves

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.db import ProfileDB

__all__ = ["CalibratedModel", "model_for", "curves_of", "forget"]


class CalibratedModel(CostModel):
    """``base``'s curves, except that ops on the GPU named ``gpu`` are priced with ``curves``
    ({(curve key, path): Curve}) where it has the op's exact key on the op's path.

    Only that GPU: a calibrated board must not change the prices of its generation's other GPUs
    (nor of the reference GPU gpemu.costs compares against). Keys or paths the calibration did
    not measure fall back to ``base``'s donor chain, as for an uncalibrated GPU.
    """

    def __init__(self, base: CostModel, gpu: GpuSheet, curves: Mapping[tuple[str, str], Curve]) -> None:
        super().__init__(base.params)
        self.gpu_name = gpu.name
        self.calibrated = dict(curves)

    def resolve(self, gpu: GpuSheet, key: str, path: str) -> Any:
        found = super().resolve(gpu, key, path)
        c = self.calibrated.get((key, path)) if gpu.name == self.gpu_name else None
        if c is None:
            return found
        # The base answer with this GPU's curve in it (its type stays the cost model's own).
        return dataclasses.replace(found, curve=c, generation=f"calibrated:{gpu.name}")


def curves_of(rows: Iterable[OpCurveRow]) -> dict[tuple[str, str], Curve]:
    """Stored curve rows as the cost model's :class:`Curve` objects."""
    return {(r.key, r.path): Curve(e=r.e, x0=r.x0, p=r.p, h=r.h, k0=r.k0, path=r.path) for r in rows}


# Per database object, per GPU name: the model to use. The emulator prices every op through
# model_for, so the database is read once per (database, GPU), not per op.
_CACHE: weakref.WeakKeyDictionary[Any, dict[str, CostModel]] = weakref.WeakKeyDictionary()
_last: tuple[weakref.ref, str, CostModel] | None = None  # the last answer: one GPU per run is usual


def model_for(db: ProfileDB | None, gpu: GpuSheet) -> CostModel:
    """The cost model pricing ops on ``gpu``: :func:`gpemu.costmodel.default_model` unless the
    profile database has op curves fitted for this GPU (by its name or an alias)."""
    if db is None:
        return default_model()
    last = _last
    if last is not None and last[1] == gpu.name and last[0]() is db:  # the common case: ~0.3 µs per op
        return last[2]
    per_db = _CACHE.get(db)
    if per_db is None:
        per_db = {}
        try:
            _CACHE[db] = per_db
        except TypeError:  # not weak-referenceable: just do not cache
            pass
    hit = per_db.get(gpu.name)
    if hit is not None:
        _remember(db, gpu, hit)
        return hit
    model: CostModel = default_model()
    try:
        for name in (gpu.name, *gpu.aliases):
            rows = read_curves(db.engine, name)
            if rows:
                model = CalibratedModel(default_model(), gpu, curves_of(rows))
                break
    except (SQLAlchemyError, AttributeError):  # a partial or unreachable database: the shipped model
        model = default_model()
    per_db[gpu.name] = model
    _remember(db, gpu, model)
    return model


def _remember(db: Any, gpu: GpuSheet, model: CostModel) -> None:
    global _last
    try:
        _last = (weakref.ref(db), gpu.name, model)
    except TypeError:
        _last = None


def forget(db: ProfileDB | None = None) -> None:
    """Drop cached models (of ``db``, or all): call after writing new curves in this process."""
    global _last
    _last = None
    if db is None:
        _CACHE.clear()
    else:
        _CACHE.pop(db, None)

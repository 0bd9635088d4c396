"""Fit one GPU's efficiency curves to its per-op kernel measurements (``gpemu profile --ops``).

Per (curve key, path) the measured kernels give (work, z, peak, seconds); the curve form is the
cost model's own (:func:`gpemu.costmodel.curve.kernel_arrays`, with its derivatives)::

    seconds = work / (peak e) x (1 + k0 z + (x0 SMs / work)^p)

Fitted: ``e`` (plateau), ``x0`` (half-way point, work per SM) and ``p`` (ramp shape, kept in
[0.3, 1] as costfit keeps it), by robust least squares on log(predicted / measured) — soft-L1,
as costfit's fit, so one disturbed kernel (a clock dip, another process) does not drag a curve.
Kept from the shipped model's curve for that GPU and key (``model.resolve``):

* ``k0``: the sweep runs one shape family per key (deep reductions), so the data cannot tell
  the shape term apart from ``e``; the whole-model fit saw many shapes and keeps its value.
* ``h``: host seconds to issue an op. CUDA events time the GPU only; the host side stays as the
  calibration hosts measured it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from gpemu.costmodel import CostModel, GpuSheet, default_model
from gpemu.costmodel.curve import kernel_arrays
from gpemu.costmodel.model import MATMUL_CLASSES, floor_seconds
from gpemu.db.op_measurements import OpCurveRow, OpMeasurement

__all__ = ["fit_curves", "fit_one", "floor_of", "MIN_ROWS"]

# Curve keys (before the pass suffix) the cost model prices with a bytes floor under the curve.
_FLOORED = frozenset(c.value for c in MATMUL_CLASSES)

# A curve has three free parameters; fewer distinct sizes cannot pin them down.
MIN_ROWS = 4


def fit_one(
    rows: list[OpMeasurement],
    sms: int,
    k0: float,
    h: float,
    start: tuple[float, float, float],
    floor: Sequence[float] | None = None,
) -> OpCurveRow:
    """Fit (e, x0, p) of one key's rows; ``start`` = (e, x0, p) to begin from (clipped to bounds).
    ``floor``: per row, the seconds the cost model never prices the kernel below (the matmul
    family's bytes floor): the fitted curve is the kernel's time above it, as the model prices it."""
    from scipy.optimize import least_squares

    work = np.array([r.work for r in rows], dtype=np.float64)
    peak = np.array([r.peak for r in rows], dtype=np.float64)
    z = np.array([r.z for r in rows], dtype=np.float64)
    measured = np.array([r.seconds for r in rows], dtype=np.float64)
    lk0 = np.full_like(work, np.log(max(k0, 1e-30)))
    x = work / sms
    # Bounds: e from 0.5% to 4x the datasheet peak (cuDNN's Winograd beats the FLOP count's
    # peak on 3x3 convolutions); x0 within six decades around the sweep; p as costfit keeps it.
    lo = np.array([np.log(5e-3), np.log(x.min()) - np.log(1e3), 0.3])
    hi = np.array([np.log(4.0), np.log(x.max()) + np.log(1e3), 1.0])
    theta0 = np.clip(np.array([np.log(start[0]), np.log(start[1]), start[2]]), lo + 1e-9, hi - 1e-9)

    bound = np.zeros_like(work) if floor is None else np.asarray(floor, dtype=np.float64)

    def model(theta: np.ndarray, grads: bool):
        le, lx0, p = (np.full_like(work, v) for v in theta)
        return kernel_arrays(work, peak, float(sms), le, lx0, p, lk0, z, grads=grads)

    def residuals(theta: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(model(theta, False)[0], bound)) - np.log(measured)

    def jacobian(theta: np.ndarray) -> np.ndarray:
        g, d_le, d_lx0, d_p, _ = model(theta, True)
        live = (g >= bound) / g  # a row held at the floor does not move with the curve
        return np.stack([d_le * live, d_lx0 * live, d_p * live], axis=1)

    res = least_squares(residuals, theta0, jac=jacobian, bounds=(lo, hi), loss="soft_l1", f_scale=0.05, x_scale="jac")
    le, lx0, p = (float(v) for v in res.x)
    rms = float(np.sqrt(np.mean(residuals(res.x) ** 2)))
    return OpCurveRow(
        key=rows[0].key,
        path=rows[0].path,
        e=round(float(np.exp(le)), 6),
        x0=float(f"{np.exp(lx0):.6g}"),
        p=round(p, 6),
        k0=k0,
        h=h,
        rows=len(rows),
        rms_log_error=rms,
    )


def floor_of(rows: Sequence[OpMeasurement], sheet: GpuSheet) -> list[float] | None:
    """Per row of one key, the seconds the cost model never prices it below (the matmul family's
    bytes floor, from the bytes the profiler recorded), or None for keys priced without one."""
    if not rows or rows[0].key.partition(".")[0] not in _FLOORED:
        return None
    return [float(floor_seconds(float(r.metadata.get("floor_bytes", 0.0)), sheet.memory_bandwidth)) for r in rows]


def fit_curves(
    rows: Iterable[OpMeasurement], sheet: GpuSheet, base: CostModel | None = None
) -> tuple[list[OpCurveRow], list[str]]:
    """Curves of every (key, path) with at least :data:`MIN_ROWS` distinct kernels, and notes on
    the groups left out. ``base`` (default: the shipped model) supplies k0, h and the start."""
    base = base or default_model()
    groups: dict[tuple[str, str], list[OpMeasurement]] = defaultdict(list)
    for r in rows:
        if r.seconds > 0 and r.work > 0:
            groups[(r.key, r.path)].append(r)
    curves, notes = [], []
    for (key, path), rs in sorted(groups.items()):
        if len({r.work for r in rs}) < MIN_ROWS:
            notes.append(f"{key} ({path}): {len(rs)} kernel(s), need {MIN_ROWS} sizes to fit; the shipped curve stays")
            continue
        ref = base.resolve(sheet, key, path).curve
        curves.append(fit_one(rs, sheet.sm_count, ref.k0, ref.h, (ref.e, ref.x0, ref.p), floor_of(rs, sheet)))
    return curves, notes

"""Fitting the cost model's efficiency curves to the profile database, and cross-validating them.

A tool (``gpemu.profiler``): it reads the profile database (``gpemu.db``) and the repository's
example models (:mod:`gpemu.profiler.costdata`); the library it calibrates, ``gpemu.costmodel``,
reads only the file it writes.

    python -m gpemu.profiler.costfit            # rewrite gpemu/costmodel/data/params.json
    python -m gpemu.profiler.costfit --check    # fit and compare with the shipped file, write nothing

Every measured forward (backward) time of (model, GPU, batch size) is modelled as the sum of its
forward (backward) ops' times (:mod:`~gpemu.costmodel.curve`). For each measured GPU — one per
generation — the curves of every curve key plus the overlap exponent ``q`` are fitted by robust
non-linear least squares (``scipy.optimize.least_squares``, soft-L1 loss on log(predicted /
measured), analytic Jacobian) over batch sizes 1-256, with weak priors keeping parameters of
rarely seen keys sane. GEMM curves are the exception to "data decides": their plateau is fixed to
the published large-GEMM rate (:mod:`gpemu.costmodel.published`; the CNNs' GEMMs are classifier
layers too small to show it) and their ramp is bounded (``KERNEL_RAMP_MAX``), so the fit sets only
how fast they get there, their depth term and host time; they are priced with the roofline floor
the model applies (:func:`~gpemu.costmodel.model.floor_seconds`). The measurements ran in fp32 with
PyTorch's default TF32 switches
(:data:`~gpemu.costmodel.precision.FP32`), so the A100's convolution curves are calibrated against
its TF32 tensor-core peak, every other compute curve against the FP32 peak.

Cross-validation (used for the shipped uncertainty and by ``benchmarks/estimate_accuracy.py``):

* leave-one-model-out (:func:`lomo`): each model priced by curves fitted without it, per GPU;
* leave-one-GPU-out (:func:`logo`): each GPU priced as if only its datasheet were known — its
  generation's curves removed, the donor chain supplies curves — either directly (``op model``)
  or by carrying the same model's measured time on the nearest measured GPU over with the op
  model's ratio (``transfer``).

Deterministic: same database and torch version, same file (parameters rounded to 6 digits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gpemu.costmodel import curve as C
from gpemu.costmodel.classify import COMPUTE_CLASSES
from gpemu.costmodel.gpus import DONORS, MEASURED_GENERATION_GPU, GpuSheet, gpu_sheet
from gpemu.costmodel.model import (
    INTENSITY_CLASSES,
    MATMUL_CLASSES,
    PARAMS_PATH,
    STREAMING_KEYS,
    CostModel,
    depth_mask,
    dominant_mix,
    floor_seconds,
    table_keys,
    work_and_shape,
)
from gpemu.costmodel.precision import FP32, compute_peak
from gpemu.costmodel.published import GEMM_PLATEAU_SIMT, KERNEL_RAMP_MAX, STREAM_FILL_MAX, stream_plateau
from gpemu.costmodel.table import CLASSES, OpTable, concat_tables

__all__ = [
    "FIT_BATCHES",
    "EVAL_BATCHES",
    "FitData",
    "GenFit",
    "fit_generation",
    "params_document",
    "lomo",
    "logo",
    "errors",
    "summary",
    "main",
]

FIT_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
EVAL_BATCHES = (16, 32, 64, 128, 256)
# Batch sizes below 16 pin the fixed costs; the figures that matter are 16-256.
_SMALL_WEIGHT = 0.5
_COMPUTE_CODES = [CLASSES.index(c) for c in COMPUTE_CLASSES]
# Priors (fitting form) and their weights: weak, so data decides wherever there is data.
_PRIOR = {
    "le": (math.log(0.6), 0.01),
    "lx0_compute": (math.log(1e7), 0.01),
    "lx0_memory": (math.log(3e4), 0.01),
    "p": (0.7, 0.02),
    "lh": (math.log(1.5e-5), 0.01),
    "lk0": (math.log(4.0), 0.01),
    "lk0_intensity": (math.log(0.1), 0.01),
}


@dataclass
class FitData:
    """All models' ops in one table plus the database's times at the fit and evaluation batches."""

    names: tuple[str, ...]
    table: OpTable  # model index = position in names
    keys: np.ndarray  # curve key per op
    gpus: tuple[str, ...]  # database GPU names
    measured: dict[str, np.ndarray]  # gpu -> [model, phase(0 fwd, 1 bwd), batch] at FIT_BATCHES
    measured_eval: dict[str, np.ndarray]

    @classmethod
    def build(cls, db: Any = None, progress: Callable[[str], None] | None = None) -> FitData:
        """Record (or load cached) op tables and read the measurements (``db``: a ProfileDB;
        default: the configured one)."""
        from .costdata import load_measurements, model_tables

        if db is None:
            import gpemu
            from gpemu.db import open_profile_db

            db = open_profile_db(gpemu.EmuConfig.from_env())
        models = [m.name for m in db.models()]
        tables = model_tables(progress=progress)
        names = tuple(m for m in models if m in tables)
        parts = [replace(tables[n], model=np.full(len(tables[n]), i, dtype=np.int32)) for i, n in enumerate(names)]
        table = concat_tables(parts)
        meas = load_measurements(db, names)
        measured: dict[str, np.ndarray] = {}
        measured_eval: dict[str, np.ndarray] = {}
        for g in meas.gpus:
            for store, batches in ((measured, FIT_BATCHES), (measured_eval, EVAL_BATCHES)):
                arr = np.full((len(names), 2, len(batches)), np.nan)
                for i, n in enumerate(names):
                    for ph, kind in enumerate(("forward", "backward")):
                        if (g, n, kind) in meas.series:
                            arr[i, ph] = meas.get(g, n, kind, batches)
                store[g] = arr
        return cls(
            names=names,
            table=table,
            keys=table_keys(table),
            gpus=meas.gpus,
            measured=measured,
            measured_eval=measured_eval,
        )


@dataclass
class GenFit:
    """One generation's fitted parameters (fitting form) and where they came from."""

    generation: str
    gpu: str
    keys: tuple[str, ...]
    theta: np.ndarray  # 5 per key: log e, log x0, p, log h, log k0
    paths: dict[str, str] = field(default_factory=dict)
    uses_k0: dict[str, bool] = field(default_factory=dict)
    cost: float = 0.0

    def to_json(self) -> dict[str, Any]:
        th = self.theta.reshape(-1, _NP)
        curves = {}
        for k, (le, lx0, p, lh, lk0) in zip(self.keys, th, strict=False):
            c = {"e": _r(math.exp(le)), "x0": _r(math.exp(lx0)), "p": _r(p), "h": _r(math.exp(lh))}
            if self.uses_k0.get(k, True):
                c["k0"] = _r(math.exp(lk0))
            curves[k] = {**c, "path": self.paths[k]}
        return {"gpu": self.gpu, "curves": dict(sorted(curves.items()))}


def _r(x: float) -> float:
    return float(f"{float(x):.6g}")


# ------------------------------------------------------------------------------ one generation
_NP = 5  # parameters per curve key


def _e_bounds(key: str, path: str) -> tuple[float, float]:
    """Physical range of a curve's plateau e (fraction of the peak it is priced against).

    Bounds, not just priors, because model-level sums alone leave some keys poorly determined
    (a model held out in cross-validation can be the main user of a key): a SIMT GEMM or 1x1
    convolution (a GEMM) cannot beat the FMA peak, and cuBLAS gets large GEMMs close to it;
    Winograd / FFT convolutions (3x3, large kernels) do fewer multiplies than counted, so their
    effective rate may exceed the peak, up to 2.5x.
    """
    base = key.split(".")[0]
    if path == "memory" and base == "reduction":
        # A large reduction (softmax, a loss over a vocabulary, a bias gradient) streams its input
        # once: at least half the bandwidth. The CNNs' reductions are tiny (their losses), so
        # without this bound the plateau sits wherever their per-op costs put it (0.2).
        return 0.5, 1.0
    if path == "memory":
        return 0.2, 1.0  # streaming kernels: 20-100% of the datasheet bandwidth
    if path == "tensor":
        return 0.05, 0.9  # large tensor-core GEMMs reach 80-90% of the dense peak, no more
    if base == "gemm":
        return 0.6, 1.0  # cuBLAS SGEMM reaches 85-95% of the FMA peak on large matrices
    if base == "conv1x1":
        return 0.2, 1.0
    if base == "conv_grouped":
        return 0.01, 2.5
    return 0.2, 2.5


def _is_gemm(key: str, path: str) -> bool:
    """A GEMM curve fitted on SIMT work: its plateau is the published one."""
    return key.split(".")[0] == "gemm" and path == "simt"


@dataclass
class _KeyParameters:
    """One curve key's five fitting parameters (log e, log x0, p, log h, log k0): their bounds,
    prior means and prior weights; ``fixed_e``: a plateau the fit may not move (GEMMs, streaming
    kernels); ``fixed_p``: a ramp shape it may not move (streaming kernels: a fixed fill time)."""

    lo: list[float]
    hi: list[float]
    mu: list[float]
    weight: list[float]
    fixed_e: float | None = None
    fixed_p: float | None = None


class _Problem:
    """Residuals and analytic Jacobian of one GPU's fit over a subset of models."""

    def __init__(self, data: FitData, gpu: str, train: np.ndarray, batches: Sequence[int] = FIT_BATCHES) -> None:
        if tuple(batches) != FIT_BATCHES:
            raise ValueError("fit batches must be FIT_BATCHES")
        self.sheet = gpu_sheet(gpu)
        sel = train[data.table.model]
        tab = data.table.select(sel)
        keys = data.keys[sel]
        self.keys = tuple(sorted(set(keys.tolist())))
        self.kidx = np.searchsorted(np.array(self.keys), keys)
        self._calibration_peaks(tab)
        self.batches = np.asarray(batches, dtype=float)
        self._batch_terms(tab)
        self._sequences(tab, train)
        self.nb = len(self.batches)
        train_idx = np.flatnonzero(train)
        self.nres = len(train_idx) * 2 * self.nb
        self.logm = np.log(data.measured[gpu][train_idx]).reshape(-1)
        self.valid = np.isfinite(self.logm)
        self.w = np.tile(np.where(self.batches >= 16, 1.0, _SMALL_WEIGHT), len(train_idx) * 2)
        self._parameters()

    def _calibration_peaks(self, tab: OpTable) -> None:
        """Each op's peak (fp32 with PyTorch's default TF32 switches: the A100's convolutions are
        TF32), each key's path, and which keys have a shape term."""
        self.peak = np.empty(len(tab))
        self.paths: dict[str, str] = {}
        self.uses_k0: dict[str, bool] = {}
        for k_i, k in enumerate(self.keys):
            m = self.kidx == k_i
            c = CLASSES[int(tab.cls[m][0])]
            self.uses_k0[k] = c in COMPUTE_CLASSES or c in INTENSITY_CLASSES
            if c in COMPUTE_CLASSES:
                path, pk = compute_peak(self.sheet, c, "float32", FP32)
            else:
                path, pk = "memory", self.sheet.memory_bandwidth
            self.peak[m] = pk
            self.paths[k] = path

    def _batch_terms(self, tab: OpTable) -> None:
        """Per fit batch size: each op's work and shape term, and the matmul family's roofline
        floor as the model prices it (0: none)."""
        is_comp = np.isin(tab.cls, _COMPUTE_CODES)
        has_depth = depth_mask(tab, is_comp)
        is_mm = np.isin(tab.cls, [CLASSES.index(c) for c in MATMUL_CLASSES])
        intensity = np.isin(tab.cls, [CLASSES.index(c) for c in INTENSITY_CLASSES])
        shaped = [work_and_shape(tab, b, is_comp, has_depth, intensity) for b in self.batches]
        self.work = [w for w, _ in shaped]
        self.z = [z for _, z in shaped]
        self.floor = [
            np.where(is_mm, floor_seconds(tab.nbytes(b), self.sheet.memory_bandwidth), 0.0) for b in self.batches
        ]

    def _sequences(self, tab: OpTable, train: np.ndarray) -> None:
        """The ops as sequences, one per (training model, pass), contiguous in the table."""
        local = np.searchsorted(np.flatnonzero(train), tab.model).astype(np.int64)
        seg = local * 2 + tab.backward.astype(np.int64)
        change = np.r_[True, seg[1:] != seg[:-1]]
        self.seg_start = np.flatnonzero(change)
        self.seg_id = np.cumsum(change) - 1
        self.seg_row = seg[self.seg_start]  # (model, pass) of each sequence

    def _parameters(self) -> None:
        """Bounds, priors and which parameters are free: 5 per key (log e, log x0, p, log h,
        log k0); memory keys have no k0, GEMMs a fixed plateau."""
        per_key = [self._key_parameters(k, i) for i, k in enumerate(self.keys)]
        self.nfull = _NP * len(self.keys)
        self.lo_full = np.array([x for kp in per_key for x in kp.lo])
        self.hi_full = np.array([x for kp in per_key for x in kp.hi])
        self.mu_full = np.array([x for kp in per_key for x in kp.mu])
        self.pw_full = np.array([x for kp in per_key for x in kp.weight])
        free = np.ones(self.nfull, dtype=bool)
        for i, (k, kp) in enumerate(zip(self.keys, per_key, strict=True)):
            if not self.uses_k0[k]:
                free[_NP * i + 4] = False  # no shape term
            if kp.fixed_e is not None:
                free[_NP * i] = False
                self.mu_full[_NP * i] = math.log(kp.fixed_e)
            if kp.fixed_p is not None:
                free[_NP * i + 2] = False
                self.mu_full[_NP * i + 2] = kp.fixed_p
        self.free = np.flatnonzero(free)
        self.template = self.mu_full.copy()
        self.template[~free] = math.log(1e-9)
        for i, kp in enumerate(per_key):
            if kp.fixed_e is not None:
                self.template[_NP * i] = math.log(kp.fixed_e)
            if kp.fixed_p is not None:
                self.template[_NP * i + 2] = kp.fixed_p

    def _key_parameters(self, k: str, i: int) -> _KeyParameters:
        path = self.paths[k]
        e_lo, e_hi = _e_bounds(k, path)
        x0_hi, k0_hi, h_hi = 1e12, 1e4, 3e-4
        fixed_e = None
        if path == "memory" and not self.uses_k0[k]:
            # Streaming kernels fill the GPU within KERNEL_RAMP_MAX of work at the datasheet
            # bandwidth: else x0 absorbs the CNNs' per-op costs (their reductions and copies are
            # tiny) and a large one - a transformer's bias-gradient sum over 8192 tokens - is
            # priced at a tenth of the bandwidth. (Depthwise convolutions and pooling, priced
            # by their intensity, keep the ramp the data gives them.)
            x0_hi = KERNEL_RAMP_MAX * self.sheet.memory_bandwidth / self.sheet.sm_count
        fixed_p = None
        if path == "memory" and k in STREAMING_KEYS:
            # Streaming kernels: the plateau is what such kernels reach of this generation's
            # bandwidth (published, not identifiable from the CNNs' small ops), and the ramp a
            # fixed fill time (p = 1: seconds = bytes / rate + fill) of at most STREAM_FILL_MAX.
            # A p below 1 makes the fill grow with the kernel (bytes^(1-p)): the fitted
            # reduction curve (p = 0.3) priced a 64 MiB sum at 28% of the bandwidth.
            fixed_e = stream_plateau(self.sheet.generation)
            fixed_p = 1.0
            x0_hi = STREAM_FILL_MAX * self.sheet.memory_bandwidth * fixed_e / self.sheet.sm_count
        if _is_gemm(k, path):
            # Depth term: a GEMM's rate halves at K <= 64 at the latest (below that writing its
            # output tile, not multiplying, bounds it; the roofline floor prices that). Unbounded,
            # the fit gives the classifier GEMMs k0 in the thousands (whole-model times cannot
            # place their few microseconds) and a transformer's K = 768 GEMMs a 13x slowdown.
            k0_hi = 64.0
            # Host time: eager PyTorch issues a GEMM (or its backward) in tens of microseconds;
            # unbounded, the CNNs' per-layer backward costs land on their one GEMM (0.3 ms),
            # and a transformer, with four GEMMs a layer, would be host-bound on any GPU.
            h_hi = 5e-5
            # Plateau: the published rate (not identifiable here). Ramp: at most
            # KERNEL_RAMP_MAX of work at that rate below x0, else x0 absorbs per-op costs
            # that a transformer's many GEMMs would each be charged.
            fixed_e = GEMM_PLATEAU_SIMT
            pk = float(self.peak[self.kidx == i][0])
            x0_hi = KERNEL_RAMP_MAX * pk * GEMM_PLATEAU_SIMT / self.sheet.sm_count
        return _KeyParameters(
            lo=[math.log(e_lo), math.log(1.0), 0.3, math.log(2e-6), math.log(0.01)],
            hi=[math.log(e_hi), math.log(x0_hi), 1.0, math.log(h_hi), math.log(k0_hi)],
            mu=[
                min(max(_PRIOR["le"][0], math.log(e_lo)), math.log(e_hi)),
                min(_PRIOR["lx0_memory" if path == "memory" else "lx0_compute"][0], math.log(x0_hi) - 0.1),
                _PRIOR["p"][0],
                min(_PRIOR["lh"][0], math.log(h_hi) - 0.1),
                min(_PRIOR["lk0" if path != "memory" else "lk0_intensity"][0], math.log(k0_hi) - 0.1),
            ],
            weight=[_PRIOR["le"][1], _PRIOR["lx0_compute"][1], _PRIOR["p"][1], _PRIOR["lh"][1], _PRIOR["lk0"][1]],
            fixed_e=fixed_e,
            fixed_p=fixed_p,
        )

    def full(self, x: np.ndarray) -> np.ndarray:
        th = self.template.copy()
        th[self.free] = x
        return th

    def x0(self) -> np.ndarray:
        return self.mu_full[self.free]

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self.lo_full[self.free], self.hi_full[self.free]

    def _sums(self, th: np.ndarray, jac: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Each (model, pass, batch)'s predicted seconds, and with ``jac`` their derivatives by
        every parameter."""
        params = th.reshape(-1, _NP)[self.kidx]
        le, lx0, p, lh, lk0 = (params[:, j] for j in range(_NP))
        h = np.exp(lh)
        s = np.zeros(self.nres)
        npar = self.nfull
        ds = np.zeros(self.nres * npar if jac else 0)
        cols = self.kidx * _NP
        for bi in range(self.nb):
            gout = C.kernel_arrays(
                self.work[bi], self.peak, self.sheet.sm_count, le, lx0, p, lk0, self.z[bi], grads=jac
            )
            floored = self.floor[bi] > gout[0]
            if floored.any():  # at the floor the curve's parameters do not matter
                gout = tuple(
                    np.where(floored, self.floor[bi], gout[0]) if j == 0 else np.where(floored, 0.0, d)
                    for j, d in enumerate(gout)
                )
            qout = C.queue_arrays(h, gout[0], self.seg_start, self.seg_id, grads=jac)
            rows = self.seg_row * self.nb + bi
            s[rows] = qout[0]
            if jac:
                mh, mg = qout[1], qout[2]
                base = rows[self.seg_id] * npar + cols
                size = self.nres * npar
                ds += np.bincount(base + 0, weights=mg * gout[1], minlength=size)
                ds += np.bincount(base + 1, weights=mg * gout[2], minlength=size)
                ds += np.bincount(base + 2, weights=mg * gout[3], minlength=size)
                ds += np.bincount(base + 3, weights=mh * h, minlength=size)
                ds += np.bincount(base + 4, weights=mg * gout[4], minlength=size)
        return s, (ds.reshape(self.nres, npar) if jac else None)

    def residuals(self, x: np.ndarray) -> np.ndarray:
        th = self.full(x)
        s, _ = self._sums(th, False)
        r = self.w * (np.log(s) - self.logm)
        prior = (self.pw_full * (th - self.mu_full))[self.free]
        return np.concatenate([r[self.valid], prior])

    def jacobian(self, x: np.ndarray) -> np.ndarray:
        th = self.full(x)
        s, ds = self._sums(th, True)
        j = ((self.w / s)[:, None] * ds)[:, self.free]
        jp = np.diag(self.pw_full[self.free])
        return np.vstack([j[self.valid], jp])


def fit_generation(
    data: FitData, gpu: str, train: np.ndarray | None = None, start: GenFit | None = None, max_nfev: int = 300
) -> GenFit:
    """Fit one measured GPU's curves on the models where ``train`` is true (default all)."""
    from scipy.optimize import least_squares

    train = np.ones(len(data.names), dtype=bool) if train is None else np.asarray(train, dtype=bool)
    prob = _Problem(data, gpu, train)
    th0 = prob.full(prob.x0())
    if start is not None:  # warm start: copy the keys both fits have
        pos = {k: i for i, k in enumerate(start.keys)}
        for i, k in enumerate(prob.keys):
            if k in pos:
                th0[_NP * i : _NP * i + _NP] = start.theta[_NP * pos[k] : _NP * pos[k] + _NP]
    lo, hi = prob.bounds()
    x0 = np.clip(th0[prob.free], lo + 1e-9, hi - 1e-9)
    res = least_squares(
        prob.residuals,
        x0,
        jac=prob.jacobian,
        bounds=(lo, hi),
        loss="soft_l1",
        f_scale=0.05,
        x_scale="jac",
        max_nfev=max_nfev,
        method="trf",
    )
    return GenFit(
        generation=gpu_sheet(gpu).generation,
        gpu=gpu,
        keys=prob.keys,
        theta=prob.full(res.x),
        paths=prob.paths,
        uses_k0=prob.uses_k0,
        cost=float(res.cost),
    )


def model_of(fits: dict[str, GenFit], uncertainty: dict | None = None) -> CostModel:
    """A :class:`CostModel` from fits (no file)."""
    return CostModel({"generations": {g: f.to_json() for g, f in fits.items()}, "uncertainty": uncertainty or {}})


# ------------------------------------------------------------------------------ predictions
def predict(
    model: CostModel, data: FitData, gpu: str | GpuSheet, models: Sequence[int], batches: Sequence[int] = EVAL_BATCHES
) -> np.ndarray:
    """Predicted seconds [model (in ``models`` order), phase, batch] of ``gpu``."""
    sel = np.isin(data.table.model, models)
    tab = data.table.select(sel)
    terms = model.table_terms(tab, gpu)
    out = np.zeros((len(models), 2, len(batches)))
    for bi, b in enumerate(batches):
        out[:, :, bi] = model.table_phase_seconds(tab, b, gpu, terms=terms)[np.asarray(models)]
    return out


def lomo(
    data: FitData,
    full: dict[str, GenFit],
    progress: Callable[[str, str], None] | None = None,
    gpus: Sequence[str] | None = None,
    cache: str | None = None,
) -> dict[str, np.ndarray]:
    """Leave-one-model-out predictions [model, phase, batch] at EVAL_BATCHES, per GPU: each model
    priced by its GPU's curves fitted on the other models (warm-started from the full fit).

    ``cache``: a key (e.g. the database's data version); results are kept per GPU under it and
    this package's source hash, so a rerun with the same code and data fits nothing again.
    """
    from .costdata import code_key, load_arrays, save_arrays

    out = {}
    n = len(data.names)
    for g in gpus or data.gpus:
        key = f"lomo-{code_key(cache or '', g, *data.names)}" if cache is not None else None
        hit = load_arrays(key) if key else None
        if hit is not None:
            out[g] = hit["pred"]
            if progress:
                for m in data.names:
                    progress(g, m)
            continue
        gen = gpu_sheet(g).generation
        pred = np.zeros((n, 2, len(EVAL_BATCHES)))
        for i, name in enumerate(data.names):
            if progress:
                progress(g, name)
            train = np.ones(n, dtype=bool)
            train[i] = False
            fit = fit_generation(data, g, train, start=full[gen], max_nfev=60)
            model = model_of({**{k: v for k, v in full.items() if k != gen}, gen: fit})
            pred[i] = predict(model, data, g, [i])[0]
        out[g] = pred
        if key:
            save_arrays(key, {"pred": pred})
    return out


def logo(data: FitData, full: dict[str, GenFit]) -> dict[str, dict[str, np.ndarray]]:
    """Leave-one-GPU-out predictions per GPU: ``{"op model": [...], "transfer": [...]}`` arrays
    [model, phase, batch] at EVAL_BATCHES (see the module docstring)."""
    everyone = model_of(full)
    out: dict[str, dict[str, np.ndarray]] = {}
    all_models = list(range(len(data.names)))
    for g in data.gpus:
        sheet = gpu_sheet(g)
        model = everyone.without(sheet.generation)
        direct = predict(model, data, sheet, all_models)
        # nearest measured generation in the donor chain: its measurements carried over
        donor_gen = next(d for d in DONORS[sheet.generation] if d != sheet.generation and d in full)
        donor = MEASURED_GENERATION_GPU[donor_gen]
        on_donor = predict(model, data, gpu_sheet(donor), all_models)
        transfer = data.measured_eval[donor] * direct / on_donor
        out[g] = {"op model": direct, "transfer": transfer, "donor": donor}  # type: ignore[dict-item]
    return out


def errors(pred: np.ndarray, meas: np.ndarray, total: bool = True) -> np.ndarray:
    """Relative errors pred/meas - 1 of fwd+bwd (``total``) or of each phase, [model, (phase,) batch]."""
    if total:
        return pred.sum(1) / meas.sum(1) - 1
    return pred / meas - 1


def summary(err: np.ndarray) -> dict[str, float]:
    """n, mean, median, p90 and worst of |error| (finite values only)."""
    a = np.abs(err[np.isfinite(err)])
    if not len(a):
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan, "worst": math.nan}
    return {
        "n": int(len(a)),
        "mean": float(a.mean()),
        "p50": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "worst": float(a.max()),
    }


# ------------------------------------------------------------------------------ the shipped file
def uncertainty_block(
    data: FitData,
    full: dict[str, GenFit],
    lomo_pred: dict[str, np.ndarray],
    logo_pred: dict[str, dict[str, np.ndarray]],
) -> dict[str, Any]:
    """Cross-validated |error| percentiles for ``params.json`` (fwd+bwd, batch sizes 16-256)."""
    everyone = model_of(full)
    mixes: dict[int, str] = {}
    for i in range(len(data.names)):
        tab = data.table.select(data.table.model == i)
        mixes[i] = dominant_mix(tab, everyone.table_seconds(tab, 64, "V100"))

    def block(preds: dict[str, np.ndarray], basis: str) -> dict[str, Any]:
        errs = [errors(p, data.measured_eval[g]) for g, p in preds.items()]
        allerr = np.stack(errs)  # [gpu, model, batch]
        by_mix = {}
        for mix in sorted(set(mixes.values())):
            idx = [i for i, m in mixes.items() if m == mix]
            s = summary(allerr[:, idx])
            by_mix[mix] = {"p50": round(s["p50"], 3), "p90": round(s["p90"], 3), "n": s["n"]}
        s = summary(allerr)
        return {
            "basis": basis,
            "overall": {"p50": round(s["p50"], 3), "p90": round(s["p90"], 3), "n": s["n"]},
            "by_mix": by_mix,
        }

    # The A100's leave-one-GPU-out case has no donor with tensor-core measurements, a gap no
    # datasheet GPU has (they all take the A100's tensor-core curves): left out of their figure.
    sheet_cases = {g: v["op model"] for g, v in logo_pred.items() if gpu_sheet(g).tf32_tensor_flops == 0}
    return {
        "measured_gpu": block(
            lomo_pred, f"leave-one-model-out, fwd+bwd, {len(data.names)} models x {len(lomo_pred)} GPUs x batch 16-256"
        ),
        "datasheet_gpu": block(
            sheet_cases,
            f"leave-one-GPU-out (op model), fwd+bwd, {len(data.names)} models x "
            f"{len(sheet_cases)} GPUs (A100 left out) x batch 16-256",
        ),
        # A measured time carried to another GPU by the ratio of estimates (provenance 'scaled'):
        # the same five cases, each model's measurement on the donor GPU carried over.
        "transferred_gpu": block(
            {g: logo_pred[g]["transfer"] for g in sheet_cases},
            f"leave-one-GPU-out (a measured time carried from the donor GPU), fwd+bwd, "
            f"{len(data.names)} models x {len(sheet_cases)} GPUs (A100 left out) x batch 16-256",
        ),
        "model_mix": {data.names[i]: m for i, m in mixes.items()},
    }


def params_document(data: FitData, full: dict[str, GenFit], uncertainty: dict[str, Any], db_meta: dict) -> dict:
    """The content of ``params.json``."""
    return {
        "format": 1,
        "form": (
            "per op: g = work / (peak * eff), eff = e / (1 + k0 z + (x0 / x)^p), x = work / SMs, "
            "z = 1/K (GEMM, conv) or FLOPs per byte (depthwise conv, pooling); "
            "a pass: queue of (h, g) ops, finish_i = max(h_1 + ... + h_i, finish_(i-1)) + g_i"
        ),
        "calibration": {
            "source": db_meta.get("source", ""),
            "data_version": db_meta.get("data_version", ""),
            "precision": "fp32, torch defaults: TF32 off for matmul, on for cuDNN (A100 convolutions: TF32)",
            "fit_batches": list(FIT_BATCHES),
            "models": len(data.names),
        },
        "generations": {g: f.to_json() for g, f in sorted(full.items())},
        "uncertainty": uncertainty,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpemu.profiler.costfit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(PARAMS_PATH), help="where to write the parameters (default: the shipped file)")
    ap.add_argument("--check", action="store_true", help="fit, print, and compare with the file instead of writing it")
    args = ap.parse_args(argv)
    # One BLAS thread: least_squares' SVD of a ~1000 x 100 Jacobian is ~20x slower with threads
    # contending on a busy 2-core machine. Takes effect because scipy's BLAS is not loaded yet.
    if "scipy.linalg" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import gpemu
    from gpemu.db import open_profile_db

    db = open_profile_db(gpemu.EmuConfig.from_env())
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as pb:
            t_rec = pb.add_task("recording op lists", total=None)
            data = FitData.build(db, progress=lambda n: pb.update(t_rec, description=f"recording {n}"))
            pb.update(t_rec, total=1, completed=1, description="op lists")
            t_fit = pb.add_task("fitting", total=len(data.gpus))
            full = {}
            for g in data.gpus:
                pb.update(t_fit, description=f"fitting {g}")
                f = fit_generation(data, g)
                full[f.generation] = f
                pb.advance(t_fit)
            t_cv = pb.add_task("leave-one-model-out", total=len(data.gpus) * len(data.names))
            lomo_pred = lomo(
                data,
                full,
                progress=lambda g, n: pb.update(t_cv, description=f"LOMO {g} {n}", advance=1),
                cache=db.meta().get("data_version", ""),
            )
        logo_pred = logo(data, full)
    except KeyboardInterrupt:
        print("interrupted; nothing written", file=sys.stderr)
        return 130
    doc = params_document(data, full, uncertainty_block(data, full, lomo_pred, logo_pred), db.meta())
    text = json.dumps(doc, indent=1, sort_keys=False) + "\n"
    u = doc["uncertainty"]
    print(
        f"LOMO |error| p50 {u['measured_gpu']['overall']['p50']:.1%} p90 "
        f"{u['measured_gpu']['overall']['p90']:.1%}; LOGO (A100 left out) p50 "
        f"{u['datasheet_gpu']['overall']['p50']:.1%} p90 {u['datasheet_gpu']['overall']['p90']:.1%}"
    )
    if args.check:
        try:
            same = open(args.out, encoding="utf-8").read() == text
        except FileNotFoundError:
            same = False
        print("identical to" if same else "differs from", args.out)
        return 0 if same else 1
    with open(args.out, "w", encoding="utf-8") as out:
        out.write(text)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

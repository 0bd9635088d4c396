"""The calibrated cost model: ops + GPU + precision in, seconds out.

    from gpemu.costmodel import default_model, Precision
    m = default_model()                                   # the shipped, calibrated parameters
    s = m.op_seconds(features, "H100", Precision("bfloat16"))   # one kernel's GPU time
    step = m.module_seconds(module, (x,), "A100")        # one training step's forward / backward
    t = m.ops_seconds(ops, "L4")                          # a sequence: host and GPU overlapped

Each op is priced by :mod:`~gpemu.costmodel.curve`'s form with the curve of its **curve key** —
op class, refined for dense convolutions by shape (``conv1x1``: a GEMM; ``conv_spatial``: a larger
kernel at stride 1, which cuDNN can run with Winograd / FFT algorithms; ``conv_strided``: a larger
kernel at stride > 1), and the pass (``.fwd`` / ``.bwd``) — and of its GPU's generation. Curves are
calibrated per generation against the peak the database's
measurements ran at (``path``: ``simt`` FP32, ``tensor`` for the A100's TF32 convolutions,
``memory`` for bandwidth-bound classes). A request is served by the first generation in the GPU's
donor chain (:func:`gpemu.costmodel.gpus.donor_chain`) that has a curve of that key *on the path the
op runs on*, with the requesting GPU's own peaks and SM count; this is how a datasheet-only GPU
(H100, L4, ...) and fp16/bf16 tensor-core work (calibrated only on the A100) get numbers. A curve
carried to another generation's GPU prices it against that GPU's peaks scaled by what the two SM
generations deliver of their datasheets (:func:`~gpemu.costmodel.published.carried_share`: a
Kepler SM 1/1.35 of Maxwell's and every later one's).
Substitutes when no generation has a key on that path: an embedding uses the copy's curve, a
reduction the elementwise one's, and so on (``_STANDINS``).

GEMMs and fused attention (the **matmul family**) follow one rule on every path:

* their curve is the generation's fitted GEMM curve, whose plateau is the published rate of large
  SIMT GEMMs (:mod:`~gpemu.costmodel.published`: the CNN measurements cannot identify it);
* on tensor cores (fp16/bf16, TF32 where allowed) the same curve with the tensor-core plateau for
  the GPU's generation and its half-way point ``x0`` scaled by the speed-up, so that a kernel takes
  the same *time* to fill the GPU on either unit (:meth:`CostModel.matmul_curve`);
* attention is that curve times :data:`~gpemu.costmodel.published.ATTENTION_FACTOR` (forward /
  backward), without a depth term;
* a roofline floor: never faster than moving their bytes at
  :data:`~gpemu.costmodel.published.MEMORY_PLATEAU` of the datasheet bandwidth (a GEMM with
  M = 1-16 streams its weights; a shallow-K tensor-core GEMM is bound by writing its output).

This module never imports the emulator (runtime, tensor, replay): it is a pure library.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .classify import COMPUTE_CLASSES, OpClass, OpFeatures
from .curve import Curve, kernel_arrays, kernel_seconds, queue_arrays, queue_seconds
from .gpus import GENERATIONS, GpuSheet, donor_chain, gpu_sheet, tensor_conv_share
from .precision import FP32, Precision, byte_scale, compute_peak, effective_dtype, simt_peak
from .published import (
    ATTENTION_FACTOR,
    GEMM_PLATEAU_SIMT,
    MEMORY_PLATEAU,
    carried_share,
    stream_plateau,
    tensor_plateau,
)
from .table import CLASSES, DTYPES, OpTable

__all__ = [
    "CostModel",
    "default_model",
    "curve_key",
    "table_keys",
    "PARAMS_PATH",
    "Uncertainty",
    "StepSeconds",
    "op_seconds",
    "dominant_mix",
    "dominant_mix_of",
    "INTENSITY_CLASSES",
    "MATMUL_CLASSES",
    "STREAMING_KEYS",
    "work_and_shape",
    "depth_mask",
    "floor_seconds",
]

PARAMS_PATH = Path(__file__).resolve().parent / "data" / "params.json"

# Substitute keys (without the pass suffix), tried in order when no generation in the chain has
# the op's own key on the path it runs on.
_STANDINS: dict[str, tuple[str, ...]] = {
    "embedding": ("copy", "elementwise"),
    "conv_grouped": ("conv_spatial",),
    "conv_depthwise": ("conv_grouped",),
    "conv_strided": ("conv_spatial", "conv1x1"),
    "conv1x1": ("conv_spatial",),
    "conv_spatial": ("conv_strided",),
    "reduction": ("elementwise",),
    "pooling": ("elementwise",),
    "copy": ("elementwise",),
    "norm": ("elementwise",),
}


# Convolutions that run on tensor cores (:func:`~gpemu.costmodel.gpus.tensor_conv_share`).
_TENSOR_CONVS = frozenset({OpClass.CONV, OpClass.CONV_GROUPED})
# Memory-priced classes whose shape term is their arithmetic intensity (see curve.py).
INTENSITY_CLASSES = frozenset({OpClass.CONV_DEPTHWISE, OpClass.POOLING})
# The matmul family: one GEMM curve per generation and pass, a roofline floor (module docstring).
MATMUL_CLASSES = frozenset({OpClass.GEMM, OpClass.ATTENTION})
# Streaming kernels (curve keys): each byte read or written once, so a large one runs at the
# bandwidth a streaming kernel reaches on its GPU (:func:`~gpemu.costmodel.published.stream_plateau`
# of the GPU's own generation, whichever generation's curve prices it). Not a reduction's backward
# (softmax's reads its inputs twice: 45% of the bandwidth on a real H100) nor norms (several passes).
STREAMING_KEYS = frozenset({"elementwise.fwd", "elementwise.bwd", "copy.fwd", "copy.bwd", "reduction.fwd"})


def depth_mask(table: OpTable, is_comp: np.ndarray) -> np.ndarray:
    """Ops whose curve has a reduction-depth term: compute ops with a K, attention excepted."""
    att = table.cls == CLASSES.index(OpClass.ATTENTION)
    return is_comp & ~att & ((table.reduction > 0) | (table.reduction1 > 0))


def floor_seconds(nbytes: np.ndarray | float, bandwidth: float) -> np.ndarray | float:
    """The matmul family's roofline floor: seconds to move ``nbytes`` at the best streaming rate
    (:data:`~gpemu.costmodel.published.MEMORY_PLATEAU` of ``bandwidth``, bytes/s)."""
    return nbytes / (bandwidth * MEMORY_PLATEAU)


def work_and_shape(
    table: OpTable,
    batch: float,
    is_comp: np.ndarray,
    has_depth: np.ndarray,
    intensity: np.ndarray,
    scale: np.ndarray | float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-op work (FLOPs or bytes x ``scale``) and shape term z at ``batch`` (see curve.py):
    1/K for ops with a reduction depth (``has_depth``, :func:`depth_mask`), FLOPs per byte for
    ``intensity`` ops, else 0."""
    flops = table.flops(batch)
    nbytes = table.nbytes(batch) * scale
    work = np.where(is_comp, flops, nbytes)
    depth = table.depth(batch)
    kinv = np.where(has_depth & (depth > 0), 1.0 / np.maximum(depth, 1.0), 0.0)
    z = np.where(is_comp, kinv, np.where(intensity, flops / np.maximum(nbytes, 1e-30), 0.0))
    return work, z


def _conv_key(kernel: int, stride: int) -> str:
    if kernel == 1:
        return "conv1x1"
    return "conv_spatial" if stride == 1 else "conv_strided"


def curve_key(op: OpFeatures) -> str:
    """The curve an op is priced with, e.g. ``"conv_spatial.bwd"``, ``"norm.fwd"``."""
    base = _conv_key(op.kernel, op.stride) if op.op_class is OpClass.CONV else op.op_class.value
    return base + (".bwd" if op.backward else ".fwd")


def table_keys(table: OpTable) -> np.ndarray:
    """:func:`curve_key` of every op of a table (a string array)."""
    base = np.array([c.value for c in CLASSES], dtype=object)[table.cls]
    conv = table.cls == CLASSES.index(OpClass.CONV)
    k1 = conv & (table.kernel == 1)
    base = base.copy()
    base[conv & ~k1 & (table.stride == 1)] = "conv_spatial"
    base[conv & ~k1 & (table.stride != 1)] = "conv_strided"
    base[k1] = "conv1x1"
    suffix = np.where(table.backward.astype(bool), ".bwd", ".fwd")
    return (base.astype(str).astype(object) + suffix).astype(str)


@dataclass(frozen=True)
class Uncertainty:
    """Typical relative error of an estimate: median and 90th percentile of |error| (fractions) in
    cross-validation, and what they were measured on."""

    p50: float
    p90: float
    basis: str
    # What of the estimate the cross-validation did not cover, "" when it did: the figure then
    # comes from models unlike this one (say so wherever it is printed: :attr:`labelled`).
    unchecked: str = ""

    def __str__(self) -> str:
        return f"±{100 * self.p50:.0f}% (p90 {100 * self.p90:.0f}%)"

    @property
    def labelled(self) -> str:
        """The figure, and where it comes from when that is not models like this one."""
        return f"{self} (checked on {_CHECKED_ON}: {self.unchecked})" if self.unchecked else str(self)


# What the cross-validation figures were measured on: the profile database's models (torchvision's
# ImageNet CNNs), timed in fp32.
_CHECKED_ON = "fp32 CNNs"
_FP32 = "float32"


@dataclass(frozen=True)
class StepSeconds:
    """Estimated GPU seconds of one training step's forward and backward."""

    forward: float
    backward: float
    uncertainty: Uncertainty | None = None

    @property
    def total(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class _Resolved:
    curve: Curve
    generation: str


@dataclass(frozen=True)
class _Priced:
    """How one kind of op is priced on one GPU: its curve, the peak it applies to, whether a
    roofline floor applies (matmul family) and the bandwidth it is taken at, the generation that
    supplied the curve. Peak and bandwidth are the GPU's datasheet figures, scaled by
    :func:`~gpemu.costmodel.published.carried_share` when the curve is another generation's."""

    curve: Curve
    peak: float
    floor: bool
    generation: str
    bandwidth: float


class CostModel:
    """Calibrated per-generation efficiency curves (see the module docstring).

    ``params`` is the parsed ``params.json``: ``{"generations": {gen: {"gpu": name, "curves":
    {key: {"e", "x0", "p", "h", "k0", "path"}}}}, "uncertainty": {...}, ...}``.
    """

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = dict(params)
        self.generations: dict[str, dict[str, Curve]] = {}
        for gen, g in params.get("generations", {}).items():
            self.generations[gen] = {
                k: Curve(e=v["e"], x0=v["x0"], p=v["p"], h=v["h"], k0=v.get("k0", 0.0), path=v.get("path", "simt"))
                for k, v in g["curves"].items()
            }
        self._memo: dict[tuple, _Resolved] = {}
        self._priced_memo: dict[tuple, _Priced] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, path: str | Path | None = None) -> CostModel:
        """The model in ``path`` (default: the shipped ``data/params.json``)."""
        with open(path or PARAMS_PATH, encoding="utf-8") as f:
            return cls(json.load(f))

    def without(self, *generations: str) -> CostModel:
        """The same model with some generations' curves removed (to price a GPU as if unmeasured)."""
        p = dict(self.params)
        p["generations"] = {g: v for g, v in self.params.get("generations", {}).items() if g not in generations}
        return CostModel(p)

    # ------------------------------------------------------------------ curve lookup
    def resolve(self, gpu: GpuSheet, key: str, path: str) -> _Resolved:
        """The curve pricing ``key`` on ``path`` for ``gpu``: own key first through the donor
        chain, then substitutes, then any path as a last resort."""
        memo_key = (gpu.generation, key, path)
        hit = self._memo.get(memo_key)
        if hit is not None:
            return hit
        base, _, phase = key.partition(".")
        chain = donor_chain(gpu.generation)
        other = "fwd" if phase == "bwd" else "bwd"
        bases = (
            (base,)
            + _STANDINS.get(base, ())
            + tuple(s2 for s in _STANDINS.get(base, ()) for s2 in _STANDINS.get(s, ()))
        )
        found: _Resolved | None = None
        for want_path in (path, None):
            for b in bases:
                for ph in (phase, other):
                    for gen in chain:
                        c = self.generations.get(gen, {}).get(f"{b}.{ph}")
                        if c is not None and (want_path is None or c.path == want_path):
                            found = _Resolved(c, gen)
                            break
                    if found:
                        break
                if found:
                    break
            if found:
                break
        if found is None:
            raise KeyError(f"no calibrated curve for {key} ({path}) in generations {', '.join(self.generations)}")
        self._memo[memo_key] = found
        return found

    # ------------------------------------------------------------------ single ops
    def matmul_curve(self, sheet: GpuSheet, op_class: OpClass, phase: str, path: str, peak: float) -> _Resolved:
        """The curve of a GEMM (or fused attention) on ``path`` at ``peak`` for ``sheet``: the
        generation's fitted GEMM curve for that pass (``phase``: ``"fwd"`` / ``"bwd"``); on tensor
        cores, unless a tensor-core GEMM curve was fitted, that curve with the tensor-core plateau
        of the GPU's generation and ``x0`` times the speed-up (plateau x peak over the SIMT
        curve's), i.e. the same time to fill the GPU; for attention times its factor, no depth term."""
        r = self.resolve(sheet, "gemm." + phase, path)
        curve = r.curve
        if path == "tensor" and curve.path != "tensor":
            curve = tensor_from_simt(curve, sheet, peak)
        if op_class is OpClass.ATTENTION:
            curve = replace(curve, e=curve.e * ATTENTION_FACTOR[phase], k0=0.0)
        return _Resolved(curve, r.generation)

    def priced(self, sheet: GpuSheet, op_class: OpClass, dtype: str, precision: Precision, key: str) -> _Priced:
        """How ops of ``op_class`` / ``dtype`` / curve ``key`` are priced on ``sheet`` in ``precision``."""
        memo_key = (sheet, op_class, dtype, precision, key)
        hit = self._priced_memo.get(memo_key)
        if hit is not None:
            return hit
        phase = key.partition(".")[2] or "fwd"
        if op_class in COMPUTE_CLASSES:
            eff_dtype = effective_dtype(dtype, precision)
            path, peak = compute_peak(sheet, op_class, eff_dtype, precision)
            if op_class in MATMUL_CLASSES:
                r = self.matmul_curve(sheet, op_class, phase, path, peak)
                curve, floor = r.curve, True
            else:
                r = self.resolve(sheet, key, path)
                curve, floor = r.curve, False
                if path == "tensor" and r.curve.path == "simt":
                    # No tensor-core curve of this kind in reach (only when generations are
                    # removed, as in leave-one-GPU-out): carried over from its SIMT curve as a
                    # GEMM's is, with the GEMM family's bytes floor (8x the rate makes bytes matter).
                    curve, floor = tensor_from_simt(r.curve, sheet, peak), True
                if path == "tensor" and op_class in _TENSOR_CONVS:
                    # (another generation's curve: what cuDNN delivers of this GPU's tensor cores)
                    peak *= tensor_conv_share(sheet.generation, key, r.generation)
        else:
            r = self.resolve(sheet, key, "memory")
            curve, floor, peak = r.curve, False, sheet.memory_bandwidth
            if key in STREAMING_KEYS and curve.path == "memory" and r.generation in GENERATIONS:
                # (a GPU's own kernel measurements, gpemu profile --ops, keep the plateau they show)
                curve = replace(curve, e=stream_plateau(sheet.generation))
        share = carried_share(sheet.generation, r.generation)
        hit = _Priced(curve, peak * share, floor, r.generation, sheet.memory_bandwidth * share)
        self._priced_memo[memo_key] = hit
        return hit

    def _price(self, op: OpFeatures, sheet: GpuSheet, precision: Precision) -> tuple[float, float]:
        pr = self.priced(sheet, op.op_class, op.dtype, precision, curve_key(op))
        scale = byte_scale(op.dtype, precision)
        if op.op_class in COMPUTE_CLASSES:
            work = op.flops
            z = 1.0 / op.reduction if op.reduction > 0 and op.op_class is not OpClass.ATTENTION else 0.0
        else:
            work = op.nbytes * scale
            z = op.flops / work if op.op_class in INTENSITY_CLASSES and work > 0 else 0.0
        g = kernel_seconds(work, pr.peak, sheet.sm_count, pr.curve, z)
        if pr.floor:
            g = max(g, float(floor_seconds(op.nbytes * scale, pr.bandwidth)))
        return pr.curve.h, g

    def op_seconds(self, op: OpFeatures, gpu: str | GpuSheet | Any, precision: Precision = FP32) -> float:
        """GPU seconds of one op's kernel(s) (0 for free ops). ``gpu``: a name / alias, a
        :class:`GpuSheet` or a ``gpemu.db.GpuSpec``.

        This is device time only: the host's time to issue the op is not in it (an emulated
        program's host time is real). For a whole forward/backward pass, whose measured time also
        shows the host where it could not keep up, use :meth:`ops_seconds`.
        """
        if op.op_class is OpClass.FREE:
            return 0.0
        return self._price(op, gpu_sheet(gpu), precision)[1]

    def host_seconds(self, op: OpFeatures, gpu: str | GpuSheet | Any, precision: Precision = FP32) -> float:
        """Host seconds to issue one op, as the calibration hosts (eager PyTorch) took (0 for free ops)."""
        if op.op_class is OpClass.FREE:
            return 0.0
        return self._price(op, gpu_sheet(gpu), precision)[0]

    def ops_seconds(self, ops: Iterable[OpFeatures], gpu: str | GpuSheet | Any, precision: Precision = FP32) -> float:
        """Seconds of a sequence of ops issued one after another (a forward or a backward pass):
        host and GPU time overlapped as a queue (:func:`~gpemu.costmodel.curve.queue_seconds`)."""
        sheet = gpu_sheet(gpu)
        return queue_seconds(self._price(o, sheet, precision) for o in ops if o.op_class is not OpClass.FREE)

    # ------------------------------------------------------------------ many ops
    def table_terms(self, table: OpTable, gpu: str | GpuSheet | Any, precision: Precision = FP32) -> dict[str, Any]:
        """Per-op pricing inputs that do not depend on the batch size (arrays: is_comp, peak, bw
        (the bandwidth of a roofline floor), scale, le, lx0, p, h, lk0, has_depth (ops with a
        reduction-depth term), intensity (1 for ops whose shape term is their FLOPs per byte), floor
        (matmul-family ops, which have a roofline floor :func:`floor_seconds`); and the generation
        that supplied each op's curve)."""
        sheet = gpu_sheet(gpu)
        keys = table_keys(table)
        n = len(table)
        is_comp = np.isin(table.cls, [CLASSES.index(c) for c in COMPUTE_CLASSES])
        peak, scale, bw = np.empty(n), np.ones(n), np.empty(n)
        le, lx0, p, h, lk0 = (np.empty(n) for _ in range(5))
        floor = np.zeros(n, dtype=bool)
        gens = np.empty(n, dtype=object)
        combos: dict[tuple, list[int]] = {}
        for i, (k, c, d) in enumerate(zip(keys, table.cls, table.dtype, strict=False)):
            combos.setdefault((k, int(c), int(d)), []).append(i)
        for (k, c, d), idx_list in combos.items():
            idx = np.asarray(idx_list)
            cls, dtype = CLASSES[c], DTYPES[d]
            pr = self.priced(sheet, cls, dtype, precision, k)
            scale[idx] = byte_scale(dtype, precision)
            peak[idx] = pr.peak
            bw[idx] = pr.bandwidth
            le[idx], lx0[idx], p[idx], h[idx] = np.log(pr.curve.e), np.log(pr.curve.x0), pr.curve.p, pr.curve.h
            lk0[idx] = np.log(max(pr.curve.k0, 1e-30))
            floor[idx] = pr.floor
            gens[idx] = pr.generation
        intensity = np.isin(table.cls, [CLASSES.index(c) for c in INTENSITY_CLASSES])
        return {
            "sms": sheet.sm_count,
            "bw": bw,
            "is_comp": is_comp,
            "peak": peak,
            "scale": scale,
            "le": le,
            "lx0": lx0,
            "p": p,
            "h": h,
            "lk0": lk0,
            "has_depth": depth_mask(table, is_comp),
            "intensity": intensity,
            "floor": floor,
            "gens": gens,
        }

    def table_seconds(
        self,
        table: OpTable,
        batch: float,
        gpu: str | GpuSheet | Any,
        precision: Precision = FP32,
        terms: Mapping[str, Any] | None = None,
    ) -> np.ndarray:
        """GPU seconds of every op of ``table`` at ``batch`` (pass ``terms`` from
        :meth:`table_terms` to price many batch sizes without resolving curves again)."""
        tm = terms if terms is not None else self.table_terms(table, gpu, precision)
        work, z = work_and_shape(table, batch, tm["is_comp"], tm["has_depth"], tm["intensity"], tm["scale"])
        g = kernel_arrays(work, tm["peak"], tm["sms"], tm["le"], tm["lx0"], tm["p"], tm["lk0"], z, grads=False)[0]
        fl = tm["floor"]
        if fl.any():
            g[fl] = np.maximum(g[fl], floor_seconds(table.nbytes(batch)[fl] * tm["scale"][fl], tm["bw"][fl]))
        return g

    def table_phase_seconds(
        self,
        table: OpTable,
        batch: float,
        gpu: str | GpuSheet | Any,
        precision: Precision = FP32,
        terms: Mapping[str, Any] | None = None,
    ) -> np.ndarray:
        """Queue time of each (model, pass) sequence of ``table`` at ``batch``: an array
        [model, 2] (forward, backward) over ``0 .. table.model.max()``. Ops of one model and pass
        must be contiguous and in order, as recording leaves them."""
        tm = terms if terms is not None else self.table_terms(table, gpu, precision)
        g = self.table_seconds(table, batch, gpu, precision, tm)
        n_models = int(table.model.max()) + 1 if len(table) else 0
        seg = table.model.astype(np.int64) * 2 + table.backward.astype(np.int64)
        starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
        seg_id = np.cumsum(np.r_[False, seg[1:] != seg[:-1]])
        t = queue_arrays(tm["h"], g, starts, seg_id, grads=False)[0]
        out = np.zeros(n_models * 2)
        out[seg[starts]] = t
        return out.reshape(n_models, 2)

    # ------------------------------------------------------------------ whole steps
    def module_seconds(
        self,
        module: Any,
        args: tuple,
        gpu: str | GpuSheet | Any,
        precision: Precision = FP32,
        kwargs: dict | None = None,
        backward: bool = True,
    ) -> StepSeconds:
        """Forward and backward seconds of ``module(*args, **kwargs)`` recorded once on the meta
        device (the module is not modified; put it in ``train()`` mode for a training step)."""
        from .record import record_step

        sheet = gpu_sheet(gpu)
        step = record_step(module, args, kwargs, backward=backward)
        fwd = self.ops_seconds(step.forward, sheet, precision)
        bwd = self.ops_seconds(step.backward, sheet, precision)
        ops = step.forward + step.backward
        mix = dominant_mix_of(ops, [self.op_seconds(o, sheet, precision) for o in ops])
        return StepSeconds(fwd, bwd, self.uncertainty(sheet, mix))

    def transfer_seconds(
        self,
        measured: float,
        table: OpTable,
        batch: float,
        phase: str,
        from_gpu: str | GpuSheet | Any,
        to_gpu: str | GpuSheet | Any,
        precision: Precision = FP32,
        from_precision: Precision = FP32,
    ) -> float:
        """A measured forward/backward time on one GPU carried to another GPU (or precision) by the
        ratio of the model's estimates on both (Habitat-style): model-specific errors shared by
        both GPUs cancel. ``phase``: ``"forward"`` or ``"backward"``."""
        i = 0 if phase == "forward" else 1
        src = float(self.table_phase_seconds(table, batch, from_gpu, from_precision)[:, i].sum())
        dst = float(self.table_phase_seconds(table, batch, to_gpu, precision)[:, i].sum())
        return measured * dst / src if src > 0 else dst

    # ------------------------------------------------------------------ uncertainty
    def uncertainty(
        self, gpu: str | GpuSheet | Any, mix: str | None = None, transferred: bool = False, precision: str | None = None
    ) -> Uncertainty | None:
        """Cross-validated error of an estimate on ``gpu``: leave-one-model-out figures for a GPU
        whose curves were fitted on its own measurements, leave-one-GPU-out figures for any other
        (a datasheet GPU, even of a calibrated generation: the T4 takes the RTX 6000's curves);
        ``transferred``: a measured time carried from another GPU by the ratio of estimates
        (:meth:`transfer_seconds`, provenance ``scaled``), whose error is the leave-one-GPU-out
        error of that transfer (falls back to the op model's where the fit did not record it);
        ``mix`` (see :func:`dominant_mix`) narrows to models whose time is dominated by that kind
        of op when the fit recorded it; ``precision``: the dtype most of the priced work ran in
        (the figures were measured in fp32: another is said to be unchecked)."""
        u = self.params.get("uncertainty")
        if not u:
            return None
        sheet = gpu_sheet(gpu)
        measured = self.params.get("generations", {}).get(sheet.generation, {}).get("gpu") == sheet.name
        name = "measured_gpu" if measured else "datasheet_gpu"
        if transferred and u.get("transferred_gpu"):
            name = "transferred_gpu"
        block = u.get(name) or {}
        entry = (block.get("by_mix") or {}).get(mix) if mix else None
        basis = str(block.get("basis", ""))
        unchecked = []
        if entry is None and mix:
            # No calibration model is dominated by this kind of work (GEMM-heavy ones: the
            # database holds CNNs): the overall figure stands in, and the basis says so.
            basis += f"; no measured model is dominated by {mix} work, so nothing checked this kind"
            unchecked.append(f"no {mix}-dominated model checked")
        if precision is not None and precision != _FP32:
            basis += f"; measured in fp32 only, this work ran in {precision}"
            unchecked.append(f"{precision} not checked")
        entry = entry or block.get("overall")
        if not entry:
            return None
        return Uncertainty(float(entry["p50"]), float(entry["p90"]), basis, ", ".join(unchecked))


_MIX_GROUPS = {
    "dense_conv": (OpClass.CONV,),
    "light_conv": (OpClass.CONV_GROUPED, OpClass.CONV_DEPTHWISE),
    "gemm": (OpClass.GEMM, OpClass.ATTENTION),
}


def tensor_from_simt(curve: Curve, sheet: GpuSheet, peak: float) -> Curve:
    """A tensor-core curve (against ``peak``) for work of which only a SIMT curve (against the FP32
    rate) was calibrated. The kernel keeps its standing relative to a large GEMM on the same units:
    its plateau is ``e`` x the tensor-core GEMM plateau of the generation (published) / the SIMT
    one, never above the tensor-core GEMM plateau (cuDNN's Winograd and FFT algorithms, which lift
    SIMT convolutions above 1, do not run on tensor cores); the same time to fill the GPU (``x0``
    times the speed-up). For a GEMM curve (plateau = the SIMT GEMM plateau) this is the
    tensor-core GEMM plateau itself."""
    e_gemm = tensor_plateau(sheet.generation)
    e_t = min(curve.e * e_gemm / GEMM_PLATEAU_SIMT, e_gemm)
    speed = (peak * e_t) / (simt_peak(sheet, "float32") * curve.e)
    return replace(curve, e=e_t, x0=curve.x0 * max(speed, 1.0), path="tensor")


def dominant_mix(table: OpTable, seconds: np.ndarray) -> str:
    """Which kind of work takes most of the GPU time: ``dense_conv``, ``light_conv`` (grouped and
    depthwise), ``gemm`` or ``memory`` (everything bandwidth-bound). Uncertainty is kept per mix."""
    shares = {
        k: float(seconds[np.isin(table.cls, [CLASSES.index(c) for c in v])].sum()) for k, v in _MIX_GROUPS.items()
    }
    shares["memory"] = float(seconds.sum()) - sum(shares.values())
    return max(shares, key=lambda k: shares[k])


def dominant_mix_of(ops: Iterable[OpFeatures], seconds: Iterable[float]) -> str:
    """:func:`dominant_mix` of a list of ops and their GPU seconds."""
    shares = dict.fromkeys([*_MIX_GROUPS, "memory"], 0.0)
    for op, t in zip(ops, seconds, strict=False):
        group = next((k for k, v in _MIX_GROUPS.items() if op.op_class in v), "memory")
        shares[group] += t
    return max(shares, key=lambda k: shares[k])


@lru_cache(maxsize=1)
def default_model() -> CostModel:
    """The shipped model (``data/params.json``), loaded once."""
    return CostModel.load()


def op_seconds(op: OpFeatures, gpu: str | GpuSheet | Any, precision: Precision = FP32) -> float:
    """:meth:`CostModel.op_seconds` of the shipped model."""
    return default_model().op_seconds(op, gpu, precision)

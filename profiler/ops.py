"""``gpemu profile --ops``: time representative kernels of every op class on one GPU.

The cost model (:mod:`gpemu.costmodel`) prices an op with its **curve key**'s efficiency curve
(``gemm.fwd``, ``conv_spatial.bwd``, ``norm.fwd``, ...; see ``curve.py``): ``work / (peak x
eff(work / SMs))``. A curve is a function of work per SM, so this sweep runs, per curve key, one
kernel at sizes spanning the curve's ramp (too small to fill the GPU) and plateau; per compute
key once in fp32 with PyTorch's default TF32 switches (SIMT FP32, or TF32 tensor cores for
convolutions on Ampere and later) and once in fp16 where the GPU has fp16 tensor cores (the
``tensor`` path). Each kernel's work (FLOPs or bytes) and shape term are what the cost model
itself counts: the same call is recorded on the meta device with the cost model's
:class:`~gpemu.costmodel.OpRecorder`, so definitions cannot drift apart.

Timing (CUDA events, real code; under ``gpemu.patch`` the same calls time emulated GPU time):

* warm-up launches first (cuDNN picks its algorithm, the caching allocator settles);
* every sample starts behind a *blocker* (large matrix products enqueued first) so that the host
  has queued all of the sample's launches before the GPU reaches the start event: the events then
  bracket back-to-back kernels, not the host's launch gaps. ``start.query()`` still false after
  the last launch proves it; otherwise the blocker doubles and the sample is taken again;
* short kernels are launched several times per sample (events resolve ~0.5 µs);
* the figure stored is the median of the samples (p10 / p90 kept).

Ops the kernels cannot name by pass: autograd's matrix products and copies are plain ``mm`` /
``clone``. The ``gemm.bwd`` sweep runs the backward's layouts (a transposed operand) and is
recorded as backward work, as the cost model's training-step recording marks it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from gpemu.costmodel import COMPUTE_CLASSES, GpuSheet, OpFeatures, OpRecorder, Precision, curve_key
from gpemu.costmodel.model import INTENSITY_CLASSES
from gpemu.costmodel.precision import byte_scale, compute_peak, effective_dtype
from gpemu.db.op_measurements import OpMeasurement

__all__ = [
    "KernelSpec",
    "Blocker",
    "OP_CLASSES",
    "CLASS_GROUPS",
    "sweep",
    "features_of",
    "work_of",
    "time_kernel",
    "measure_kernels",
    "SWEEP_PRECISION",
    "parse_classes",
]

aten = torch.ops.aten

# The switches every fp32 kernel runs under: PyTorch's defaults, the ones the cost model's
# fp32 prices assume (TF32 off for matmul, on for cuDNN convolutions).
SWEEP_PRECISION = Precision(dtype="float32", allow_tf32_matmul=False, allow_tf32_cudnn=True)

# Curve-key bases the sweep measures (those the shipped model has curves for).
OP_CLASSES: tuple[str, ...] = (
    "gemm",
    "conv1x1",
    "conv_spatial",
    "conv_strided",
    "conv_grouped",
    "conv_depthwise",
    "norm",
    "elementwise",
    "reduction",
    "pooling",
    "copy",
)
# Shorthands accepted by --classes.
CLASS_GROUPS: dict[str, tuple[str, ...]] = {
    "conv": ("conv1x1", "conv_spatial", "conv_strided"),
    "compute": ("gemm", "conv1x1", "conv_spatial", "conv_strided", "conv_grouped"),
    "memory": ("conv_depthwise", "norm", "elementwise", "reduction", "pooling", "copy"),
    "all": OP_CLASSES,
}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel to time: its curve key, dtype, a label, and ``build(device)`` which allocates
    the inputs on ``device`` and returns the zero-argument launch."""

    key: str
    dtype: torch.dtype
    label: str
    build: Callable[[torch.device], Callable[[], Any]]

    @property
    def backward(self) -> bool:
        return self.key.endswith(".bwd")


def parse_classes(names: Sequence[str]) -> tuple[str, ...]:
    """``("conv", "norm")`` -> the curve-key bases to sweep; raises ValueError naming the valid ones."""
    out: list[str] = []
    for raw in names:
        for name in (n.strip().lower() for n in raw.split(",")):
            if not name:
                continue
            if name in CLASS_GROUPS:
                out.extend(CLASS_GROUPS[name])
            elif name in OP_CLASSES:
                out.append(name)
            else:
                raise ValueError(f"unknown op class {name!r}; valid: {', '.join(OP_CLASSES + tuple(CLASS_GROUPS))}")
    return tuple(dict.fromkeys(out)) or OP_CLASSES


# ------------------------------------------------------------------------------ the kernels
def _rand(device: torch.device, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype)


def _pick(full: list[int], quick: bool) -> list[int]:
    """Quick mode: about five sizes still spanning the whole range (both ends kept)."""
    if not quick or len(full) <= 5:
        return full
    idx = sorted({round(i * (len(full) - 1) / 4) for i in range(5)})
    return [full[i] for i in idx]


def _gemm(n: int, dtype: torch.dtype, backward: bool) -> KernelSpec:
    def build(dev: torch.device) -> Callable[[], Any]:
        a, b = _rand(dev, (n, n), dtype), _rand(dev, (n, n), dtype)
        if backward:  # grad_input = grad_output @ weight: the backward's transposed operand
            return lambda: aten.mm.default(a, b.t())
        return lambda: aten.mm.default(a, b)

    return KernelSpec("gemm.bwd" if backward else "gemm.fwd", dtype, f"mm {n}x{n}x{n}", build)


@dataclass(frozen=True)
class _Conv:
    base: str
    c_in: int
    c_out: int
    hw: int
    kernel: int
    stride: int
    groups: int
    batches: tuple[int, ...]


_CONVS = (
    _Conv("conv1x1", 256, 256, 28, 1, 1, 1, (1, 2, 4, 8, 16, 32, 64, 128)),
    _Conv("conv_spatial", 128, 128, 56, 3, 1, 1, (1, 2, 4, 8, 16, 32, 64)),
    _Conv("conv_strided", 128, 256, 56, 3, 2, 1, (1, 2, 4, 8, 16, 32, 64)),
    _Conv("conv_grouped", 256, 256, 28, 3, 1, 32, (1, 2, 4, 8, 16, 32, 64, 128)),
    _Conv("conv_depthwise", 256, 256, 56, 3, 1, 256, (1, 2, 4, 8, 16, 32, 64)),
)


def _conv(c: _Conv, batch: int, dtype: torch.dtype, backward: bool) -> KernelSpec:
    pad = c.kernel // 2

    def build(dev: torch.device) -> Callable[[], Any]:
        x = _rand(dev, (batch, c.c_in, c.hw, c.hw), dtype)
        w = _rand(dev, (c.c_out, c.c_in // c.groups, c.kernel, c.kernel), dtype)
        args = ([c.stride] * 2, [pad] * 2, [1, 1], False, [0, 0], c.groups)
        if not backward:
            return lambda: aten.convolution.default(x, w, None, *args)
        out_hw = (c.hw + 2 * pad - c.kernel) // c.stride + 1
        go = _rand(dev, (batch, c.c_out, out_hw, out_hw), dtype)
        # Input and weight gradients, as every layer but the first one asks for.
        return lambda: aten.convolution_backward.default(go, x, w, None, *args, [True, True, False])

    key = f"{c.base}.{'bwd' if backward else 'fwd'}"
    return KernelSpec(key, dtype, f"conv k{c.kernel} s{c.stride} g{c.groups} {batch}x{c.c_in}x{c.hw}x{c.hw}", build)


_ELEMENTS = [1 << s for s in range(12, 27, 2)]  # 4 Ki .. 64 Mi fp32 elements (16 KiB .. 256 MiB)


def _memory(base: str, n: int, backward: bool) -> KernelSpec:
    def build(dev: torch.device) -> Callable[[], Any]:
        if base == "norm":
            # What nn.BatchNorm2d runs: F.batch_norm and its autograd backward (on CUDA PyTorch
            # picks cuDNN's kernels where it would for a model), on planes of a convolutional
            # network's size (up to 28x28, 64 channels). The native kernels called directly on
            # 8x8 planes reached 12% of an H100's bandwidth and priced BN-heavy models 50% slow.
            side = math.isqrt(min(n // 64, 28 * 28))
            x = _rand(dev, (max(1, n // (64 * side * side)), 64, side, side))
            w, b = _rand(dev, (64,)), _rand(dev, (64,))
            rm, rv = torch.zeros(64, device=dev), torch.ones(64, device=dev)
            if not backward:
                return lambda: F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
            inputs = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_())
            y = F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
            go = _rand(dev, y.shape)
            return lambda: torch.autograd.grad(y, inputs, go, retain_graph=True)
        if base == "elementwise":
            a, b = _rand(dev, (n,)), _rand(dev, (n,))
            if not backward:
                return lambda: aten.add.Tensor(a, b)
            return lambda: aten.threshold_backward.default(a, b, 0.0)  # ReLU's backward
        if base == "reduction":
            x = _rand(dev, (n // 1024, 1024))
            if not backward:
                return lambda: aten.sum.dim_IntList(x, [1])
            y = _rand(dev, x.shape)
            return lambda: aten._softmax_backward_data.default(x, y, 1, torch.float32)
        if base == "pooling":
            x = _rand(dev, (n // 4096, 16, 16, 16))
            geo = ([3, 3], [2, 2], [1, 1], [1, 1], False)
            if not backward:
                return lambda: aten.max_pool2d_with_indices.default(x, *geo)
            out, idx = aten.max_pool2d_with_indices.default(x, *geo)
            go = _rand(dev, out.shape)
            return lambda: aten.max_pool2d_with_indices_backward.default(go, x, *geo, idx)
        if base == "copy":
            a, b = _rand(dev, (n // 2,)), _rand(dev, (n // 2,))
            if not backward:
                return lambda: aten.cat.default([a, b])
            return lambda: aten.clone.default(a)
        raise ValueError(base)

    return KernelSpec(f"{base}.{'bwd' if backward else 'fwd'}", torch.float32, f"{base} {n} elements", build)


def sweep(sheet: GpuSheet, classes: Sequence[str] = OP_CLASSES, quick: bool = False) -> list[KernelSpec]:
    """The kernels to time on ``sheet``'s GPU for the curve-key bases in ``classes``."""
    half = [torch.float16] if sheet.fp16_tensor_flops > 0 else []  # the tensor-core path, where it exists
    specs: list[KernelSpec] = []
    for backward in (False, True):
        if "gemm" in classes:
            for dtype in [torch.float32, *half]:
                specs += [_gemm(n, dtype, backward) for n in _pick([128, 256, 512, 1024, 2048, 4096, 8192], quick)]
        for c in _CONVS:
            if c.base not in classes:
                continue
            dtypes = [torch.float32] if c.base == "conv_depthwise" else [torch.float32, *half]
            for dtype in dtypes:
                specs += [_conv(c, b, dtype, backward) for b in _pick(list(c.batches), quick)]
        for base in ("norm", "elementwise", "reduction", "pooling", "copy"):
            if base in classes:
                specs += [_memory(base, n, backward) for n in _pick(_ELEMENTS, quick)]
    return specs


# ------------------------------------------------------------------------------ what the model counts
def features_of(spec: KernelSpec) -> OpFeatures:
    """The cost model's features of ``spec``'s kernel, recorded on the meta device.

    Raises ValueError when the call is not exactly one op of the spec's curve key (a sweep bug)."""
    fn = spec.build(torch.device("meta"))
    rec = OpRecorder()
    rec.backward = spec.backward
    with rec:
        fn()
    if len(rec.ops) != 1 or curve_key(rec.ops[0]) != spec.key:
        got = ", ".join(f"{o.name} ({curve_key(o)})" for o in rec.ops) or "no kernel"
        raise ValueError(f"{spec.label}: expected one {spec.key} op, recorded {got}")
    return rec.ops[0]


def work_of(op: OpFeatures, sheet: GpuSheet, precision: Precision = SWEEP_PRECISION) -> tuple[str, float, float, float]:
    """(path, peak, work, z) of ``op`` on ``sheet``: the quantities ``CostModel`` prices with
    (``gpemu.costmodel.model.CostModel._price``): compute classes by FLOPs against the peak their
    dtype and TF32 switches select, the rest by bytes against memory bandwidth."""
    if op.op_class in COMPUTE_CLASSES:
        path, peak = compute_peak(sheet, op.op_class, effective_dtype(op.dtype, precision), precision)
        return path, peak, op.flops, (1.0 / op.reduction if op.reduction > 0 else 0.0)
    work = op.nbytes * byte_scale(op.dtype, precision)
    z = op.flops / work if op.op_class in INTENSITY_CLASSES and work > 0 else 0.0
    return "memory", sheet.memory_bandwidth, work, z


# ------------------------------------------------------------------------------ timing
class Blocker:
    """Large matrix products enqueued before a sample so the GPU is busy while the host launches
    the sample's kernels (see the module docstring); ``grow`` doubles it."""

    def __init__(self, device: torch.device) -> None:
        self.a = torch.randn(2048, 2048, device=device)
        self.out = torch.empty_like(self.a)
        self.count = 1

    def run(self) -> None:
        for _ in range(self.count):
            torch.mm(self.a, self.a, out=self.out)

    def grow(self) -> bool:
        if self.count >= 1024:
            return False
        self.count *= 2
        return True


@dataclass
class Timing:
    """Seconds per launch of one kernel: every sample, and whether the blocker covered them all."""

    samples: list[float]
    inner: int
    covered: bool
    blocker: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples))


def _sample(fn: Callable[[], Any], inner: int, device: torch.device, blocker: Blocker) -> tuple[float, bool]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while True:
        torch.cuda.synchronize(device)
        blocker.run()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        # Still false: the GPU had not reached `start` when the last launch was queued, so the
        # events bracket back-to-back kernels only.
        covered = not start.query()
        end.synchronize()
        if covered or not blocker.grow():
            return start.elapsed_time(end) / 1000.0 / inner, covered


def time_kernel(
    fn: Callable[[], Any],
    device: torch.device,
    warmup: int = 3,
    repeats: int = 10,
    blocker: Blocker | None = None,
    target_seconds: float = 2e-4,
) -> Timing:
    """Seconds per launch of ``fn`` on CUDA ``device``: ``warmup`` launches, then ``repeats``
    samples of ``inner`` back-to-back launches each (``inner`` chosen so a sample lasts about
    ``target_seconds``, at most 64)."""
    blocker = blocker or Blocker(device)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    first, covered = _sample(fn, 1, device, blocker)
    inner = int(min(64, max(1, math.ceil(target_seconds / max(first, 1e-9)))))
    samples = []
    for _ in range(repeats):
        s, ok = _sample(fn, inner, device, blocker)
        samples.append(s)
        covered = covered and ok
    return Timing(samples, inner, covered, blocker.count)


def _percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def measure_kernels(
    specs: Sequence[KernelSpec],
    sheet: GpuSheet,
    device: torch.device,
    warmup: int = 3,
    repeats: int = 10,
    progress: Callable[[KernelSpec], None] | None = None,
) -> list[OpMeasurement]:
    """Time every kernel of ``specs`` on ``device`` under :data:`SWEEP_PRECISION`'s switches
    (restored afterwards) and return one row each."""
    if device.type != "cuda":
        raise ValueError(f"op profiling times CUDA kernels with CUDA events; {device} is not a CUDA device")
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = SWEEP_PRECISION.allow_tf32_matmul
    torch.backends.cudnn.allow_tf32 = SWEEP_PRECISION.allow_tf32_cudnn
    rows: list[OpMeasurement] = []
    try:
        with torch.cuda.device(device):
            blocker = Blocker(device)
            for spec in specs:
                op = features_of(spec)
                path, peak, work, z = work_of(op, sheet)
                fn = spec.build(device)
                t = time_kernel(fn, device, warmup, repeats, blocker)
                del fn
                # floor_bytes: what the matmul family's roofline floor moves (opsfit models it)
                meta = {
                    "inner": t.inner,
                    "blocker_matmuls": t.blocker,
                    "covered": t.covered,
                    "floor_bytes": op.nbytes * byte_scale(op.dtype, SWEEP_PRECISION),
                    "tf32_matmul": SWEEP_PRECISION.allow_tf32_matmul,
                    "tf32_cudnn": SWEEP_PRECISION.allow_tf32_cudnn,
                    "torch": torch.__version__,
                    "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
                }
                rows.append(
                    OpMeasurement(
                        key=spec.key,
                        path=path,
                        dtype=op.dtype,
                        shape=spec.label,
                        op=op.name,
                        work=work,
                        z=z,
                        seconds=t.median,
                        samples=len(t.samples),
                        peak=peak,
                        sm_count=sheet.sm_count,
                        p10=_percentile(t.samples, 0.1),
                        p90=_percentile(t.samples, 0.9),
                        metadata=meta,
                    )
                )
                if progress is not None:
                    progress(spec)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    return rows


# ------------------------------------------------------------------------------ the whole run
@dataclass
class OpsReport:
    """What one ``gpemu profile --ops`` run did."""

    gpu: str
    measured: int
    curves: list[Any]  # OpCurveRow of every fitted (key, path)
    notes: list[str]
    uncovered: list[str]  # kernels whose samples may include host launch gaps


def device_sheet(
    store: Any, device: torch.device, gpu_name: str | None = None, log: Callable[[str], None] = lambda m: None
) -> GpuSheet:
    """The datasheet the emulator will price this GPU with, so fit and use divide by the same
    peaks: the database's spec of the GPU (by ``gpu_name`` or the device's name), else the cost
    model's table, else a spec measured here and added to the database."""
    from gpemu.costmodel import find_gpu, gpu_sheet

    from .device import device_memory, measure_gpu_spec

    name = (gpu_name or "").strip() or torch.cuda.get_device_name(device)
    spec = store.gpu(name)
    if spec is not None:
        return gpu_sheet(spec)
    hit = find_gpu(name)
    if hit is not None:
        return hit
    log(f"'{name}' is new to the database: measuring its peak rates for a spec first")
    spec = measure_gpu_spec(device, name, device_memory(device, None))
    store.add_gpu(spec)
    return gpu_sheet(spec)


def profile_ops(
    store: Any,
    device: torch.device,
    gpu_name: str | None = None,
    classes: Sequence[str] = OP_CLASSES,
    quick: bool = False,
    warmup: int = 3,
    repeats: int = 10,
    progress: Callable[[str], None] | None = None,
    set_total: Callable[[int], None] | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> OpsReport:
    """Time the sweep on ``device``, store the rows (per curve key, one transaction each), fit
    the GPU's curves from everything stored for it and store them (``store``: a
    :class:`~gpemu.profiler.store.ProfileStore`)."""
    from gpemu.db.op_measurements import read_measurements, write_curves, write_measurements

    from .opsfit import fit_curves

    sheet = device_sheet(store, device, gpu_name, log)
    specs = sweep(sheet, classes, quick)
    if set_total is not None:
        set_total(len(specs))
    engine = store.db.engine
    measured, uncovered = 0, []
    by_key: dict[str, list[KernelSpec]] = {}
    for s in specs:
        by_key.setdefault(s.key, []).append(s)
    for group in by_key.values():
        rows = measure_kernels(
            group, sheet, device, warmup, repeats, progress=(lambda s: progress(s.key)) if progress else None
        )
        measured += write_measurements(engine, sheet.name, rows)
        uncovered += [f"{r.key} {r.shape}" for r in rows if not r.metadata.get("covered", True)]
    curves, notes = fit_curves(read_measurements(engine, sheet.name), sheet)
    write_curves(engine, sheet.name, curves)
    from gpemu.calibration import forget

    forget()  # a model cached in this process must see the new curves
    return OpsReport(sheet.name, measured, curves, notes, uncovered)

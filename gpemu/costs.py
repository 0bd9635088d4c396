"""What GPU work costs, in seconds, with where the number comes from.

* Identified models (``gpemu.identify``): forward/backward seconds are looked up in the profile
  database for (GPU, model, batch size) — provenance ``measured`` / ``interpolated`` /
  ``extrapolated`` as the database says (:func:`model_times`). A GPU without measurements of its
  own (a datasheet GPU such as the H100) takes its **reference GPU**'s (:func:`reference_gpu`:
  the nearest measured generation), and :mod:`gpemu.model_time` carries them over with the cost
  model's ratio of the ops the call ran (this GPU and precision vs the reference GPU in fp32):
  provenance ``scaled``. The same ratio scales a measured fp32 model run under autocast or TF32.
* Unknown models: priced by the ops they run (:mod:`gpemu.model_time` runs the cost model's pass
  arithmetic over every op the recorded call's forward and backward dispatch), provenance
  ``estimated`` with the cost model's cross-validated uncertainty (:func:`uncertainty`).
* Single ops: :func:`op_price` — the calibrated op-level cost model (:mod:`gpemu.costmodel`):
  each op classified (GEMM, convolution, attention, normalisation, elementwise...), priced by its
  class's efficiency curve for this GPU's generation against the peak its dtype and PyTorch's TF32
  switches select (tensor cores for fp16/bf16/TF32 where the GPU has them).
* Optimizer step: the database's ``optimizer_step`` kind when present, else bytes the update
  touches (parameters, gradients, optimizer state) over memory bandwidth; without a modelled
  host, its launches queued behind the calibration hosts' per-op issue time, as any pass.

Every answer for (identity, batch size, device) is memoised: replay asks on every call.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .calibration import model_for
from .costmodel import FP32, GpuSheet, OpClass, OpFeatures, OpRecorder, Precision, classify, default_model, gpu_sheet
from .costmodel.measured_loop import measured_loss_ops, parameter_bookkeeping_ops
from .costmodel.model import Uncertainty, dominant_mix_of
from .costmodel.table import OpTable
from .db.records import ARTIFACT_SOURCE
from .identify import ModelIdentity
from .reference import measured_on
from .reference import reference_gpu as find_reference

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.db import GpuSpec

    from .runtime import Runtime

__all__ = [
    "CostState",
    "OpPrice",
    "ModelTimes",
    "forward_seconds",
    "kernel_price",
    "backward_seconds",
    "model_times",
    "reference_gpu",
    "optimizer_step_seconds",
    "optimizer_step_launches",
    "optimizer_step_host_seconds",
    "StepHostTime",
    "StepLaunches",
    "multi_tensor_launches",
    "op_price",
    "op_seconds",
    "table_pricer",
    "attention_price",
    "accumulate_price",
    "uncertainty",
    "precision",
    "PROVENANCE_ORDER",
    "LAUNCH_LATENCY",
    "BANDWIDTH_EFFICIENCY",
]

# Per-kernel cost floor of an optimizer's kernels: a CUDA kernel launch + minimal execution.
LAUNCH_LATENCY = 4e-6
# Streaming kernels (an optimizer's updates) reach roughly this share of the datasheet bandwidth.
BANDWIDTH_EFFICIENCY = 0.7
PROVENANCE_ORDER = ("measured", "interpolated", "extrapolated", "scaled", "estimated")
_HALF = ("float16", "bfloat16")


def _worst(a: str, b: str) -> str:
    return a if PROVENANCE_ORDER.index(a) >= PROVENANCE_ORDER.index(b) else b


class OpPrice(NamedTuple):
    """What one op costs (:func:`op_price`)."""

    gpu: float  # its kernel's seconds on this GPU, in the precision it ran in
    host: float  # seconds the cost model's calibration hosts took to issue it
    reference: float  # its kernel's seconds as the database measured: fp32 on the reference GPU
    mix: str  # the kind of work: dense_conv, light_conv, gemm or memory (uncertainty)
    precision: str = "float32"  # the dtype it ran in (uncertainty: the figures were measured in fp32)
    op: OpFeatures | None = None  # what was priced (a recording prices it again at other sizes)


_NOTHING = OpPrice(0.0, 0.0, 0.0, "memory")


@dataclass(frozen=True)
class ModelTimes:
    """An identified model's seconds at one batch size from the profile database."""

    forward: float
    backward: float
    provenance: str  # the database's: measured / interpolated / extrapolated
    gpu: str  # the GPU they were measured on: the device's own, or its reference GPU


@dataclass
class _Device:
    """How one emulated device's ops are priced."""

    sheet: GpuSheet  # its datasheet (the cost model's view of the GPU)
    reference: GpuSpec | None  # the database GPU its measured times come from (None: none)
    reference_sheet: GpuSheet  # that GPU's datasheet (the device's own when None)


@dataclass
class CostState:
    """What one run has worked out about costs (``rt.costs``, made on first use)."""

    memo: dict = field(default_factory=dict)  # (identity, batch, device) -> ModelTimes | None
    # (parameter shapes, sheet, batch) -> seconds of the measured loop's loss and per-parameter kernels there
    bookkeeping: dict = field(default_factory=dict)
    devices: dict = field(default_factory=dict)  # device -> _Device
    # optimizer -> (its parameter lists' key, (seconds, provenance))
    optimizers: weakref.WeakKeyDictionary[Any, tuple] = field(default_factory=weakref.WeakKeyDictionary)
    # (optimizer class, dtype, first group's settings) -> what its own step moves (see
    # _implementation_traffic)
    traffic: dict = field(default_factory=dict)
    # optimizer -> (its parameter lists' key, StepLaunches)
    launches: weakref.WeakKeyDictionary[Any, tuple] = field(default_factory=weakref.WeakKeyDictionary)
    # (optimizer class, settings) -> StepHostTime | None (see _step_host_time)
    step_host: dict = field(default_factory=dict)
    # optimizer -> (its parameter lists' and settings' key, host seconds of one step)
    step_host_s: weakref.WeakKeyDictionary[Any, tuple] = field(default_factory=weakref.WeakKeyDictionary)


def _st(rt: Runtime) -> CostState:
    st = rt.costs
    if st is None:
        st = rt.costs = CostState()
    return st


# --------------------------------------------------------------------------------- GPUs
def reference_gpu(rt: Runtime, device: int) -> GpuSpec | None:
    """The database GPU whose measurements stand in for ``device`` (:func:`gpemu.reference.reference_gpu`,
    worked out once per device); None without any."""
    return _device(rt, device).reference


def _device(rt: Runtime, device: int) -> _Device:
    st = _st(rt)
    hit = st.devices.get(device)
    if hit is not None:
        return hit
    spec = rt.gpus[device]
    sheet = gpu_sheet(spec)
    reference = None
    if rt.db is not None:
        try:
            reference = find_reference(rt.db, spec)
        except Exception:  # a partial or unreachable database: price by ops
            reference = None
    hit = st.devices[device] = _Device(sheet, reference, gpu_sheet(reference) if reference is not None else sheet)
    return hit


# --------------------------------------------------------------------------------- models
def model_times(rt: Runtime, identity: ModelIdentity, batch_size: int, device: int) -> ModelTimes | None:
    """The database's forward/backward seconds of ``identity`` at ``batch_size`` for ``device``:
    measured on its own GPU, else on its reference GPU (:func:`reference_gpu`; the caller scales
    them by the ops' ratio). None: the database cannot say (unknown model, or not measured
    there): the model is priced by its ops."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    memo = _st(rt).memo
    key = (identity, batch_size, device)
    if key in memo:
        return memo[key]
    # First use: database look-ups, and recording the measured loop's own ops (it imports torch's
    # compiler stack once): the emulator's set-up, never the program's time (a CUDA event around
    # a measured model's first call read 0.7-1.2 s instead of 4.9 ms on a busy host).
    engine = getattr(rt, "engine", None)  # (a bare runtime of the cost tests has none)
    if engine is not None:
        result = engine.setup_call(_lookup_times, rt, identity, batch_size, device)
    else:
        result = _lookup_times(rt, identity, batch_size, device)
    memo[key] = result
    return result


def _lookup_times(rt: Runtime, identity: ModelIdentity, batch: int, device: int) -> ModelTimes | None:
    if identity.parts:
        found = [_lookup_times(rt, p, batch, device) for p in identity.parts]
        parts = [p for p in found if p is not None]
        if len(parts) != len(found) or len({p.gpu for p in parts}) != 1:
            return None
        prov = "measured"
        for p in parts:
            prov = _worst(prov, p.provenance)
        return ModelTimes(sum(p.forward for p in parts), sum(p.backward for p in parts), prov, parts[0].gpu)
    if identity.name is None or rt.db is None:
        return None
    gpu = measured_on(rt.db, (rt.gpus[device], reference_gpu(rt, device)), identity.name, "forward", "backward")
    if gpu is None:
        return None
    fwd = rt.db.lookup(gpu.name, identity.name, batch, "forward")
    bwd = rt.db.lookup(gpu.name, identity.name, batch, "backward")
    backward = bwd.value
    if ARTIFACT_SOURCE in rt.db.sources(gpu.name, identity.name, "backward"):
        backward = _model_backward(rt, identity, gpu, device, batch, fwd.value, backward)
    return ModelTimes(fwd.value, backward, _worst(fwd.provenance, bwd.provenance), gpu.name)


def _model_backward(
    rt: Runtime, identity: ModelIdentity, gpu: GpuSpec, device: int, batch: int, forward: float, measured: float
) -> float:
    """The model's own backward pass in a backward the shipped database measured: that loop's
    backward also computed the loss, zeroed and accumulated every gradient and ran an SGD step
    (:mod:`gpemu.costmodel.measured_loop`), which an emulated program runs, and is charged for,
    as its own ops and optimizer step. Their price on the GPU the time was measured on comes off;
    never below the forward (a backward pass does at least its forward's work)."""
    d = _device(rt, device)
    sheet = d.sheet if gpu.name == rt.gpus[device].name else d.reference_sheet
    st = _st(rt)
    key = (identity.param_shapes, sheet, batch)
    extra = st.bookkeeping.get(key)
    if extra is None:
        model = model_for(rt.db, sheet)
        extra = model.ops_seconds(measured_loss_ops(batch), sheet, FP32)
        if identity.param_shapes:
            extra += model.ops_seconds(parameter_bookkeeping_ops(identity.param_shapes), sheet, FP32)
        st.bookkeeping[key] = extra
    return max(measured - extra, forward)


def forward_seconds(rt: Runtime, identity: ModelIdentity, batch_size: int, device: int) -> tuple[float, str]:
    """The database's seconds of one forward pass of ``identity`` at ``batch_size`` for
    ``device`` and their provenance (see :func:`model_times`; ``(0.0, "estimated")`` when it has
    none: the model is priced by the ops it runs)."""
    times = model_times(rt, identity, batch_size, device)
    return (times.forward, times.provenance) if times is not None else (0.0, "estimated")


def backward_seconds(rt: Runtime, identity: ModelIdentity, batch_size: int, device: int) -> tuple[float, str]:
    """As :func:`forward_seconds`, for the backward pass."""
    times = model_times(rt, identity, batch_size, device)
    return (times.backward, times.provenance) if times is not None else (0.0, "estimated")


def uncertainty(
    rt: Runtime,
    device: int,
    mix: dict[str, float] | None = None,
    transferred: bool = False,
    precisions: dict[str, float] | None = None,
) -> Uncertainty | None:
    """The cost model's cross-validated error for an estimate on ``device``'s GPU; ``mix``: GPU
    seconds per kind of work of the ops priced (the dominant kind narrows the figure);
    ``transferred``: a measured time carried from another GPU by the cost model's ratio
    (provenance ``scaled``), whose error is the leave-one-GPU-out error of such transfers;
    ``precisions``: GPU seconds per dtype of the ops priced (one other than the figures' fp32
    makes the figure say so: :attr:`Uncertainty.unchecked`)."""
    dominant = max(mix, key=lambda k: mix[k]) if mix else None
    precision = max(precisions, key=lambda k: precisions[k]) if precisions else None
    return default_model().uncertainty(
        _device(rt, device).sheet, dominant, transferred=transferred, precision=precision
    )


# --------------------------------------------------------------------------------- single ops
def precision() -> Precision:
    """The process's precision switches now: PyTorch's TF32 flags (ops carry their own dtype;
    autocast has already cast them when they are dispatched)."""
    return Precision.from_torch()


def _as_fp32(op: OpFeatures) -> OpFeatures:
    """``op`` as it would run in fp32 (the database's measurements): a half-precision op moves
    twice the bytes."""
    if op.dtype not in _HALF:
        return op
    return replace(op, dtype="float32", nbytes=op.nbytes * 2)


def _price(rt: Runtime, device: int, op: OpFeatures) -> OpPrice:
    if op.op_class is OpClass.FREE:
        return _NOTHING
    d = _device(rt, device)
    model = model_for(rt.db, d.sheet)  # the shipped model, or this GPU's own (gpemu profile --ops)
    prec = precision()
    gpu = model.op_seconds(op, d.sheet, prec)
    host = model.host_seconds(op, d.sheet, prec)
    ref_op = _as_fp32(op)
    if ref_op is op and prec == FP32 and d.reference_sheet is d.sheet:
        reference = gpu  # exactly as measured: the ratio is 1
    else:
        reference = model.op_seconds(ref_op, d.reference_sheet, FP32)
    return OpPrice(gpu, host, reference, dominant_mix_of((op,), (1.0,)), op.dtype, op)


def op_price(
    rt: Runtime, func: Any, args: tuple, kwargs: dict | None, out: Any, device: int, backward: bool | None = None
) -> OpPrice:
    """What one aten op costs on ``device`` (:class:`OpPrice`), whether or not a whole-module
    charge covers it. Views and metadata cost nothing. ``backward``: True for an op of a
    backward pass (priced with the backward curves, as the cost model was calibrated), None to
    tell by its name (``*_backward``)."""
    return _price(rt, device, classify(func, args, kwargs or {}, out, backward=backward))


def kernel_price(rt: Runtime, device: int, op: OpFeatures) -> OpPrice:
    """What one kernel described by its features costs on ``device`` (a kernel no single aten op
    is: a compiler's fused pointwise/reduction kernel, priced by the bytes at its boundary)."""
    return _price(rt, device, op)


def table_pricer(rt: Runtime, device: int, table: OpTable) -> Callable[[float], tuple[np.ndarray, np.ndarray]]:
    """Prices of many ops whose features are affine in one variable (an :class:`OpTable`, e.g.
    a decode step's ops against its cache length): ``at(x)`` gives each op's GPU seconds on
    ``device`` and the host seconds to issue it, as :func:`op_price` prices one op (the curves
    are resolved once)."""
    d = _device(rt, device)
    model = model_for(rt.db, d.sheet)
    prec = precision()
    terms = model.table_terms(table, d.sheet, prec)
    host = np.asarray(terms["h"], dtype=float)

    def at(x: float) -> tuple[np.ndarray, np.ndarray]:
        return model.table_seconds(table, x, d.sheet, prec, terms), host

    return at


def op_seconds(rt: Runtime, func: Any, args: tuple, kwargs: dict | None, out: Any, device: int) -> float:
    """GPU seconds of one aten op on ``device`` (0 inside a module/optimizer charge: covered)."""
    engine = rt.engine
    if engine is not None and engine.in_charged_scope:
        return 0.0
    return op_price(rt, func, args, kwargs, out, device).gpu


def attention_price(
    rt: Runtime,
    device: int,
    batch_heads: int,
    length: int,
    source: int,
    head_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    causal: bool,
    backward: bool,
    *,
    kv_batch_heads: int | None = None,
    density: float | None = None,
) -> OpPrice:
    """One fused attention kernel (flash, memory-efficient, cuDNN or FlexAttention's) over
    ``batch_heads`` heads of ``length`` queries and ``source`` keys: two matrix products forward,
    five backward (the scores are recomputed); a causal mask skips half of the blocks.
    ``kv_batch_heads``: the key/value heads read (fewer with grouped-query attention; default as
    many as the query's); ``density``: the fraction of score blocks computed (a block mask's; it
    replaces the causal half)."""
    computed = density if density is not None else (0.5 if causal else 1.0)
    flops = 2.0 * batch_heads * length * source * (head_dim + value_dim) * computed
    if backward:
        flops *= 2.5
    element = dtype.itemsize
    kv_heads = batch_heads if kv_batch_heads is None else kv_batch_heads
    nbytes = (batch_heads * length * (head_dim + value_dim) + kv_heads * source * (head_dim + value_dim)) * element
    if backward:
        nbytes *= 2
    name = "_scaled_dot_product_flash_attention" + ("_backward" if backward else "")
    return _price(
        rt,
        device,
        OpFeatures(name, OpClass.ATTENTION, backward, flops, float(nbytes), str(dtype).replace("torch.", "")),
    )


def rnn_price(
    rt: Runtime,
    device: int,
    gates: int,
    steps: int,
    batch: int,
    input_size: int,
    hidden: int,
    layers: int,
    directions: int,
    dtype: torch.dtype,
    backward: bool,
    rows: int | None = None,
) -> OpPrice:
    """A whole multi-layer RNN as cuDNN runs it (``_cudnn_rnn``; ``gates``: 4 LSTM, 3 GRU, 1 RNN):
    per layer and direction one GEMM projecting every timestep's input, then per timestep one
    recurrent GEMM of ``batch`` rows (small: latency-bound) and the gates' pointwise math. The
    backward runs the recurrence back (the same GEMMs on the gradients), one GEMM for the input
    gradient and one per weight matrix for the weight gradients over all timesteps. ``rows``: the
    timesteps' rows in all (a packed sequence's; ``steps x batch`` otherwise)."""
    d = str(dtype).replace("torch.", "")
    element = dtype.itemsize
    n = gates * hidden
    gpu = host = reference = 0.0

    def add(op: OpFeatures, times: int = 1) -> None:
        nonlocal gpu, host, reference
        p = _price(rt, device, op)
        gpu += times * p.gpu
        reference += times * p.reference
        host = host or p.host  # one call from the host's side

    def gemm(m: int, k: int, cols: int, times: int = 1) -> None:
        add(
            OpFeatures(
                "mm",
                OpClass.GEMM,
                backward,
                2.0 * m * k * cols,
                float((m * k + k * cols + m * cols) * element),
                d,
                reduction=k,
            ),
            times,
        )

    rows = steps * batch if rows is None else rows
    for layer in range(layers):
        k_in = input_size if layer == 0 else hidden * directions
        for _ in range(directions):
            gemm(rows, k_in, n)  # input projection (backward: the input's gradient)
            gemm(batch, hidden, n, steps)  # the recurrence, one step at a time
            add(
                OpFeatures(
                    "rnn_cell",
                    OpClass.ELEMENTWISE,
                    backward,
                    float(batch * n),
                    float(batch * (n + 4 * hidden) * element),
                    d,
                ),
                steps,
            )
            if backward:
                gemm(k_in, rows, n)  # weight gradients, over all timesteps at once
                gemm(hidden, rows, n)
    return OpPrice(gpu, host, reference, "gemm", d)


def copy_price(rt: Runtime, device: int, nbytes: int, dtype: torch.dtype, backward: bool = False) -> OpPrice:
    """A gather/scatter kernel that reads and writes ``nbytes`` in all (packing a sequence)."""
    d = str(dtype).replace("torch.", "")
    element = dtype.itemsize
    return _price(
        rt, device, OpFeatures("copy", OpClass.COPY, backward, float(nbytes // (2 * element)), float(nbytes), d)
    )


def accumulate_price(rt: Runtime, device: int, nbytes: int, dtype: torch.dtype) -> OpPrice:
    """Autograd's accumulation of a new gradient of ``nbytes`` into a parameter's existing one
    (``grad += new``, one elementwise backward kernel reading both and writing one)."""
    d = str(dtype).replace("torch.", "")
    return _price(
        rt, device, OpFeatures("add_", OpClass.ELEMENTWISE, True, float(nbytes // dtype.itemsize), 3.0 * nbytes, d)
    )


# --------------------------------------------------------------------------------- optimizer
# Optimizer state tensors per parameter (read and written every step).
def _state_tensors(optimizer: torch.optim.Optimizer) -> int:
    # A subclass (a program's own SGD with logging) keeps its torch base class's state: the first
    # class of its MRO that torch.optim defines.
    name = next(
        (c.__name__ for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")),
        type(optimizer).__name__,
    )
    g = optimizer.defaults
    if name == "SGD":
        return 1 if g.get("momentum", 0) else 0
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        return 3 if g.get("amsgrad") else 2
    if name == "RMSprop":
        return 1 + (1 if g.get("momentum", 0) else 0) + (1 if g.get("centered") else 0)
    if name in ("Adagrad", "Adadelta", "Rprop", "ASGD"):
        return 1 if name == "Adagrad" else 2
    return 2


def optimizer_step_seconds(rt: Runtime, optimizer: torch.optim.Optimizer, device: int) -> tuple[float, str]:
    """GPU seconds of one ``optimizer.step()`` over its parameters on ``device``."""
    cache = _st(rt).optimizers
    # Keyed on the groups' parameter lists (identity and length), not on every parameter: this
    # runs at every step, and walking ~500 parameters would cost ~15 µs of host time each time.
    key = (device, tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups))
    hit = cache.get(optimizer)
    if hit is not None and hit[0] == key:
        return hit[1]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    result = _optimizer_seconds(rt, optimizer, params, device)
    try:
        cache[optimizer] = (key, result)
    except TypeError:
        pass
    return result


def _optimizer_seconds(rt: Runtime, optimizer: torch.optim.Optimizer, params: list, device: int) -> tuple[float, str]:
    spec = rt.gpus[device]
    # A sharded parameter (DTensor under FSDP2 / tensor parallelism) is updated shard by shard:
    # each rank's step touches its local tensor only.
    params = [_local(p) for p in params]
    count = sum(p.numel() for p in params)
    # A measured step for a dataset model with exactly these parameters wins.
    for ident in _identities_seen(rt):
        if ident.name and ident.param_count == count and rt.db.has(spec.name, ident.name, "optimizer_step"):
            found = rt.db.lookup(spec.name, ident.name, 1, "optimizer_step")
            return found.value, found.provenance
    nbytes = sum(p.numel() * p.element_size() for p in params)
    k = _state_tensors(optimizer)
    foreach = optimizer.defaults.get("foreach")
    fused = optimizer.defaults.get("fused")
    traffic = None if fused else _implementation_traffic(optimizer, _st(rt).traffic)
    if traffic is None:
        # A fused kernel's one pass: read param + grad, write param; read + write each state.
        traffic = (3 + 2 * k, 2 + k)
    touched = nbytes * traffic[0]
    kernels = step_launches(params, traffic[1], 2 + k, foreach, fused).launches
    seconds = touched / (spec.memory_bandwidth * BANDWIDTH_EFFICIENCY) + kernels * LAUNCH_LATENCY
    if rt.engine.host_model is None:
        seconds = _with_calibration_issue(rt, device, seconds, kernels)
    rt.say_once(
        f"{type(optimizer).__name__} step on {spec.short_name}: time estimated from the "
        f"{touched / 1e6:.0f} MB it reads and writes (no optimizer_step measurement)"
    )
    return seconds, "estimated"


# A kernel of an optimizer step as the measured loop's backward column held it (_with_calibration_issue).
_STEP_KERNEL = OpFeatures("add_", OpClass.ELEMENTWISE, True, 1024.0, 3 * 4096.0)


def _with_calibration_issue(rt: Runtime, device: int, seconds: float, launches: int) -> float:
    """An optimizer step's GPU seconds without a modelled host (``--host none``): as in every pass
    the cost model prices, its ``launches`` kernels (``seconds`` shared among them) queue behind the
    calibration hosts' per-op issue time ``h``, that of the step's kernels in the measured loop
    (:mod:`gpemu.costmodel.measured_loop`): taken off a measured backward there, charged here."""
    sheet = _device(rt, device).sheet
    h = model_for(rt.db, sheet).host_seconds(_STEP_KERNEL, sheet)  # (the queue of n equal ops, closed form:)
    return max(launches * h + seconds / max(launches, 1), h + seconds)


class StepLaunches(NamedTuple):
    """What issuing one optimizer step takes: ``calls`` into the framework (one per foreach or
    fused op, one per op and tensor on the per-tensor path) and the kernels they ``launches``."""

    calls: int
    launches: int


# torch's multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh): a foreach or fused kernel
# launch takes at most this many tensors per list depth (1-5 lists), 320 blocks of 65,536
# elements; a list longer than that is several launches.
_MTA_TENSORS = (110, 64, 48, 36, 30)
_MTA_BLOCKS = 320
_MTA_CHUNK = 65536


def multi_tensor_launches(numels: list[int], depth: int) -> int:
    """Kernels one foreach/fused op over tensors of ``numels`` elements launches, with ``depth``
    tensor lists (a foreach add of two lists: 2; fused Adam: 4)."""
    cap = _MTA_TENSORS[min(max(depth, 1), 5) - 1]
    launches = tensors = blocks = 0
    for n in numels:
        if n <= 0:
            continue
        tensors += 1
        blocks += -(-n // _MTA_CHUNK)
        while blocks >= _MTA_BLOCKS:  # full of blocks: launch; the tensor's rest goes on
            launches += 1
            blocks -= _MTA_BLOCKS
            tensors = 1 if blocks else 0
        if tensors >= cap:
            launches += 1
            tensors = blocks = 0
    return launches + (1 if tensors or blocks else 0) or 1


def step_launches(params: list, passes: int, lists: int, foreach: bool | None, fused: bool | None) -> StepLaunches:
    """Framework calls and kernel launches of one optimizer step over ``params`` making ``passes``
    passes over them (:func:`_implementation_traffic`'s kernels per parameter) with ``lists``
    tensor lists in a fused kernel (parameters, gradients, states): the per-tensor path makes one
    call and launch per pass and tensor, the foreach path (torch's default on CUDA) one call per
    pass, launching as multi_tensor_apply chunks it, the fused path one call."""
    numels = [p.numel() for p in params]
    if fused:
        return StepLaunches(1, multi_tensor_launches(numels, lists))
    if foreach is False:
        return StepLaunches(passes * len(params), passes * len(params))
    return StepLaunches(passes, passes * multi_tensor_launches(numels, 2))


def optimizer_step_launches(rt: Runtime, optimizer: torch.optim.Optimizer) -> StepLaunches:
    """:class:`StepLaunches` of one ``optimizer.step()`` (memoised per optimizer and parameter
    lists): what the modelled host spends issuing it (gpemu.time.launch)."""
    st = _st(rt)
    key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
    hit = st.launches.get(optimizer)
    if hit is not None and hit[0] == key:
        return hit[1]
    params = [_local(p) for g in optimizer.param_groups for p in g["params"]]
    fused = optimizer.defaults.get("fused")
    traffic = None if fused else _implementation_traffic(optimizer, st.traffic)
    k = _state_tensors(optimizer)
    result = step_launches(params, traffic[1] if traffic else 2 + k, 2 + k, optimizer.defaults.get("foreach"), fused)
    try:
        st.launches[optimizer] = (key, result)
    except TypeError:
        pass
    return result


class StepHostTime(NamedTuple):
    """The framework's host seconds of one optimizer step on this machine, launches aside:
    ``fixed`` per step plus ``per_tensor`` per parameter (its Python loop over the parameters,
    the foreach argument checks, the per-tensor path's op calls)."""

    fixed: float
    per_tensor: float


def optimizer_step_host_seconds(rt: Runtime, optimizer: torch.optim.Optimizer) -> float:
    """What the modelled host (``rt.engine.host_model``) spends issuing one ``optimizer.step()``:
    torch's own step measured on this machine (:func:`_step_host_time`) scaled to the target
    host, plus a driver launch per kernel it launches (:func:`optimizer_step_launches`). 0
    without a host model. Worked out once per optimizer, its parameter lists and the kind of its
    settings (a learning-rate schedule changes none of it: :func:`_settings_kind`)."""
    engine = rt.engine
    model = engine.host_model
    if model is None:
        return 0.0
    st = _st(rt)
    groups = optimizer.param_groups
    kind = _settings_kind(groups[0]) if groups else None
    key = (tuple((id(g["params"]), len(g["params"])) for g in groups), kind)
    hit = st.step_host_s.get(optimizer)
    if hit is not None and hit[0] == key:
        return hit[1]
    launches = optimizer_step_launches(rt, optimizer)
    measured = engine.call(_step_host_time, optimizer, kind, st.step_host)
    if measured is None:  # not torch's own class: each call as one op
        seconds = engine.launch_seconds(launches.calls, launches.launches)
    else:
        n = sum(len(g["params"]) for g in groups)
        seconds = model.scale * (measured.fixed + measured.per_tensor * n) + launches.launches * model.launch_s
    try:
        st.step_host_s[optimizer] = (key, seconds)
    except TypeError:
        pass
    return seconds


def _settings_kind(group: dict) -> tuple:
    """What of a parameter group's settings decides the host work of torch's step: the switches
    (foreach, fused, amsgrad, nesterov, maximize, ...) and whether each number is zero (a zero
    weight decay or momentum skips its ops); not the numbers themselves, which schedules change
    every step (a tensor learning rate, betas: their kind alone)."""
    return tuple(
        (name, v if v is None or v.__class__ in _SWITCHES else v == 0 if v.__class__ in _NUMBERS else type(v).__name__)
        for name, v in group.items()
        if name != "params"
    )


_SWITCHES = (bool, str)
_NUMBERS = (int, float)


def _step_host_time(optimizer: torch.optim.Optimizer, kind: tuple | None, memo: dict) -> StepHostTime | None:
    """Torch's own step of ``optimizer``'s class and settings (foreach as on CUDA: the default
    picks it) on 16 and 160 tiny CPU parameters: the best of five rounds of ten steps each, the
    difference per parameter and the rest per step. Only torch's own classes (see
    :func:`_implementation_traffic`); None for the rest and for settings the CPU cannot run
    (``kind``: :func:`_settings_kind`, the memo's key)."""
    if not type(optimizer).__module__.startswith("torch.optim") or not optimizer.param_groups or kind is None:
        return None
    key = (type(optimizer), kind)
    if key not in memo:
        settings = {name: v for name, v in optimizer.param_groups[0].items() if name != "params"}
        if not settings.get("fused") and settings.get("foreach") is None:
            settings["foreach"] = True
        memo[key] = _time_steps(type(optimizer), settings)
    return memo[key]


def _time_steps(optimizer_class: Any, settings: dict) -> StepHostTime | None:
    step = optimizer_class.step
    while hasattr(step, "__wrapped__"):  # torch's hook and no-grad wrappers (and gpemu's)
        step = step.__wrapped__
    settings = {**settings, "capturable": False} if "capturable" in settings else settings
    best = []
    try:
        for n in (16, 160):
            params = [torch.zeros(4, requires_grad=True) for _ in range(n)]
            for p in params:
                p.grad = torch.zeros(4)
            opt = optimizer_class([{**settings, "params": params}])
            rounds = []
            with torch.no_grad():
                for r in range(6):
                    # (the thread's CPU time, as the dispatch probe: on a busy host, waiting for a
                    # core is no framework work, and the figure is scaled by a cached machine speed)
                    t = time.thread_time()
                    for _ in range(10):
                        step(opt)
                    if r:  # (the first round makes the state)
                        rounds.append((time.thread_time() - t) / 10)
            best.append(min(rounds))
    except Exception:  # noqa: BLE001 - settings the CPU build cannot run
        return None
    per_tensor = max(0.0, (best[1] - best[0]) / 144)
    return StepHostTime(max(0.0, best[0] - 16 * per_tensor), per_tensor)


_PROBE_ELEMENTS = 1 << 16  # meta tensors: no memory; large enough that scalar ops do not count


def _implementation_traffic(optimizer: torch.optim.Optimizer, memo: dict) -> tuple[float, int] | None:
    """(bytes read and written per parameter byte, kernels per parameter) of one step of
    ``optimizer``, from torch's own code: its step function run twice on two parameters on the
    meta device with the first group's settings, the second step's ops recorded by the cost
    model's :class:`~gpemu.costmodel.OpRecorder` (the first creates the state).

    torch's foreach and per-parameter paths run the same passes: SGD with momentum reads and
    writes 8 bytes per parameter byte (``mul_`` and ``add_`` on the buffer, ``add_`` on the
    parameter), Adam 18, AdamW 20, where one fused pass would move 5, 7 and 7. On an H100 an SGD
    step of AlexNet and VGG-16 took the time of 8 bytes per parameter byte at 63-66% of the
    datasheet bandwidth (``benchmarks/data``). Only torch's own optimizer classes are run so
    (another class's step may have effects of its own, a log line, a counter); None for the
    rest and for any that cannot run this way: the fused-pass count then."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return None
    group = optimizer.param_groups[0] if optimizer.param_groups else None
    if group is None or not group["params"]:
        return None
    settings = {name: v for name, v in group.items() if name != "params"}
    dtype = group["params"][0].dtype
    try:
        key = (type(optimizer), dtype, tuple(sorted((name, repr(v)) for name, v in settings.items())))
        hash(key)
    except TypeError:
        return None
    if key in memo:
        return memo[key]
    optimizer_class: Any = type(optimizer)  # (torch types it as Optimizer, whose __init__ needs defaults)
    step = optimizer_class.step
    while hasattr(step, "__wrapped__"):  # torch's hook and no-grad wrappers (and gpemu's)
        step = step.__wrapped__
    result = None
    try:
        probe = [torch.zeros(_PROBE_ELEMENTS, dtype=dtype, device="meta", requires_grad=True) for _ in range(2)]
        for p in probe:
            p.grad = torch.zeros_like(p)
        # foreach off: the same passes as the foreach kernels, as ops the recorder knows.
        meta_opt = optimizer_class([{**settings, "params": probe, "foreach": False}])
        with torch.no_grad():
            step(meta_opt)
            rec = OpRecorder()
            with rec:
                step(meta_opt)
        moved = sum(op.nbytes for op in rec.ops)
        kernels = sum(1 for op in rec.ops if op.nbytes >= _PROBE_ELEMENTS * probe[0].element_size())
        if moved > 0 and kernels > 0:
            result = (moved / (2 * _PROBE_ELEMENTS * probe[0].element_size()), max(1, round(kernels / 2)))
    except Exception:  # noqa: BLE001 - settings the meta device cannot run (capturable, ...): one pass
        result = None
    memo[key] = result
    return result


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``p``: a DTensor's local shard, else ``p``."""
    to_local = getattr(p, "to_local", None)
    if to_local is not None and is_traceable_wrapper_subclass(p):
        return to_local()
    return p


def _identities_seen(rt: Runtime) -> list[ModelIdentity]:
    st = rt.identities
    if st is None:
        return []
    return list(st.cache.values())

"""What GPU work costs, in seconds, with where the number comes from.

* Identified models (``gpemu.identify``): forward/backward seconds are looked up in the profile
  database for (GPU, model, batch size) — provenance ``measured`` / ``interpolated`` /
  ``extrapolated`` as the database says. A model the database knows but not on this GPU is
  estimated from its FLOPs (``estimated``).
* Unknown models: priced by the ops they run (:mod:`gpemu.model_time` sums :func:`op_seconds` of
  every op the recorded call's forward and backward dispatch), provenance ``estimated``; the sums
  are kept per batch size in ``ModelIdentity.estimates``.
* Single ops: a roofline — ``max(FLOPs / (peak x efficiency), bytes / (bandwidth x
  efficiency)) + launch latency``. The compute efficiency is calibrated per GPU from the
  database's own measurements (median achieved FLOP rate of its models), so an estimate sits
  where real models on that GPU sit. :func:`estimate_module` sums it over a meta-device run of a
  module (benchmarks compare estimators with it; the emulator itself never re-runs user code).
* Optimizer step: the database's ``optimizer_step`` kind when present, else bytes the update
  touches (parameters, gradients, optimizer state) over memory bandwidth.

Every answer for (identity, batch size, device) is memoised: replay asks on every call.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.flop_counter import flop_registry

from .identify import ModelIdentity

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.db import GpuSpec

    from .runtime import Runtime

__all__ = [
    "CostState", "forward_seconds", "backward_seconds", "optimizer_step_seconds", "op_seconds", "estimate_module",
    "roofline_seconds", "compute_efficiency", "PROVENANCE_ORDER",
    "LAUNCH_LATENCY", "BANDWIDTH_EFFICIENCY", "DEFAULT_COMPUTE_EFFICIENCY",
]

# Per-kernel cost floor: a CUDA kernel launch + minimal execution is a few microseconds.
LAUNCH_LATENCY = 4e-6
# Streaming kernels reach roughly this share of the datasheet memory bandwidth.
BANDWIDTH_EFFICIENCY = 0.7
# Used when the database has no measurements to calibrate a GPU's compute efficiency.
DEFAULT_COMPUTE_EFFICIENCY = 0.5
PROVENANCE_ORDER = ("measured", "interpolated", "extrapolated", "estimated")
_HALF = (torch.float16, torch.bfloat16)
# Ops that move no data on a GPU (views, metadata) cost nothing.
_FREE = {"detach", "alias", "lift_fresh", "_to_copy_meta", "size", "stride", "sym_size", "empty",
         "empty_strided", "empty_like", "_local_scalar_dense"}


def _worst(a: str, b: str) -> str:
    return a if PROVENANCE_ORDER.index(a) >= PROVENANCE_ORDER.index(b) else b


@dataclass
class CostState:
    """What one run has worked out about costs (``rt.costs``, made on first use)."""

    memo: dict = field(default_factory=dict)   # (identity, batch, device, kind) -> (seconds, provenance)
    efficiency: dict = field(default_factory=dict)  # GPU name -> compute efficiency
    # optimizer -> (its parameter lists' key, (seconds, provenance))
    optimizers: "weakref.WeakKeyDictionary[Any, tuple]" = field(default_factory=weakref.WeakKeyDictionary)


def _st(rt: "Runtime") -> CostState:
    st = rt.costs
    if st is None:
        st = rt.costs = CostState()
    return st


# --------------------------------------------------------------------------------- models
def forward_seconds(rt: "Runtime", identity: ModelIdentity, batch_size: int, device: int) -> tuple[float, str]:
    """GPU seconds of one forward pass of ``identity`` at ``batch_size`` on ``device``."""
    return _model_seconds(rt, identity, batch_size, device, "forward")


def backward_seconds(rt: "Runtime", identity: ModelIdentity, batch_size: int, device: int) -> tuple[float, str]:
    """GPU seconds of one backward pass of ``identity`` at ``batch_size`` on ``device``."""
    return _model_seconds(rt, identity, batch_size, device, "backward")


def _model_seconds(rt: "Runtime", identity: ModelIdentity, batch_size: int, device: int, kind: str) -> tuple[float, str]:
    memo = _st(rt).memo
    key = (identity, batch_size, device, kind)
    hit = memo.get(key)
    if hit is not None:
        return hit
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    result = _compute_model_seconds(rt, identity, batch_size, device, kind)
    memo[key] = result
    return result


def _compute_model_seconds(rt: "Runtime", identity: ModelIdentity, batch: int, device: int,
                           kind: str) -> tuple[float, str]:
    spec = rt.gpus[device]
    if identity.parts:
        total, prov = 0.0, "measured"
        for part in identity.parts:
            s, p = _model_seconds(rt, part, batch, device, kind)
            total, prov = total + s, _worst(prov, p)
        return total, prov
    if identity.name is not None:
        from gpemu.db import MissingMeasurementError

        try:
            found = rt.db.lookup(spec.name, identity.name, batch, kind)
        except MissingMeasurementError:
            info = identity.info or rt.db.model(identity.name)
            flops = info.fwd_flops_per_sample if kind == "forward" else info.fwd_bwd_flops_per_sample - info.fwd_flops_per_sample
            rt.say_once(f"{identity.name} on {spec.short_name}: not profiled on this GPU; "
                        f"{kind} time estimated from its FLOPs")
            return flops * batch / (spec.fp32_flops * compute_efficiency(rt, spec)), "estimated"
        rt.say_once(f"{identity.name} on {spec.short_name}: {kind} time from the profile database "
                    f"({found.provenance})")
        return found.value, found.provenance
    # Unknown model: a meta-run estimate at this batch size if one was made, else scale one.
    est = identity.estimates
    exact = est.get((kind, batch, device))
    if exact is not None:
        return exact, "estimated"
    others = [(b, s) for (k, b, d), s in est.items() if k == kind and d == device]
    if others:
        b0, s0 = max(others)
        # Per-sample work scales with the batch; the kernel-launch floor does not.
        fixed = min(s0, est.get((kind + "-launch", b0, device), 0.0))
        return fixed + (s0 - fixed) * batch / b0, "estimated"
    # No meta run yet: 2 FLOPs per parameter per sample forward (dense-layer rule), twice that
    # backward. Crude for convolutions; replay's estimate_module replaces it.
    flops = 2.0 * identity.param_count * batch * (1 if kind == "forward" else 2)
    return roofline_seconds(flops, identity.param_bytes * (1 if kind == "forward" else 2), spec, rt), "estimated"


def compute_efficiency(rt: "Runtime", spec: "GpuSpec") -> float:
    """Share of peak FP32 FLOP/s real models reach on this GPU (median over the database's
    measured models at batch 64, forward+backward); DEFAULT_COMPUTE_EFFICIENCY without data."""
    eff = _st(rt).efficiency
    hit = eff.get(spec.name)
    if hit is not None:
        return hit
    ratios = []
    try:
        for info in rt.db.models():
            if not info.fwd_bwd_flops_per_sample or not rt.db.has(spec.name, info.name, "forward") \
                    or not rt.db.has(spec.name, info.name, "backward"):
                continue
            t = (rt.db.lookup(spec.name, info.name, 64, "forward").value
                 + rt.db.lookup(spec.name, info.name, 64, "backward").value)
            if t > 0:
                ratios.append(info.fwd_bwd_flops_per_sample * 64 / t / spec.fp32_flops)
    except Exception:  # a partial database must not break estimates
        ratios = []
    value = DEFAULT_COMPUTE_EFFICIENCY
    if ratios:
        ratios.sort()
        value = min(1.0, max(0.02, ratios[len(ratios) // 2]))
    eff[spec.name] = value
    return value


def roofline_seconds(flops: float, nbytes: float, spec: "GpuSpec", rt: "Runtime | None" = None,
                     half: bool = False, kernels: int = 1) -> float:
    """max(compute time, memory time) + launch latency for work on ``spec``."""
    peak = spec.fp16_flops if half else spec.fp32_flops
    eff = compute_efficiency(rt, spec) if rt is not None else DEFAULT_COMPUTE_EFFICIENCY
    compute = flops / (peak * eff) if flops else 0.0
    memory = nbytes / (spec.memory_bandwidth * BANDWIDTH_EFFICIENCY) if nbytes else 0.0
    return max(compute, memory) + kernels * LAUNCH_LATENCY


def attention_seconds(rt: "Runtime", device: int, batch_heads: int, length: int, source: int, head_dim: int,
                      value_dim: int, dtype: torch.dtype, causal: bool, backward: bool) -> float:
    """GPU seconds of one fused attention kernel (flash or memory-efficient) over ``batch_heads``
    heads of ``length`` queries and ``source`` keys: two matrix products forward, five backward
    (the scores are recomputed), half of them under a causal mask."""
    flops = 2.0 * batch_heads * length * source * (head_dim + value_dim)
    if backward:
        flops *= 2.5
    if causal:
        flops *= 0.5
    element = torch.empty((), dtype=dtype).element_size()
    nbytes = batch_heads * (length * head_dim + source * (head_dim + value_dim) + length * value_dim) * element
    if backward:
        nbytes *= 2
    return roofline_seconds(flops, nbytes, rt.gpus[device], rt, half=dtype in _HALF)


# --------------------------------------------------------------------------------- single ops
def _tensor_bytes(x: Any, acc: list[int], half: list[bool]) -> None:
    if isinstance(x, torch.Tensor):
        acc[0] += x.numel() * x.element_size()
        if x.dtype in _HALF:
            half[0] = True
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensor_bytes(y, acc, half)


def op_seconds(rt: "Runtime", func: Any, args: tuple, kwargs: dict | None, out: Any, device: int) -> float:
    """Roofline GPU seconds of one aten op (0 inside a module/optimizer charge, or for views)."""
    engine = rt.engine
    if engine is not None and engine.in_charged_scope:
        return 0.0
    return _op_roofline(rt, rt.gpus[device], func, args, kwargs or {}, out)


def _op_roofline(rt: "Runtime | None", spec: "GpuSpec", func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    if getattr(func, "is_view", False):
        return 0.0
    packet = getattr(func, "overloadpacket", func)
    if getattr(packet, "__name__", "") in _FREE:
        return 0.0
    flops = 0
    fn = flop_registry.get(packet)
    if fn is not None:
        try:
            flops = fn(*args, **kwargs, out_val=out)
        except Exception:  # an odd overload the formula does not cover: bytes only
            flops = 0
    acc, half = [0], [False]
    _tensor_bytes(args, acc, half)
    _tensor_bytes(out, acc, half)
    return roofline_seconds(flops, acc[0], spec, rt, half=half[0])


class _CostMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums the roofline of every op run under it (on meta tensors)."""

    def __init__(self, rt: "Runtime | None", spec: "GpuSpec") -> None:
        super().__init__()
        self.rt, self.spec, self.total, self.ops = rt, spec, 0.0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = _op_roofline(self.rt, self.spec, func, args, kwargs, out)
        if cost > 0:  # views and metadata launch no kernel
            self.total += cost
            self.ops += 1
        return out


def estimate_module(rt: "Runtime", identity: ModelIdentity, module: torch.nn.Module, args: tuple,
                    kwargs: dict | None, device: int) -> tuple[float, float]:
    """Estimate (forward, backward) seconds of ``module(*args, **kwargs)`` by running it once on
    the meta device under a per-op roofline; stored in ``identity.estimates`` for its batch size.

    Replay calls this on its recording pass of an ``estimated`` module. Never raises: a module
    that cannot run on meta keeps the parameter-count estimate.
    """
    batch = _batch_of(args, kwargs)
    key_f, key_b = ("forward", batch, device), ("backward", batch, device)
    if key_f in identity.estimates:
        return identity.estimates[key_f], identity.estimates.get(key_b, 0.0)
    spec = rt.gpus[device]

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
        return x

    try:
        state = {n: torch.empty(tuple(p.shape), dtype=p.dtype, device="meta", requires_grad=p.requires_grad)
                 for n, p in module.named_parameters()}
        state.update({n: meta(b) for n, b in module.named_buffers()})
        margs = torch.utils._pytree.tree_map(meta, args)
        mkw = torch.utils._pytree.tree_map(meta, kwargs or {})
        fwd = _CostMode(rt, spec)
        with fwd:
            out = torch.func.functional_call(module, state, margs, mkw)
        leaves = [t for t in torch.utils._pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
        inputs = [p for p in state.values() if isinstance(p, torch.Tensor) and p.requires_grad]
        bwd = _CostMode(rt, spec)
        if leaves and inputs:
            with bwd:
                torch.autograd.grad([t.sum() for t in leaves], inputs, allow_unused=True)
        result = (fwd.total, bwd.total)
    except Exception as exc:  # user modules may do anything; keep the crude estimate
        rt.say_once(f"model {identity.class_name}: could not estimate per op ({type(exc).__name__}); "
                    f"using a parameter-count estimate")
        return (_model_seconds(rt, identity, batch, device, "forward")[0],
                _model_seconds(rt, identity, batch, device, "backward")[0])
    identity.estimates[key_f], identity.estimates[key_b] = result
    identity.estimates[("forward-launch", batch, device)] = fwd.ops * LAUNCH_LATENCY
    identity.estimates[("backward-launch", batch, device)] = bwd.ops * LAUNCH_LATENCY
    memo = _st(rt).memo
    memo.pop((identity, batch, device, "forward"), None)
    memo.pop((identity, batch, device, "backward"), None)
    return result


def _batch_of(args: tuple, kwargs: dict | None) -> int:
    for x in torch.utils._pytree.tree_leaves((args, kwargs or {})):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 1


# --------------------------------------------------------------------------------- optimizer
# Optimizer state tensors per parameter (read and written every step).
def _state_tensors(optimizer: torch.optim.Optimizer) -> int:
    name = type(optimizer).__name__
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


def optimizer_step_seconds(rt: "Runtime", optimizer: torch.optim.Optimizer, device: int) -> tuple[float, str]:
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


def _optimizer_seconds(rt: "Runtime", optimizer: torch.optim.Optimizer, params: list, device: int) -> tuple[float, str]:
    spec = rt.gpus[device]
    count = sum(p.numel() for p in params)
    # A measured step for a dataset model with exactly these parameters wins.
    for ident in _identities_seen(rt):
        if ident.name and ident.param_count == count and rt.db.has(spec.name, ident.name, "optimizer_step"):
            found = rt.db.lookup(spec.name, ident.name, 1, "optimizer_step")
            return found.value, found.provenance
    nbytes = sum(p.numel() * p.element_size() for p in params)
    k = _state_tensors(optimizer)
    touched = nbytes * (3 + 2 * k)  # read param + grad, write param; read+write each state
    foreach = optimizer.defaults.get("foreach")
    fused = optimizer.defaults.get("fused")
    per_param_kernels = 2 + k
    if fused:
        kernels = max(1, math.ceil(len(params) / 64))
    elif foreach is False:
        kernels = per_param_kernels * len(params)
    else:  # None: CUDA picks the foreach path
        kernels = per_param_kernels * max(1, math.ceil(len(params) / 32))
    seconds = touched / (spec.memory_bandwidth * BANDWIDTH_EFFICIENCY) + kernels * LAUNCH_LATENCY
    rt.say_once(f"{type(optimizer).__name__} step on {spec.short_name}: time estimated from the "
                f"{touched / 1e6:.0f} MB it reads and writes (no optimizer_step measurement)")
    return seconds, "estimated"


def _identities_seen(rt: "Runtime") -> list[ModelIdentity]:
    st = rt.identities
    if st is None:
        return []
    return list(st.cache.values())

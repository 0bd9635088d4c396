"""What a module call is charged and what the run says about it (:mod:`gpemu.model_time`'s prices):
a call priced by its ops as one pass or by its kernels, the issue time its ops stand for, a
measured model's time carried to another GPU or precision, and the one-line notes that say where
each model's time comes from (kept in ``ModelTime.sources`` for the summary)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import costs

if TYPE_CHECKING:  # pragma: no cover
    from .model_time import ModelTime

__all__ = [
    "charge_pass",
    "kernel_share",
    "pass_seconds",
    "charge_issue_gaps",
    "price_ratio",
    "say_measured",
    "say_estimated",
]


def kernel_share(tap: Any, unit: bool) -> float:
    """The kernels' share of what a call priced by its ops is charged per pass (the rest: gaps
    while the host issued its ops, which a modelled host pays itself and a CUDA graph's replay
    does not have)."""
    charged = pass_seconds(tap, unit)
    return min(1.0, tap.seconds / charged) if charged > 0 else 1.0


def charge_pass(engine: Any, dev: int, seconds: float, tap: Any, kind: str, label: str, at: float | None) -> None:
    """A call charged as one piece (a measured model's time, or a wrapper's pass), issued at host
    time ``at``: the GPU runs its kernels' share of ``seconds`` after the host's lead when a host
    is modelled (:meth:`gpemu.time.engine.TimeEngine.enqueue_pass`), and the host pays the issue
    time of the ops it stands for (those not charged on their own: they paid when they were)."""
    owed = tap.issue - tap.issue_paid if not engine.in_charged_scope else 0.0
    engine.enqueue_pass(dev, seconds, seconds * kernel_share(tap, False), kind, label, at, max(owed, 0.0))


def pass_seconds(tap: Any, unit: bool) -> float:
    """What a call priced by its ops costs per pass. An outermost call: its ops as one pass
    started on an idle GPU (``tap.pass_seconds``, host issue time included: the cost model is
    fitted to whole passes timed that way; behind a modelled host its issue time, of which the GPU
    runs only the kernels: :func:`kernel_share`). A unit inside an op-by-op ancestor is issued behind
    the ancestor's queued work, where its ops are charged one by one at their kernel time: its
    replays must cost the same (``tap.seconds``), or a model replayed by units prices more GPU
    time than the same step op by op (GPT-2 in bf16, each unit a pass from idle: +18%)."""
    return tap.seconds if unit else tap.pass_seconds


def charge_issue_gaps(engine: Any, dev: int, gaps: float, label: str, which: str) -> None:
    """An outermost call priced by its ops whose replays charge it as a pass (its outputs are
    replayable), run op by op (its recording, ``--no-replay``, ``--values real``): its kernels
    were charged as they ran; the pass (:func:`pass_seconds`) also holds the issue time of the
    cost model's calibration hosts (``gaps``: the pass less its kernels), where no host is modelled
    (``--host none``: the fitted per-op host term stays in GPU prices). That is charged too, so a
    step costs the same GPU time however it runs (a small MLP's replayed step was 5x the same step
    op by op). Not with a modelled host (the op-by-op kernels waited for their launches already)
    nor inside a CUDA graph's capture or launch (the graph's kernels run back to back)."""
    if engine.op_issue_s or engine.in_charged_scope or engine.captures or engine.local.host.launching:
        return
    if gaps > 0:
        engine.stream(dev).enqueue(gaps, "op", f"{label} {which}: host issue gaps")


def price_ratio(tap: Any) -> float:
    """This GPU and precision over the database's conditions, for the ops ``tap`` saw (1 when
    they ran as measured, or when nothing was priced)."""
    ref = tap.reference_seconds
    return tap.pass_seconds / ref if ref > 0 else 1.0


def _source(mt: ModelTime, name: str, dev: int) -> dict[str, Any]:
    rt = mt.rt
    return mt.sources.setdefault((name, dev), {"model": name, "gpu": rt.gpus[dev].short_name})


def say_measured(
    mt: ModelTime,
    ident: Any,
    dev: int,
    times: costs.ModelTimes,
    ratio: float,
    kind: str,
    mix: dict[str, float],
    precisions: dict[str, float],
    quiet: bool = False,
) -> None:
    """Say (once) and keep where a measured model's ``kind`` time comes from (``mix`` and
    ``precisions``: the ops' GPU seconds per kind of work and per dtype)."""
    if quiet:
        return
    rt = mt.rt
    spec = rt.gpus[dev]
    source = _source(mt, ident.name, dev)
    if ratio == 1.0 and times.gpu == spec.name:
        source[kind] = times.provenance
        rt.say_once(f"{ident.name} on {spec.short_name}: {kind} time from the profile database ({times.provenance})")
        return
    what = []
    other_gpu = times.gpu != spec.name
    if other_gpu:
        what.append(f"{spec.short_name} vs {rt.db.gpu(times.gpu).short_name}")
    prec = costs.precision()
    if ratio != 1.0 and (
        torch.is_autocast_enabled("cuda") or prec.allow_tf32_matmul or not prec.allow_tf32_cudnn or not other_gpu
    ):
        what.append("this precision vs fp32")
    # Carried to another GPU: the cross-validated error of carrying a measured time from one GPU to
    # another by the cost model's ratio applies; a precision ratio alone has no AMP measurements to
    # check it against, so it carries no figure (and says so).
    u = costs.uncertainty(rt, dev, mix, transferred=True, precisions=precisions) if other_gpu else None
    source[kind] = "scaled"
    source["scaled_for"] = " and ".join(
        (["precision"] if "this precision vs fp32" in what else [])
        + ([f"GPU, from {rt.db.gpu(times.gpu).short_name}"] if other_gpu else [])
    )
    if u is not None:
        source["uncertainty"] = u.labelled
    rt.say_once(
        f"{ident.name} on {spec.short_name}: {kind} time scaled from the profile database's "
        f"{rt.db.gpu(times.gpu).short_name} measurement ({times.provenance}) by the cost model's ratio "
        f"for {' and '.join(what) or 'these ops'}: x{ratio:.3f} (provenance: scaled"
        + (f", {u}" if u is not None else ", a ratio no measurement checks")
        + ")"
    )


def say_estimated(
    mt: ModelTime, ident: Any, dev: int, mix: dict[str, float], precisions: dict[str, float], quiet: bool = False
) -> None:
    """Say (once) and keep that a model is priced by the ops it runs, with the cost model's error."""
    if quiet:
        return
    rt = mt.rt
    spec = rt.gpus[dev]
    u = costs.uncertainty(rt, dev, mix, precisions=precisions)
    source = _source(mt, ident.name or ident.class_name, dev)
    source["forward"] = source["backward"] = "estimated"
    if u is not None:
        source["uncertainty"] = u.labelled
    rt.say_once(
        f"{ident.name or ident.class_name} on {spec.short_name}: forward and backward time estimated "
        f"by the cost model from the ops they run" + (f", {u.labelled} ({u.basis})" if u is not None else "")
    )

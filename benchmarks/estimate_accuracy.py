"""Accuracy of the cost model (gpemu.costmodel) on the profile database, by cross-validation.

Every case is one (model, GPU, batch size) of the database — 36 torchvision models x 6 GPUs x
batch sizes 16/32/64/128/256 = 1080 — and the figure is the estimated forward + backward time
against the measured one (|error| = |estimate / measured - 1|):

* **leave-one-model-out (LOMO)**: each model priced by its GPU's curves fitted on the other 35
  models (how well a model the database does not know is estimated on a measured GPU);
* **leave-one-GPU-out (LOGO)**: each GPU priced as if only its datasheet were known — its
  generation's curves removed, the donor chain (``gpemu.costmodel.gpus.DONORS``) supplies
  curves, with the GPU's own peaks — directly (``op model``) or by carrying the same model's
  measured time on the donor GPU over with the op model's ratio (``transfer``);
* ``--before``: today's estimator, ``gpemu.costs.estimate_module`` as of commit 9a331bc (per-op
  roofline, one efficiency per GPU calibrated on that GPU's database models; a frozen copy lives
  here, since gpemu.costs is being rewired to this cost model), on the same 1080 cases.

    python benchmarks/estimate_accuracy.py             # LOMO + LOGO
    python benchmarks/estimate_accuracy.py --before    # and today's estimator beside it
    python benchmarks/estimate_accuracy.py --no-cache  # recompute everything
    python benchmarks/estimate_accuracy.py --refit     # fit the full model again (default: the shipped file)

Op lists, LOMO predictions and the --before figures are cached in ``~/.cache/gpemu/costmodel``
(``$GPEMU_COSTMODEL_CACHE``) under keys that change with the code and the data, so a rerun takes
seconds; the first run takes ~15 min (LOMO: 216 fits) plus ~10 min for --before (180 meta-device
passes of the old estimator's per-op roofline, one per model and batch size, priced for all six
GPUs) on a 2-core machine. Prints figures; not a test.
"""

from __future__ import annotations

import os

# One BLAS thread: scipy's least squares does an SVD per iteration, ~20x slower with threads
# contending on a busy 2-core machine. Must be set before numpy / scipy load their BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import TYPE_CHECKING, NamedTuple  # noqa: E402

import numpy as np  # noqa: E402
from _common import machine, progress_bar  # noqa: E402  (puts the repository on sys.path)

if TYPE_CHECKING:
    from gpemu.profiler.costfit import FitData

FAMILIES = (
    ("alexnet", "AlexNet"),
    ("vgg", "VGG"),
    ("resnext", "ResNeXt"),
    ("wide_resnet", "Wide ResNet"),
    ("resnet", "ResNet"),
    ("densenet", "DenseNet"),
    ("googlenet", "GoogLeNet"),
    ("squeezenet", "SqueezeNet"),
    ("mobilenet_v2", "MobileNetV2"),
    ("mobilenet_v3", "MobileNetV3"),
    ("mnasnet", "MNASNet"),
    ("shufflenet", "ShuffleNetV2"),
)


def family(name: str) -> str:
    for prefix, label in FAMILIES:
        if name.startswith(prefix):
            return label
    return name


def pct(x: float) -> str:
    return f"{100 * x:6.1f}%" if x == x else "     - "


def row(label: str, s: dict) -> str:
    return f"{label:<26}{s['n']:>6} {pct(s['mean'])} {pct(s['p50'])} {pct(s['p90'])} {pct(s['worst'])}"


HEADER = f"{'':<26}{'n':>6} {'mean':>7} {'median':>7} {'p90':>7} {'worst':>7}"


# ------------------------------------------------------------------------------ today's estimator
# A frozen copy of the estimator this cost model replaces: gpemu.costs.estimate_module as of commit
# 9a331bc (per-op roofline over one meta-device forward + backward; FLOPs from torch's
# flop_registry, whose grouped-conv backward formula overcounts; one compute efficiency per GPU,
# the median achieved FLOP rate of its database models at batch 64; memory at 70% of the
# bandwidth; 4 us per op). Kept here because gpemu.costs is being rewired to gpemu.costmodel.
# While the original existed this copy matched it to < 1e-9 relative on resnet50/64 and
# mobilenet_v2/16 on all six GPUs, and its 1080 results are the ones that run cached.
_OLD_LAUNCH, _OLD_BW_EFF, _OLD_DEFAULT_EFF = 4e-6, 0.7, 0.5
_OLD_FREE = {
    "detach",
    "alias",
    "lift_fresh",
    "_to_copy_meta",
    "size",
    "stride",
    "sym_size",
    "empty",
    "empty_strided",
    "empty_like",
    "_local_scalar_dense",
}


def _old_efficiency(db, spec, flops_per_sample: dict[str, float]) -> float:
    """The median achieved FLOP rate of the GPU's database models at batch 64, as a fraction of its
    FP32 peak. ``flops_per_sample``: forward + backward FLOPs per sample as the old estimator saw
    them — torch's flop_registry, which the database's model facts then carried too (they now
    count a grouped convolution's backward correctly; the old figures are recounted here so that
    the baseline stays what gpemu did)."""
    ratios = []
    for info in db.models():
        flops = flops_per_sample.get(info.name)
        if not flops or not db.has(spec.name, info.name, "forward") or not db.has(spec.name, info.name, "backward"):
            continue
        t = db.lookup(spec.name, info.name, 64, "forward").value + db.lookup(spec.name, info.name, 64, "backward").value
        if t > 0:
            ratios.append(flops * 64 / t / spec.fp32_flops)
    if not ratios:
        return _OLD_DEFAULT_EFF
    ratios.sort()
    return min(1.0, max(0.02, ratios[len(ratios) // 2]))


def _old_roofline(flops: float, nbytes: float, spec, eff: float, half: bool) -> float:
    peak = spec.fp16_flops if half else spec.fp32_flops
    compute = flops / (peak * eff) if flops else 0.0
    memory = nbytes / (spec.memory_bandwidth * _OLD_BW_EFF) if nbytes else 0.0
    return max(compute, memory) + _OLD_LAUNCH


def _roofline_inputs(module, batch: int):
    """(flops, bytes, half) of every op the old estimator priced, forward and backward, from one
    meta pass (so one pass serves all six GPUs)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    def walk(x, acc, half):
        if isinstance(x, torch.Tensor):
            acc[0] += x.numel() * x.element_size()
            if x.dtype in (torch.float16, torch.bfloat16):
                half[0] = True
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y, acc, half)

    class Inputs(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple[float, int, bool]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = getattr(func, "overloadpacket", func)
            if getattr(func, "is_view", False) or getattr(packet, "__name__", "") in _OLD_FREE:
                return out
            flops = 0
            fn = flop_registry.get(packet)
            if fn is not None:
                try:
                    flops = fn(*args, **kwargs, out_val=out)
                except Exception:
                    flops = 0
            acc, half = [0], [False]
            walk(args, acc, half)
            walk(out, acc, half)
            self.ops.append((flops, acc[0], half[0]))
            return out

    state = {
        n: torch.empty(tuple(p.shape), dtype=p.dtype, device="meta", requires_grad=p.requires_grad)
        for n, p in module.named_parameters()
    }
    state.update({n: torch.empty(tuple(b.shape), dtype=b.dtype, device="meta") for n, b in module.named_buffers()})
    fwd, bwd = Inputs(), Inputs()
    with fwd:
        out = torch.func.functional_call(module, state, (torch.empty(batch, 3, 224, 224, device="meta"),), {})
    leaves = [
        t
        for t in torch.utils._pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    inputs = [p for p in state.values() if p.requires_grad]
    with bwd:
        torch.autograd.grad([t.sum() for t in leaves], inputs, allow_unused=True)
    return fwd.ops, bwd.ops


def before_predictions(data, db, gpus: list[str], use_cache: bool, progress) -> dict[str, np.ndarray]:
    """The old estimator on every case: {gpu: [model, phase, batch]} (cached)."""
    import torch

    from examples import tvmodels
    from gpemu.profiler.costdata import load_arrays, save_arrays
    from gpemu.profiler.costfit import EVAL_BATCHES

    # The key of the run made while gpemu.costs still had the original (same arithmetic).
    key = (
        "899f5c818085"
        if torch.__version__ == "2.13.0+cpu"
        else hashlib.sha1(
            torch.__version__.encode()
            + db.meta().get("data_version", "").encode()
            + json.dumps([gpus, list(data.names), list(EVAL_BATCHES)]).encode()
        ).hexdigest()[:12]
    )
    name = f"before-{key}"
    hit = load_arrays(name) if use_cache else None
    task = progress.add_task("today's estimator", total=len(data.names) * len(EVAL_BATCHES))
    if hit is not None:
        progress.update(task, completed=len(data.names) * len(EVAL_BATCHES))
        return {g: hit[f"g{i}"] for i, g in enumerate(gpus)}
    specs = [db.gpu(g) for g in gpus]
    passes = {}  # (model, batch) -> (forward ops, backward ops)
    for model_name in data.names:
        with torch.device("meta"):
            module = tvmodels.MODELS[model_name]()
        module.train()
        for b in EVAL_BATCHES:
            progress.update(task, description=f"today's estimator {model_name} {b}")
            passes[model_name, b] = _roofline_inputs(module, b)
            progress.advance(task)
    flops = {n: sum(f for f, _, _ in passes[n, 64][0] + passes[n, 64][1]) / 64 for n in data.names}
    effs = [_old_efficiency(db, spec, flops) for spec in specs]
    out = {g: np.full((len(data.names), 2, len(EVAL_BATCHES)), np.nan) for g in gpus}
    for mi, model_name in enumerate(data.names):
        for bi, b in enumerate(EVAL_BATCHES):
            for g, spec, eff in zip(gpus, specs, effs, strict=False):
                for ph, ops in enumerate(passes[model_name, b]):
                    out[g][mi, ph, bi] = sum(_old_roofline(f, n, spec, eff, h) for f, n, h in ops)
    if use_cache:
        save_arrays(name, {f"g{i}": out[g] for i, g in enumerate(gpus)})
    return out


# ------------------------------------------------------------------------------ report
def worst_cases(title: str, data, preds: dict[str, np.ndarray], k: int = 10) -> None:
    from gpemu.profiler.costfit import EVAL_BATCHES

    cases = []
    for g, p in preds.items():
        meas = data.measured_eval[g]
        tot_p, tot_m = p.sum(1), meas.sum(1)
        for mi, name in enumerate(data.names):
            for bi, b in enumerate(EVAL_BATCHES):
                if np.isfinite(tot_m[mi, bi]) and np.isfinite(tot_p[mi, bi]):
                    cases.append((tot_p[mi, bi] / tot_m[mi, bi] - 1, g, name, b, tot_m[mi, bi], tot_p[mi, bi]))
    cases.sort(key=lambda c: -abs(c[0]))
    print(f"\n   worst {k}, {title}:")
    for err, g, name, b, m, p in cases[:k]:
        print(
            f"     {short(g):9} {name:20} bs{b:<4} measured {1e3 * m:9.2f} ms  estimated {1e3 * p:9.2f} ms  "
            f"{100 * err:+7.1f}%"
        )


def short(gpu: str) -> str:
    from gpemu.costmodel.gpus import gpu_sheet

    return gpu_sheet(gpu).short_name


def table(
    title: str,
    data,
    preds: dict[str, np.ndarray],
    before: dict[str, np.ndarray] | None,
    extra: dict[str, str] | None = None,
) -> None:
    from gpemu.profiler.costfit import errors, summary

    print(f"\n== {title}")
    head = HEADER + ("   | before:" + HEADER[26 + 6 :] if before else "")
    print("   " + head)
    rows_all, rows_before = [], []
    for g, p in preds.items():
        e = errors(p, data.measured_eval[g])
        rows_all.append(e)
        line = row(f"{short(g)}{(' ' + extra[g]) if extra else ''}", summary(e))
        if before:
            eb = errors(before[g], data.measured_eval[g])
            rows_before.append(eb)
            line += "   |        " + row("", summary(eb))[26 + 6 :]
        print("   " + line)
    allp = np.stack(rows_all)
    line = row("all (fwd+bwd)", summary(allp))
    if before:
        line += "   |        " + row("", summary(np.stack(rows_before)))[26 + 6 :]
    print("   " + line)
    for ph, label in ((0, "forward only"), (1, "backward only")):
        e = np.stack([errors(p, data.measured_eval[g], total=False)[:, ph] for g, p in preds.items()])
        line = row(label, summary(e))
        if before:
            eb = np.stack([errors(before[g], data.measured_eval[g], total=False)[:, ph] for g in preds])
            line += "   |        " + row("", summary(eb))[26 + 6 :]
        print("   " + line)


def by_family(title: str, data, preds: dict[str, np.ndarray], before: dict[str, np.ndarray] | None) -> None:
    from gpemu.profiler.costfit import errors, summary

    print(f"\n== {title}, by model family (all GPUs, batch 16-256)")
    print("   " + HEADER + ("   | before mean" if before else ""))
    fams: dict[str, list[int]] = {}
    for i, n in enumerate(data.names):
        fams.setdefault(family(n), []).append(i)
    for fam, idx in sorted(
        fams.items(),
        key=lambda kv: -summary(np.stack([errors(p, data.measured_eval[g])[kv[1]] for g, p in preds.items()]))["mean"],
    ):
        e = np.stack([errors(p, data.measured_eval[g])[idx] for g, p in preds.items()])
        line = row(f"{fam} ({len(idx)})", summary(e))
        if before:
            eb = np.stack([errors(before[g], data.measured_eval[g])[idx] for g in preds])
            line += f"   | {pct(summary(eb)['mean'])}"
        print("   " + line)


def logo_analysis(data, full: dict, logo: dict) -> None:
    """Two diagnostics of the leave-one-GPU-out error (printed, not shipped):

    * every other generation as the donor, predictions averaged in log space: does what the
      measured generations share (efficiency relative to their datasheet peaks) beat the nearest
      relative alone?
    * the same op-model predictions with one scale per GPU taken out (the median log error over
      that GPU's cases): how much of the error is one number per GPU, which a single measured
      model on that GPU would supply and a datasheet does not.
    """
    from gpemu.profiler.costfit import errors, model_of, predict, summary

    everyone = model_of(full)
    models = list(range(len(data.names)))

    def median_log_error(pred: np.ndarray, g: str) -> float:
        """The median of log(estimate / measured) over ``g``'s cases: its one scale."""
        return float(np.nanmedian(np.log1p(errors(pred, data.measured_eval[g]))))

    ens, scaled = {}, {}
    single: dict[tuple[str, str], np.ndarray] = {}  # (held-out GPU, donor generation) -> predictions
    for g, v in logo.items():
        held = next(gen for gen, f in full.items() if f.gpu == g)
        others = [gen for gen in full if gen != held]
        for d in others:
            single[(g, d)] = predict(everyone.without(*[x for x in full if x != d]), data, g, models)
        ens[g] = np.exp(np.mean([np.log(single[(g, d)]) for d in others], axis=0))
        scaled[g] = v["op model"] * np.exp(-median_log_error(v["op model"], g))
    print("\n== leave-one-GPU-out diagnostics (not what ships)")
    print("   " + HEADER)
    for short_label, label, preds in (
        ("all donors", "every other generation as donor, geometric mean", ens),
        ("1 scale/GPU", "op model, one scale per GPU removed", scaled),
    ):
        for name, sel in (("all", list(preds)), ("no A100", [g for g in preds if "A100" not in g])):
            err = np.stack([errors(preds[g], data.measured_eval[g]) for g in sel])
            print("   " + row(f"{short_label}, {name}", summary(err)) + f"   {label}")
    per = {short(g): f"{100 * np.expm1(median_log_error(v['op model'], g)):+.0f}%" for g, v in logo.items()}
    print("   median error per GPU (op model): " + ", ".join(f"{k} {v}" for k, v in per.items()))
    # Each generation alone as the donor: is the error one scale per GPU (a row or column off the
    # same way whatever the donor) or the choice of donor? (The A100's curves are tensor-core
    # ones: as a donor for an FMA-only GPU they say little.)
    gens = list(full)
    print("\n   median error, each GPU (row) priced from one other generation's curves (column):")
    print("   " + f"{'':10}" + "".join(f"{short(full[d].gpu):>10}" for d in gens))
    for g in logo:
        cells = []
        for d in gens:
            p = single.get((g, d))
            cells.append(f"{'-':>10}" if p is None else f"{100 * np.expm1(median_log_error(p, g)):+9.0f}%")
        print("   " + f"{short(g):10}" + "".join(cells))


def shipped_fits(params: dict) -> dict:
    """The shipped ``params.json`` as the fit's ``GenFit`` objects (what ``costfit`` wrote them
    from, to 6 digits): LOGO and the warm starts of LOMO need the full fits, not a refit."""
    import math

    from gpemu.profiler.costfit import GenFit

    out = {}
    for gen, g in params["generations"].items():
        keys = tuple(sorted(g["curves"]))
        theta = []
        for k in keys:
            c = g["curves"][k]
            theta += [math.log(c["e"]), math.log(c["x0"]), c["p"], math.log(c["h"]), math.log(c.get("k0", 1e-9))]
        out[gen] = GenFit(
            generation=gen,
            gpu=g["gpu"],
            keys=keys,
            theta=np.array(theta),
            paths={k: g["curves"][k]["path"] for k in keys},
            uses_k0={k: "k0" in g["curves"][k] for k in keys},
        )
    return out


class Fits(NamedTuple):
    """What the tables are made of: the data, the full fits and the cross-validations."""

    data: FitData
    full: dict  # generation -> GenFit, fitted on every model
    lomo: dict[str, np.ndarray]  # GPU -> leave-one-model-out predictions
    logo: dict  # GPU -> {"op model", "transfer", "donor"}: leave-one-GPU-out
    before: dict[str, np.ndarray] | None  # --before: today's estimator's predictions


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--before", action="store_true", help="also today's estimator (gpemu.costs.estimate_module)")
    ap.add_argument("--no-cache", action="store_true", help="recompute op lists, LOMO and --before figures")
    ap.add_argument(
        "--refit",
        action="store_true",
        help="fit every GPU on all models again instead of reading the shipped params.json (which "
        "python -m gpemu.profiler.costfit wrote from the same fit; ~10 min on 2 cores)",
    )
    ap.add_argument("--worst", type=int, default=10, help="worst cases listed per table (default 10)")
    return ap


def cross_validate(args: argparse.Namespace, db, data_version: str) -> Fits:
    """Records the op lists, fits (or reads the shipped fits), and runs LOMO, LOGO and --before,
    with a progress bar."""
    from gpemu.costmodel.model import CostModel
    from gpemu.profiler import costfit as F

    with progress_bar(description_width=44) as pb:
        t_rec = pb.add_task("op lists (meta device, cached)", total=None)
        data = F.FitData.build(db, progress=lambda n: pb.update(t_rec, description=f"recording {n}"))
        pb.update(t_rec, total=1, completed=1)
        if args.refit:
            t_fit = pb.add_task("fitting each GPU on all models", total=len(data.gpus))
            full = {}
            for g in data.gpus:
                f = F.fit_generation(data, g)
                full[f.generation] = f
                pb.advance(t_fit)
        else:
            full = shipped_fits(CostModel.load().params)
        t_cv = pb.add_task("leave-one-model-out fits", total=len(data.gpus) * len(data.names))

        def lomo_progress(g: str, n: str) -> None:
            pb.update(t_cv, description=f"LOMO {short(g)} {n}")
            pb.advance(t_cv)

        lomo = F.lomo(data, full, progress=lomo_progress, cache=None if args.no_cache else data_version)
        logo = F.logo(data, full)
        before = before_predictions(data, db, list(data.gpus), not args.no_cache, pb) if args.before else None
    return Fits(data, full, lomo, logo, before)


def report(fits: Fits, worst: int) -> None:
    """The tables: in sample, LOMO, LOGO (op model and transfer), and the notes that go with them."""
    from gpemu.costmodel.model import CostModel
    from gpemu.profiler import costfit as F

    data, full, lomo, logo, before = fits
    shipped = CostModel.load()
    in_sample = {g: F.predict(shipped, data, g, list(range(len(data.names)))) for g in data.gpus}
    table("shipped parameters, in sample (fitted on every model; for reference)", data, in_sample, None)
    table("leave-one-model-out: each model priced by curves fitted without it", data, lomo, before)
    worst_cases("leave-one-model-out", data, lomo, worst)
    by_family("leave-one-model-out", data, lomo, before)
    donors = {g: f"<- {short(v['donor'])}" for g, v in logo.items()}
    op_model = {g: v["op model"] for g, v in logo.items()}
    table(
        "leave-one-GPU-out, op model: each GPU from its datasheet + the donor generation's curves",
        data,
        op_model,
        None,
        donors,
    )
    no_a100 = {g: p for g, p in op_model.items() if "A100" not in g}
    errors = np.stack([F.errors(p, data.measured_eval[g]) for g, p in no_a100.items()])
    print("   " + row("all but A100 (see note)", F.summary(errors)))
    worst_cases("leave-one-GPU-out, op model", data, op_model, worst)
    table(
        "leave-one-GPU-out, transfer: the model's time measured on the donor GPU x the op model's ratio",
        data,
        {g: v["transfer"] for g, v in logo.items()},
        None,
        donors,
    )
    logo_analysis(data, full, logo)
    if before:
        worst_cases("today's estimator (estimate_module)", data, before, worst)
    print(
        "\nnote: LOGO for the A100 has no donor with tensor-core measurements (every other measured GPU ran "
        "fp32 on SIMT units), so its TF32 convolutions take the donor's SIMT curves carried to tensor cores "
        "(gpemu.costmodel.model.tensor_from_simt); datasheet GPUs of Ampere and later take the A100's "
        "tensor-core curves instead."
    )
    if before:
        print(
            "note: --before's efficiency is calibrated on each GPU's own database models at batch 64 "
            "(the held-out model included), so it is not a leave-one-out figure; it is what gpemu does today."
        )


def main() -> int:
    args = _parser().parse_args()
    print(f"machine: {machine()}")
    import torch

    import gpemu
    from gpemu.db import open_profile_db
    from gpemu.profiler import costfit as F
    from gpemu.profiler.costdata import cache_dir

    print(f"torch {torch.__version__}, numpy {np.__version__}; cache {cache_dir()}")
    db = open_profile_db(gpemu.EmuConfig.from_env())
    meta = db.meta()
    started = time.perf_counter()
    fits = cross_validate(args, db, meta.get("data_version", ""))
    took = time.perf_counter() - started
    names, gpus = fits.data.names, fits.data.gpus
    print(
        f"database: {meta.get('source', '')} (data {meta.get('data_version', '')}); "
        f"{len(names)} models x {len(gpus)} GPUs x batch {', '.join(map(str, F.EVAL_BATCHES))} "
        f"= {len(names) * len(gpus) * len(F.EVAL_BATCHES)} cases; {took:.0f} s"
    )
    report(fits, args.worst)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(130)

"""The emulator against a real GPU: what gpemu charges for a GPU it has no model measurements of,
compared with what ``gpemu profile`` measured on that GPU.

On the machine with the GPU (``--ops`` optional; it lets the second column below exist)::

    gpemu profile --model resnet50 --model alexnet --batch-sizes 32,128 --db sqlite:///real.sqlite
    gpemu profile --ops --db sqlite:///real.sqlite

Anywhere (the database, or its `gpemu db export`)::

    python benchmarks/vs_real_gpu.py --db sqlite:///real.sqlite
    python benchmarks/vs_real_gpu.py --db benchmarks/data/h100-2026-11-26.json

For every (model, batch size) the database measured, the profiler's own loop (forward with its
cross-entropy loss, backward, SGD-momentum step; gradients set to None before each iteration, as
the profiler does, so a backward assigns them and launches no accumulation; every phase between
synchronisations) runs under ``gpemu.emulate`` on a virtual clock, emulating the measured GPU by
name, with the shipped database (which holds no measurement of that GPU), so every time is the
cost model's estimate:

* **datasheet**: the GPU's datasheet and a donor generation's curves (what any user gets);
* **calibrated**: the same, with the GPU's own ``--ops`` curves from ``--db`` (when it has them).

Each is printed beside the measured forward, backward and optimizer step and their sum, with the
error of the sum; the summary adds the datasheet variant's error phase by phase. The real figures
are what the profiler's CUDA events measured, so they include any time the GPU waited for the
host to launch kernels: where the host is slow and the GPU fast
(small models, small batches), a real forward can take longer at batch 32 than at 128 (flagged
``host-bound?``). ``--host`` names the modelled host issuing the emulated loop (gpemu.time.launch):
by default ``h100-xeon``, the host of the stored H100 measurements; ``--host none`` prices GPU time
only, as gpemu did before the host model. On this script's manual clock only modelled host time
counts, not the loop's own Python.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from _common import database_url, machine  # (puts the repository on sys.path)
from accuracy import build  # the model on uninitialised host memory, as accuracy.py builds it
from torch.nn import functional as F

import gpemu
from examples import tvmodels
from gpemu.clock import VirtualClock
from gpemu.db.build import ensure_default_db, make_engine, sqlite_url
from gpemu.db.op_measurements import read_curves, write_curves

PHASES = ("forward", "backward", "optimizer_step")


def measured(engine, gpu: str) -> dict[tuple[str, int], dict[str, float]]:
    """{(model, batch): {phase: median seconds}} of ``gpu`` in the profile database."""
    from sqlalchemy import text

    rows = (
        engine.connect()
        .execute(
            text(
                "select m.name, me.batch_size, me.kind, coalesce(me.p50, me.value) from measurements me "
                "join models m on m.id = me.model_id join gpus g on g.id = me.gpu_id "
                "where g.name = :gpu and me.world_size = 1 "
                "and me.kind in ('forward', 'backward', 'optimizer_step', 'peak_memory')"
            ),
            {"gpu": gpu},
        )
        .all()
    )
    out: dict[tuple[str, int], dict[str, float]] = {}
    for name, bs, kind, value in rows:
        out.setdefault((name, bs), {})[kind] = value
    return {k: v for k, v in out.items() if all(p in v for p in PHASES)}


def emulated(gpu: str, db_url: str, name: str, batch: int, iterations: int = 4, host: str = "none") -> dict[str, float]:
    """The profiler's loop for ``name`` at ``batch`` on an emulated ``gpu``: {phase: seconds}
    of the last iteration, on the emulated GPU's timeline, and its ``peak_memory`` (bytes).
    ``host``: the modelled host issuing it (gpemu.time.launch; on this manual clock the loop's
    own Python time does not count, only the modelled issue time)."""
    module, _ = build(name)  # (a torchvision architecture: not a stand-in)
    x, y = torch.empty(batch, 3, 224, 224), torch.zeros(batch, dtype=torch.long)
    with gpemu.emulate(gpu=gpu, db_url=db_url, clock=VirtualClock(), summary=False, host=host) as rt:
        now = rt.engine.now
        model = module.cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        xd, yd = x.cuda(), y.cuda()
        times: dict[str, float] = {}
        for _ in range(iterations):
            # (the profiler's loop, profiler/measure.py: the real backward assigned each gradient)
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = now()
            out = model(xd)
            loss = F.cross_entropy(out[0] if isinstance(out, tuple) else out, yd)
            torch.cuda.synchronize()
            t1 = now()
            loss.backward()
            torch.cuda.synchronize()
            t2 = now()
            opt.step()
            torch.cuda.synchronize()
            times = {
                "forward": t1 - t0,
                "backward": t2 - t1,
                "optimizer_step": now() - t2,
                "peak_memory": torch.cuda.max_memory_allocated(),
            }
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--db",
        required=True,
        help="SQLAlchemy URL of the database `gpemu profile` wrote on the real GPU, "
        "or a `gpemu db export` of it (JSON file or CSV directory)",
    )
    p.add_argument("--gpu", help="the GPU's name in that database (default: its only GPU)")
    p.add_argument(
        "--host",
        default="h100-xeon",
        help="the modelled host issuing the emulated loop (gpemu run --host: h100-xeon, the host those "
        "measurements were taken on, by default; none: GPU time only, as before the host model)",
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = database_url(p, a.db, Path(tmp))
        return compare(p, make_engine(url), a.db, a.gpu, a.host)


def compare(p: argparse.ArgumentParser, real, where: str, gpu: str | None, host: str = "none") -> int:
    """Print the comparison for ``gpu`` of the real GPU's database ``real``."""
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    try:
        names = [r[0] for r in real.connect().execute(text("select name from gpus")).all()]
    except SQLAlchemyError as exc:
        p.error(f"--db {where}: not a readable profile database ({type(exc).__name__})")
    gpu = gpu or (names[0] if len(names) == 1 else None)
    if gpu not in names:
        p.error(f"--gpu must name one of the database's GPUs: {', '.join(names) or 'none'}")
    cases = measured(real, gpu)
    known = {k: v for k, v in cases.items() if k[0] in tvmodels.MODELS}
    if not known:
        p.error(f"the database holds no forward/backward/optimizer_step of a torchvision model on {gpu}")
    curves = read_curves(real, gpu)
    print(f"machine: {machine()}; torch {torch.__version__}")
    print(f"real: {gpu} in {where} ({len(known)} cases; op curves: {len(curves) or 'none'}); emulated host: {host}")
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"datasheet": sqlite_url(ensure_default_db(Path(tmp) / "datasheet"))}
        if curves:
            path = ensure_default_db(Path(tmp) / "calibrated")
            write_curves(make_engine(sqlite_url(path)), gpu, curves)
            variants["calibrated"] = sqlite_url(path)
        head = f"{'model':20} {'bs':>4} {'real fwd':>9} {'bwd':>7} {'step':>6} {'sum ms':>8} {'peak GiB':>9}"
        for v in variants:
            head += f" | {v + ' sum':>15} {'error':>7}"
        print(head + f" | {'emulated peak':>13} {'error':>7}")
        errors: dict[str, list[float]] = {v: [] for v in variants}
        memory: list[float] = []
        by_phase: dict[str, list[float]] = {ph: [] for ph in PHASES}  # datasheet, phase by phase
        for (name, bs), m in sorted(known.items()):
            total = sum(m[p] for p in PHASES)
            line = (
                f"{name:20} {bs:4d} {1e3 * m['forward']:9.2f} {1e3 * m['backward']:7.2f} "
                f"{1e3 * m['optimizer_step']:6.2f} {1e3 * total:8.2f} {m.get('peak_memory', 0) / 2**30:9.2f}"
            )
            peak = 0.0
            for v, url in variants.items():
                e = emulated(gpu, url, name, bs, host=host)
                if v == "datasheet":
                    for ph in PHASES:
                        by_phase[ph].append(e[ph] / m[ph] - 1)
                err = sum(e[p] for p in PHASES) / total - 1
                errors[v].append(err)
                peak = e["peak_memory"]
                line += f" | {1e3 * sum(e[p] for p in PHASES):15.2f} {100 * err:+6.1f}%"
            if m.get("peak_memory"):
                memory.append(peak / m["peak_memory"] - 1)
                line += f" | {peak / 2**30:13.2f} {100 * memory[-1]:+6.1f}%"
            # A forward slower at this batch than at a larger one: the GPU waited for the host.
            if any(n == name and b > bs and c["forward"] < m["forward"] for (n, b), c in known.items()):
                line += "  host-bound?"
            print(line, flush=True)
    phases = [(f"datasheet, {ph.replace('_', ' ')} alone", errs) for ph, errs in by_phase.items()]
    for v, errs in (*errors.items(), *phases, ("peak memory", memory)):
        if not errs:
            continue
        a_ = sorted(abs(e) for e in errs)
        print(
            f"{v}: n={len(errs)}, mean |error| {100 * sum(a_) / len(a_):.1f}%, median {100 * a_[len(a_) // 2]:.1f}%, "
            f"worst {100 * a_[-1]:.1f}%, mean signed {100 * sum(errs) / len(errs):+.1f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

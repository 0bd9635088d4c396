"""What a real GPU's convolutions and GEMMs deliver against what the cost model's donor curves say:
the source of ``gpemu.costmodel.gpus.TENSOR_CONV_SHARE``.

A GPU with no curves of its own (the H100: none in the shipped database) prices its tensor-core
work with Ampere's curves at its own datasheet peak. ``gpemu profile --ops`` on the real GPU times
single kernels of every kind (CUDA events); for each convolution kind and pass (forward, and the
backward's gradients: different cuDNN kernels), and for GEMMs over both passes, this prints, over
the larger half of its kernels (the compute-bound end, where the plateau decides), the geometric mean of the
shipped price over the measured time, and the share that would make it 1 (the shipped share times
that ratio)::

    python benchmarks/hopper_share.py --db benchmarks/data/h100-2026-11-26.json

Only the op sweep is read: the training steps that ``benchmarks/vs_real_gpu.py`` compares with are
held out.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _common import database_url, machine  # (puts the repository on sys.path)

from gpemu.costmodel import OpClass, Precision, default_model
from gpemu.costmodel.curve import kernel_seconds
from gpemu.costmodel.gpus import gpu_sheet, tensor_conv_share
from gpemu.costmodel.model import floor_seconds
from gpemu.db.build import make_engine
from gpemu.db.op_measurements import OpMeasurement, op_gpus, read_measurements

KINDS = {
    "conv1x1": OpClass.CONV,
    "conv_spatial": OpClass.CONV,
    "conv_strided": OpClass.CONV,
    "conv_grouped": OpClass.CONV_GROUPED,
    "gemm": OpClass.GEMM,
}


@dataclass(frozen=True)
class KindRatio:
    """One kind of kernel: how many of its larger kernels were compared, the geometric mean of the
    shipped price over the measured time, and the share in force now."""

    kind: str
    n: int
    priced_over_measured: float
    share: float


def priced_over_measured(gpu: str, m: OpMeasurement) -> float:
    """The shipped model's price of one swept kernel over its measured time."""
    sheet = gpu_sheet(gpu)
    base = m.key.partition(".")[0]
    meta = m.metadata
    precision = Precision(
        "float32", allow_tf32_matmul=bool(meta.get("tf32_matmul")), allow_tf32_cudnn=bool(meta.get("tf32_cudnn", True))
    )
    pr = default_model().priced(sheet, KINDS[base], m.dtype, precision, m.key)
    g = kernel_seconds(m.work, pr.peak, sheet.sm_count, pr.curve, m.z)
    if pr.floor and meta.get("floor_bytes"):
        g = max(g, float(floor_seconds(float(meta["floor_bytes"]), pr.bandwidth)))
    return g / m.seconds


def kind_ratios(gpu: str, rows: list[OpMeasurement]) -> list[KindRatio]:
    """Per convolution kind and pass (``conv_spatial.fwd``, ...), and for GEMMs over both passes:
    the larger half (by work) of each (key, dtype) sweep, pooled."""
    sheet = gpu_sheet(gpu)
    out = []
    groups = [f"{kind}.{phase}" for kind in KINDS if kind != "gemm" for phase in ("fwd", "bwd")] + ["gemm"]
    for group in groups:
        logs: list[float] = []
        members = {(m.key, m.dtype) for m in rows if group in (m.key, m.key.partition(".")[0])}
        for key, dtype in sorted(members):
            sweep = sorted((m for m in rows if m.key == key and m.dtype == dtype), key=lambda m: m.work)
            logs += [math.log(priced_over_measured(gpu, m)) for m in sweep[len(sweep) // 2 :]]
        if logs:
            share = tensor_conv_share(sheet.generation, group, "ampere") if group != "gemm" else 1.0
            out.append(KindRatio(group, len(logs), math.exp(sum(logs) / len(logs)), share))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--db", required=True, help="SQLAlchemy URL or `gpemu db export` file holding `gpemu profile --ops` rows"
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(database_url(p, a.db, Path(tmp)))
        print(f"machine: {machine()}")
        for gpu in op_gpus(engine):
            print(f"{gpu} ({gpu_sheet(gpu).generation}): kernels of the op sweep's larger half per kind")
            print(f"{'kind':17} {'n':>3} {'priced/measured':>16} {'share now':>10} {'share implied':>14}")
            for r in kind_ratios(gpu, read_measurements(engine, gpu)):
                implied = r.share * r.priced_over_measured
                print(f"{r.kind:17} {r.n:3d} {r.priced_over_measured:16.3f} {r.share:10.2f} {implied:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

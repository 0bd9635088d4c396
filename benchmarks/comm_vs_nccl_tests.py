"""gpemu's collective model (``gpemu comm-bench``) against published nccl-tests tables.

    python benchmarks/comm_vs_nccl_tests.py            # every reference, mean |error| per table
    python benchmarks/comm_vs_nccl_tests.py --rows     # and each size

Each reference is one published nccl-tests run (out-of-place ``busbw`` column, GB/s, float sum,
sizes 1 MiB to 8 GiB where the table has them), the cluster preset that describes its system,
and where it was published. ``fit`` marks the tables the constants of
:mod:`gpemu.costmodel.nccl` were fitted to (by hand, one set for every system); the others are
held out: other collectives of the same machine, and other machines. The target (issue 30):
mean |error| <= 10% over 1 MB-8 GB for 8 x A100, 8 x H100 and two nodes of each over IB.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpemu.costmodel.comm import Collective, collective_cost  # noqa: E402
from gpemu.costmodel.nccl import CommPath  # noqa: E402
from gpemu.costmodel.topology import preset  # noqa: E402

MIB = 1 << 20
SIZES = [MIB << i for i in range(14)]  # 1 MiB .. 8 GiB


@dataclass(frozen=True)
class Reference:
    name: str
    preset: str
    nodes: int
    kind: Collective
    busbw: tuple[float, ...]  # GB/s at SIZES[first:first + len]
    source: str
    fit: bool
    first: int = 0  # index into SIZES of the first value


SUPERBENCH = (
    "microsoft/superbenchmark tests/benchmarks/micro_benchmarks/test_cuda_nccl_bw_performance.py "
    "(8 x A100-SXM4-40GB, one process, nccl-tests output kept as test data)"
)
REFERENCES: tuple[Reference, ...] = (
    Reference(
        "8 x A100 SXM all-reduce",
        "dgx-a100",
        1,
        Collective.ALL_REDUCE,
        (24.54, 39.26, 65.52, 90.63, 129.90, 156.89, 200.91, 202.11, 222.40, 223.68, 230.29, 231.76, 234.37, 235.26),
        SUPERBENCH,
        True,
    ),
    Reference(
        "8 x H100 SXM all-reduce (NVLS)",
        "dgx-h100",
        1,
        Collective.ALL_REDUCE,
        (67.04, 86.94, 135.44, 176.77, 237.21, 294.69, 361.67, 400.53, 422.25, 436.79, 466.33, 473.37, 477.24, 480.16),
        "NVIDIA DGX Cloud benchmarking recipe microbenchmark_nccl, README sample (DGX H100, IB Quantum-2/CX7)",
        True,
    ),
    Reference(
        "2 x 8 A100 over IB HDR all-reduce",
        "dgx-a100",
        2,
        Collective.ALL_REDUCE,
        (20.40, 30.59, 53.11, 74.51, 94.35, 102.21, 134.92, 150.45, 167.02, 176.54, 181.98, 186.10, 188.34, 189.20),
        "Azure NDm A100 v4 (8 x 200 Gb/s HDR IB) NCCL test on AKS, a public guide; NVIDIA quotes 192 GB/s "
        "for two DGX A100 (NVIDIA/nccl#812)",
        True,
    ),
    Reference(
        "2 x 8 H200 over IB NDR all-reduce",
        "dgx-h200",
        2,
        Collective.ALL_REDUCE,
        (421.59, 455.85, 470.26, 477.86, 481.35),
        "skypilot-org/skypilot CoreWeave InfiniBand example (2 nodes x 8 H200, 8 x 400 Gb/s IB)",
        True,
        first=9,
    ),
    Reference(
        "2 x 8 H200 over RoCE 400G all-reduce",
        "dgx-h200",
        2,
        Collective.ALL_REDUCE,
        (25.58, 45.53, 74.10, 105.03, 103.37, 227.23, 272.94, 339.10, 394.69, 432.57, 458.75, 473.86, 481.78, 485.57),
        "Dell XE9680 H200 x 2, Spectrum-X 400GbE (BlueField-3), NCCL 2.30: a public OpenShift guide",
        True,
    ),
    # ------------------------------------------------------------------ held out
    Reference(
        "8 x A100 SXM all-gather",
        "dgx-a100",
        1,
        Collective.ALL_GATHER,
        (12.58, 23.75, 36.43, 59.44, 87.52, 110.46, 154.65, 168.12, 197.01, 203.88, 212.88, 217.01, 220.85, 223.39),
        SUPERBENCH,
        False,
    ),
    Reference(
        "8 x A100 SXM reduce-scatter",
        "dgx-a100",
        1,
        Collective.REDUCE_SCATTER,
        (12.68, 22.76, 33.72, 49.84, 96.34, 122.06, 164.89, 190.01, 211.84, 216.58, 223.54, 224.85, 229.15, 231.52),
        SUPERBENCH,
        False,
    ),
    Reference(
        "8 x A100 SXM broadcast",
        "dgx-a100",
        1,
        Collective.BROADCAST,
        (13.79, 26.85, 51.74, 86.30, 117.22, 150.21, 179.05, 199.67, 211.11, 220.37, 225.14, 230.56, 232.33, 232.81),
        SUPERBENCH,
        False,
    ),
    Reference(
        "8 x A100 SXM all-to-all",
        "dgx-a100",
        1,
        Collective.ALL_TO_ALL,
        (10.50, 20.48, 38.05, 60.62, 91.55, 123.64, 147.99, 185.35, 197.53, 210.03, 216.71, 220.79, 222.90, 224.31),
        SUPERBENCH,
        False,
    ),
    Reference(
        "8 x H100 SXM all-reduce, AWS p5",
        "dgx-h100",
        1,
        Collective.ALL_REDUCE,
        (64.24, 84.47, 132.41, 174.16, 236.82, 295.63, 359.54, 396.19, 418.91, 433.90, 441.81, 444.02, 475.97, 480.43),
        "aws-samples/awsome-distributed-training NCCL tests on AWS Batch (p5.48xlarge)",
        False,
    ),
    Reference(
        "2 x 8 A100 over RoCE all-reduce, OCI",
        "dgx-a100",
        2,
        Collective.ALL_REDUCE,
        (22.97, 39.64, 61.93, 90.25, 111.29, 139.08, 153.13, 163.20, 165.42, 156.41, 219.12, 220.16, 235.63, 237.94),
        "oracle-quickstart/oci-hpc-oke README (OCI BM.GPU4.8 x 2: A100-SXM4-40GB, 1.6 Tb/s RDMA per node)",
        False,
    ),
)


def modelled_busbw(ref: Reference, nbytes: int) -> float:
    cluster = preset(ref.preset, nodes=ref.nodes)
    path = CommPath.of(cluster, [cluster.node_of(r) for r in range(cluster.world_size)])
    return collective_cost(ref.kind, nbytes, path).busbw / 1e9


def errors(ref: Reference) -> list[tuple[int, float, float, float]]:
    """(size, published GB/s, modelled GB/s, relative error) per size of the reference."""
    rows = []
    for i, published in enumerate(ref.busbw):
        size = SIZES[ref.first + i]
        model = modelled_busbw(ref, size)
        rows.append((size, published, model, (model - published) / published))
    return rows


def mean_abs_error(ref: Reference) -> float:
    rows = errors(ref)
    return sum(abs(e) for *_, e in rows) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", action="store_true", help="print every size, not only the means")
    args = parser.parse_args()
    print(f"{'reference':44} {'preset':>10} {'n':>3} {'sizes':>5} {'mean |err|':>10} {'max |err|':>9}  set")
    for ref in REFERENCES:
        rows = errors(ref)
        worst = max(abs(e) for *_, e in rows)
        fitted = "fit" if ref.fit else "held out"
        print(
            f"{ref.name:44} {ref.preset:>10} {ref.nodes:>3} {len(rows):>5} {100 * mean_abs_error(ref):9.1f}%"
            f" {100 * worst:8.1f}%  {fitted}"
        )
        if args.rows:
            for size, published, model, e in rows:
                print(f"    {size:>12}  published {published:7.2f}  gpemu {model:7.2f} GB/s  {100 * e:+6.1f}%")
    print()
    for ref in REFERENCES:
        print(f"  {ref.name}: {ref.source}")


if __name__ == "__main__":
    main()

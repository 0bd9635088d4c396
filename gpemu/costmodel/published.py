"""Figures the cost model takes from public measurements, because its calibration cannot identify them.

The profile database measured 36 ImageNet CNNs (``gpemu.profiler.costfit`` fits the curves on
them). Their GEMMs are the classifier layers — M = the batch (1-256), in the backward pass a
weight gradient with K = the batch — and whole-model times hardly depend on how fast a *large*
GEMM runs; their fused attention kernels do not exist. So where a large GEMM's or an attention
kernel's rate levels off (the curve's plateau ``e``) is set here from published measurements,
and the calibration fits only how fast the curve gets there (``x0``, ``p``), the depth term
``k0`` and the host time ``h``. Every number below names its source; all are fractions of the
datasheet peak the op is priced against (:mod:`gpemu.costmodel.precision`).
"""

from __future__ import annotations

__all__ = [
    "GEMM_PLATEAU_SIMT",
    "TENSOR_PLATEAU",
    "TENSOR_PLATEAU_DEFAULT",
    "tensor_plateau",
    "DELIVERED_SHARE",
    "carried_share",
    "ATTENTION_FACTOR",
    "KERNEL_RAMP_MAX",
    "MEMORY_PLATEAU",
    "STREAM_PLATEAU",
    "STREAM_PLATEAU_DEFAULT",
    "stream_plateau",
    "STREAM_FILL_MAX",
    "PUBLISHED_GEMMS",
    "PublishedGemm",
]

from dataclasses import dataclass

from .gpus import GENERATIONS

# Large FP32 GEMMs on the FMA (SIMT) units: cuBLAS / torch.matmul reach 72-90% of the datasheet
# FP32 peak on large square matrices:
#   * torch.matmul fp32, n = 8000: A100 40GB 14.1 TFLOP/s = 72% of 19.5; RTX 2080 Ti 11.4 = 85% of
#     13.4 (github.com/bewantbe/busy-gemm-benchmark, README);
#   * cuBLAS SGEMM 4096^3 on a GTX 1080 Ti: 10.18 TFLOP/s = 90% of 11.3 (github.com/zkh2016/sgemm).
# (The A100 sustains ~1.3 GHz under full FMA load, not its 1.41 GHz boost: the low end.)
GEMM_PLATEAU_SIMT = 0.80

# Large GEMMs on tensor cores: "maximum achievable matmul FLOPS" (BF16 inputs, best of a shape
# search; stas00/ml-engineering, compute/accelerator/README.md, MAMF table): A100 SXM 267.9 of 312
# TFLOP/s (85.9%), A100 PCIe 256.4 (82.2%), H100 SXM 792.1 of 989 (80.1%), GH200 821.0 (83.0%).
# Other generations have no such figure here: the lower measured one (80%) stands in. TF32 and FP16
# use the same fraction of their own peaks (the A100's TF32 1x1 convolutions, the only tensor-core
# work the database measured, calibrate to a plateau of 0.9 of the TF32 peak: not lower).
TENSOR_PLATEAU = {"ampere": 0.86, "hopper": 0.80}
TENSOR_PLATEAU_DEFAULT = 0.80


def tensor_plateau(generation: str) -> float:
    """Plateau of a large tensor-core GEMM on a GPU of ``generation`` (fraction of its dense peak)."""
    return TENSOR_PLATEAU.get(generation, TENSOR_PLATEAU_DEFAULT)


# Fused attention (flash / memory-efficient kernels) relative to a GEMM on the same units:
# FlashAttention-2 reaches "50-73% of the theoretical maximum FLOPs/s on A100" (Dao 2023,
# arXiv:2307.08691, abstract) where cuBLAS reaches 86% (above): the forward at the top of that
# range (0.73 / 0.86 = 0.85 of the GEMM curve), the backward — five GEMMs plus the recomputed
# softmax, the slower pass in every FlashAttention benchmark — at its bottom (0.50 / 0.86 = 0.58).
ATTENTION_FACTOR = {"fwd": 0.85, "bwd": 0.58}

# The matmul family's roofline floor: a kernel cannot move its bytes faster than streaming
# benchmarks move bytes. BabelStream / STREAM-style copy and triad kernels reach about 85-92% of
# the datasheet bandwidth on V100, A100 and H100 (e.g. A100 40GB ~1.4 of 1.555 TB/s): a floor is a
# best case, so the top of that range. (The fitted elementwise curves are no floor: a backward
# elementwise pass fits to 20-50% of the bandwidth, because it also carries autograd's bookkeeping.)
MEMORY_PLATEAU = 0.9

# What a well-written streaming kernel (an elementwise op, a copy or cat, a large reduction) reaches
# of the datasheet bandwidth, per generation: the plateau of those curves. The CNN measurements
# cannot identify it (their streaming ops are small, and their per-op costs drag a fitted plateau
# to 40-50%, so a 64 MiB add priced at 45% of an A100's bandwidth); fixed here like the GEMMs'.
#   * Volta: V100 PCIe 750 of 900 GB/s, 83% (Jia et al., "Dissecting the NVIDIA Volta GPU
#     Architecture via Microbenchmarking", arXiv:1804.06826, 2018, global memory throughput);
#   * Ampere: A100 80GB SXM 1.80 of 2.04 TB/s, 88%, Nsight Compute agreeing, and "around 90%" the
#     most any kernel reached in an NVIDIA GTC talk (forums.developer.nvidia.com, "Trouble to reach
#     peak bandwidth of A100").
#   * Hopper: H100 80GB HBM3 (SXM), the op sweep in benchmarks/data/h100-2026-11-26.json (CUDA
#     events, 64-768 MiB): add 3.04, threshold_backward 3.03, clone 2.94, cat 2.88, sum 2.82 TB/s
#     of 3.35: 84-91%, 88% the middle.
# Other generations: no figure found here; 85% stands in (the middle of the 80-90% that
# BabelStream-style copy and triad kernels reach on recent HBM GPUs).
STREAM_PLATEAU = {"volta": 0.83, "ampere": 0.88, "hopper": 0.88}
STREAM_PLATEAU_DEFAULT = 0.85

# A streaming kernel's fixed time (its launch on the GPU, its first and last waves) is at most this
# much: the same sweep's smallest kernels (16 KiB-1 MiB) took 2.1-2.6 us (elementwise, copies) and
# 3.5-4.8 us (a sum's two stages). A bound for the fit, like KERNEL_RAMP_MAX: the rest of the CNN
# measurements' per-op costs is host time.
STREAM_FILL_MAX = 5e-6


def stream_plateau(generation: str) -> float:
    """Plateau of a large streaming kernel on a GPU of ``generation`` (fraction of its bandwidth)."""
    return STREAM_PLATEAU.get(generation, STREAM_PLATEAU_DEFAULT)


# What an SM generation delivers of its datasheet figures, relative to Maxwell's SM and every later
# one (1.0). Curves calibrated on one generation price another generation's GPU (a datasheet GPU,
# or leave-one-GPU-out) against that GPU's own datasheet peaks; where the two SMs turn datasheet
# figures into delivered work differently, the peak is scaled by the ratio (:func:`carried_share`).
# Kepler's SMX has 192 FP32 lanes behind 4 schedulers, 128 lanes a clock without dual issue; Maxwell
# cut the SM to 128 lanes (4 x 32, one instruction a clock each) and NVIDIA puts the difference at
# "135% performance per core" (GeForce GTX 750 Ti whitepaper, 2014) and "performance per SM usually
# within 10% of Kepler" with two thirds of the cores (Maxwell Tuning Guide, Instruction Scheduling):
# a Kepler lane delivers 1/1.35 of a Maxwell lane. From Maxwell on every SM's lanes are those its
# schedulers fill issuing one instruction a clock, and NVIDIA's later per-core claims (Turing: 50%
# per core over Pascal) come from running integer instructions beside floating-point ones in
# graphics shaders, which CNN and GEMM kernels hardly issue: not used. A delivered-work figure of
# the whole SM, so it scales memory-bound kernels (issued by the same SMs) as well as arithmetic.
DELIVERED_SHARE = {"kepler": 1 / 1.35}


def carried_share(gpu_generation: str, curve_generation: str) -> float:
    """Factor on a GPU's datasheet peaks when ops of its ``gpu_generation`` are priced with a curve
    calibrated on ``curve_generation`` (1 for its own generation's curves, or a GPU's own calibration,
    whose generation is not a generation name)."""
    if curve_generation == gpu_generation or curve_generation not in GENERATIONS:
        return 1.0
    return DELIVERED_SHARE.get(gpu_generation, 1.0) / DELIVERED_SHARE.get(curve_generation, 1.0)


# How long a kernel may take to fill the GPU: at most this much work *at the plateau rate* lies
# below the curve's half-way point x0 (a bound for the fit, in seconds). A kernel launch and its
# ramp cost a few microseconds; the CNN measurements also carry per-op costs that have nothing to
# do with a kernel's size (host time, their backward's per-parameter work), which without this
# bound a curve could absorb as a large x0 — and charge every op of a transformer, which runs
# many more GEMMs per parameter, for it.
KERNEL_RAMP_MAX = 20e-6


@dataclass(frozen=True)
class PublishedGemm:
    """One published GEMM rate: what the model is checked against (never fitted to)."""

    gpu: str
    dtype: str
    m: int
    n: int
    k: int
    tflops: float
    source: str


PUBLISHED_GEMMS: tuple[PublishedGemm, ...] = (
    PublishedGemm(
        "A100", "bfloat16", 6912, 16384, 2048, 267.9, "MAMF table, stas00/ml-engineering (A100 SXM, CUDA 12.1)"
    ),
    PublishedGemm(
        "H100", "bfloat16", 6144, 17920, 2816, 792.1, "MAMF table, stas00/ml-engineering (H100 SXM, CUDA 12.1)"
    ),
    PublishedGemm(
        "A100",
        "float32",
        8000,
        8000,
        8000,
        14.1,
        "torch.matmul fp32, github.com/bewantbe/busy-gemm-benchmark (A100 40G)",
    ),
    PublishedGemm(
        "A100",
        "tf32",
        8000,
        8000,
        8000,
        108.0,
        "torch.matmul with TF32, github.com/bewantbe/busy-gemm-benchmark (A100 40G)",
    ),
)

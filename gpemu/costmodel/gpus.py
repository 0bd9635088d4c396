"""GPU facts: the one place gpemu writes them down, for measured and datasheet-only GPUs.

A plain table (:data:`GPUS`, one :class:`GpuSheet` per GPU) and the rules that follow from it:
generations (:data:`GENERATIONS`, :data:`DONORS`, :func:`generation_capability`,
:func:`first_generation_with`), host links (:func:`pcie_link_rate`, :func:`pinned_copy_rate`,
:func:`pageable_copy_rate`), what an unknown GPU is taken for (:data:`DEFAULT_GENERATION`,
:data:`DEFAULT_PCIE_GEN`) and a GPU's compute capability (:func:`compute_capability`). The
profile database's GPU rows (``gpemu.db.GpuSpec``) are made from these sheets
(``gpemu.db.specs``), and ``gpemu gpus add`` fills in what a datasheet leaves out from these
rules (``gpemu.db.datasheet``); neither restates a figure.

Figures are NVIDIA's public datasheets / whitepapers unless a comment says otherwise. Tensor-core
rates are **dense** (NVIDIA's headline figures for Ampere and later are 2:4-sparse, twice these).
``0`` means "this GPU has no such unit" (e.g. no TF32 before Ampere, no BF16 tensor cores on
Volta/Turing).

Fields: FLOP rates in FLOP/s, bandwidths in bytes/s, memory in bytes (the datasheet's "GB" read as
GiB, :func:`datasheet_memory_bytes`; CUDA reports a few hundred MiB less).

* ``fp32_flops`` / ``fp64_flops``: non-tensor (SIMT/FMA) peaks at boost clock.
* ``fp16_flops``: non-tensor FP16 rate (2x FP32 on P100, 1x on Kepler/Maxwell where FP16 is
  only a storage format, 2x on Volta and later).
* ``tf32_tensor_flops``, ``fp16_tensor_flops``, ``bf16_tensor_flops``: dense tensor-core peaks with
  FP32 accumulation (what PyTorch uses).
* ``fp8_tensor_flops``: the dense FP8 tensor-core peak with FP32 accumulation (what
  ``torch._scaled_mm`` runs on), 0 for GPUs without FP8 tensor cores (before Ada and Hopper):
  :data:`FP8_TENSOR_TFLOPS`.
* ``host_link_bandwidth_pinned``: the PCIe link's theoretical rate per direction x
  :data:`PINNED_SHARE` (the share page-locked copies reach); ``host_link_bandwidth_pageable``:
  pageable copies go through a staging buffer and are host-memcpy bound — measured values for the
  six GPUs of the database (median of the GPEmu artifact's input copies), an estimate for the
  others (:func:`pageable_copy_rate`).
* ``nvlink_bandwidth``: the datasheet's total NVLink bandwidth per GPU (both directions, all
  links), 0 without NVLink; the "bus bandwidth" a ring all-reduce can approach is about half.
  ``nvlink_bridge``: that NVLink is a bridge joining two cards (PCIe cards: Quadro RTX 6000,
  H100 PCIe), not a switch or mesh joining every GPU of a node (SXM boards).
* ``generation``: architecture (``kepler`` ... ``blackwell``); :data:`DONORS` says whose calibrated
  curves a generation without measurements uses.

The six GPUs of the profile database are the ``measured`` sheets, one K80 being one GK210 die
(half the board), as CUDA sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

__all__ = [
    "GpuSheet",
    "GpuFacts",
    "GPUS",
    "GENERATIONS",
    "DONORS",
    "DEFAULT_GENERATION",
    "DEFAULT_PCIE_GEN",
    "PINNED_SHARE",
    "MEASURED_GENERATION_GPU",
    "gpu_sheet",
    "find_gpu",
    "sheet_from_spec",
    "donor_chain",
    "generation_capability",
    "first_generation_with",
    "compute_capability",
    "pcie_link_rate",
    "pinned_copy_rate",
    "pageable_copy_rate",
    "datasheet_memory_bytes",
    "NVLINK_GENERATIONS",
    "NVLS_FROM_NVLINK",
    "nvlink_generation",
    "nvlink_per_direction",
    "TENSOR_CONV_SHARE",
    "tensor_conv_share",
    "FP8_TENSOR_TFLOPS",
    "FP8_FROM_CAPABILITY",
]

_GiB = 1 << 30
_GB = 10**9
_T = 1e12
# Page-locked host copies reach about this share of the PCIe link's rate.
PINNED_SHARE = 0.8
# Pageable copies are bound by the host's memcpy into the staging buffer, not the link: the median
# of the five measured Gen3 hosts (4.18-6.24 GB/s), and the measured Gen4 host (A100) for newer
# links — no newer host was measured, so this is an estimate.
_PAGEABLE_GEN3 = 4.54e9
_PAGEABLE_GEN4PLUS = 4.66e9
# A GPU whose PCIe generation is not known (every GPU of the table from Ampere on has Gen4 or newer).
DEFAULT_PCIE_GEN = 4

GENERATIONS = ("kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell")
# A GPU whose generation is not known is priced as an Ampere GPU: the only calibrated generation
# with tensor-core curves.
DEFAULT_GENERATION = "ampere"

# Whose calibrated curves a generation uses, nearest relative first; the first one that has a
# curve of the needed key on the needed path (tensor / SIMT / memory) wins. Measured generations
# use their own first. Lineage: Pascal GP100 extends Maxwell's SM, Volta's SM was redesigned and
# Turing's derives from it, Ampere follows Turing (GA100) and Ada is Ampere's SM (GA10x) with
# newer tensor cores; Hopper and Blackwell have no measured relative closer than Ampere. Ampere
# (the A100) is also the only generation with tensor-core measurements (TF32 convolutions), so
# every tensor-core path — fp16/bf16 anywhere, TF32 on Ada/Hopper/Blackwell — ends there.
DONORS: dict[str, tuple[str, ...]] = {
    "kepler": ("kepler", "maxwell", "pascal", "volta", "turing", "ampere"),
    "maxwell": ("maxwell", "pascal", "kepler", "volta", "turing", "ampere"),
    "pascal": ("pascal", "volta", "maxwell", "turing", "kepler", "ampere"),
    "volta": ("volta", "turing", "pascal", "ampere", "maxwell", "kepler"),
    "turing": ("turing", "volta", "ampere", "pascal", "maxwell", "kepler"),
    "ampere": ("ampere", "turing", "volta", "pascal", "maxwell", "kepler"),
    "ada": ("ada", "ampere", "turing", "volta", "pascal", "maxwell", "kepler"),
    "hopper": ("hopper", "ampere", "turing", "volta", "pascal", "maxwell", "kepler"),
    "blackwell": ("blackwell", "ampere", "turing", "volta", "pascal", "maxwell", "kepler"),
}


# What cuDNN's convolutions deliver of a generation's tensor-core peak, relative to what the
# generation whose curves price them (DONORS: Ampere's, for every GPU without its own) delivers of
# its own, by convolution kind and pass (the curve key: forward kernels and the backward's data and
# weight gradients are different cuDNN kernels). Hopper's peak (3.2x the A100's TF32 and FP16)
# needs its warpgroup MMA instructions (wgmma, fed by TMA); kernels built on Ampere's mma.sync reach
# a much smaller share of it (Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU
# Architecture", arXiv:2402.13499), and cuDNN 9 runs most 3x3 and strided convolutions so. Measured,
# not taken from the datasheet: the H100 op sweep in benchmarks/data/h100-2026-11-26.json (`gpemu
# profile --ops`, CUDA events, TF32 and FP16), the larger half of each kind's and pass's kernels
# (n = 8 each), geometric mean of measured rate over the rate Ampere's curves give at the H100's
# datasheet peak (`python benchmarks/hopper_share.py`). The training steps that
# benchmarks/vs_real_gpu.py compares with are not in that sweep. 1x1 convolutions are plain GEMMs
# and their forwards run faster than Ampere's curve says; GEMMs themselves are priced by the
# published tensor-core plateau (published.TENSOR_PLATEAU), which the same sweep confirms over both
# passes (1.01), so they take no share.
TENSOR_CONV_SHARE: dict[str, dict[str, float]] = {
    "hopper": {
        "conv1x1.fwd": 1.29,
        "conv1x1.bwd": 0.99,
        "conv_spatial.fwd": 0.65,
        "conv_spatial.bwd": 0.59,
        "conv_strided.fwd": 0.49,
        "conv_strided.bwd": 0.39,
        "conv_grouped.fwd": 0.71,
        "conv_grouped.bwd": 0.79,
    },
}


def tensor_conv_share(generation: str, key: str, curve_generation: str) -> float:
    """Factor on a GPU's tensor-core peak for a convolution priced by the curve ``key``
    (``conv1x1.fwd``, ``conv_spatial.bwd``, ...; a bare kind is its forward) with a curve
    calibrated on ``curve_generation`` (:data:`TENSOR_CONV_SHARE`; 1 for the GPU's own
    generation's curves or its own calibration, whose generation is not a generation name)."""
    if curve_generation == generation or curve_generation not in GENERATIONS:
        return 1.0
    kind, _, phase = key.partition(".")
    return TENSOR_CONV_SHARE.get(generation, {}).get(f"{kind}.{phase or 'fwd'}", 1.0)


def pcie_link_rate(gen: int) -> float:
    """A PCIe x16 link's rate per direction, bytes/s: Gen3 15.75 GB/s, doubling each generation."""
    return 15.75e9 * 2.0 ** (gen - 3)


def pinned_copy_rate(pcie_gen: int) -> float:
    """Host->GPU copies from page-locked memory over a PCIe x16 link of this generation, bytes/s."""
    return pcie_link_rate(pcie_gen) * PINNED_SHARE


def pageable_copy_rate(pcie_gen: int) -> float:
    """Host->GPU copies from pageable memory on a host with this PCIe generation, bytes/s (host
    memcpy bound: measured on Gen3 and Gen4 hosts, the Gen4 figure taken for newer ones)."""
    return _PAGEABLE_GEN3 if pcie_gen <= 3 else _PAGEABLE_GEN4PLUS


# NVLink generation of each architecture with NVLink (NVIDIA NVLink pages and architecture
# whitepapers): Volta NVLink 2, Ampere 3, Hopper 4, Blackwell 5. The per-GPU bandwidth is each
# sheet's ``nvlink_bandwidth``.
NVLINK_GENERATIONS: dict[str, int] = {"pascal": 1, "volta": 2, "ampere": 3, "hopper": 4, "blackwell": 5}
# NVLink SHARP (NVLS: the NVSwitch reduces and multicasts) exists from the third-generation
# NVSwitch, which joins NVLink 4 GPUs (Hopper whitepaper, "NVLink Switch System").
NVLS_FROM_NVLINK = 4


def nvlink_generation(sheet: GpuSheet) -> int:
    """The NVLink generation of a GPU (0: it has no NVLink)."""
    if not sheet.nvlink_bandwidth:
        return 0
    return NVLINK_GENERATIONS.get(sheet.generation, 0)


def nvlink_per_direction(sheet: GpuSheet) -> float:
    """A GPU's NVLink bandwidth per direction, bytes/s: half the datasheet's both-ways total."""
    return sheet.nvlink_bandwidth / 2


def datasheet_memory_bytes(gb: float) -> int:
    """A datasheet's memory size in "GB", as bytes: read as GiB, as for every GPU of the table."""
    return int(round(gb * _GiB))


@dataclass(frozen=True)
class GpuSheet:
    """Datasheet facts of one GPU (see the module docstring for units and conventions)."""

    name: str  # as torch.cuda.get_device_name() reports it
    aliases: tuple[str, ...]
    generation: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    memory_bandwidth: float
    fp32_flops: float
    fp64_flops: float
    fp16_flops: float
    tf32_tensor_flops: float
    fp16_tensor_flops: float
    bf16_tensor_flops: float
    pcie_gen: int
    host_link_bandwidth_pinned: float
    host_link_bandwidth_pageable: float
    nvlink_bandwidth: float = 0.0
    measured: bool = False  # in the shipped profile database
    nvlink_bridge: bool = False  # NVLink joins pairs of cards only
    source: str = field(default="", compare=False)
    fp8_tensor_flops: float = 0.0  # (filled from FP8_TENSOR_TFLOPS below the table)

    @property
    def short_name(self) -> str:
        return self.aliases[0] if self.aliases else self.name


class GpuFacts(Protocol):
    """A GPU the table may not have, as the profile database describes it (``gpemu.db.GpuSpec``):
    its name and aliases and the figures every GPU has. The optional figures (``generation``,
    ``compute_capability``, ``fp64_flops``, ``fp16_nontensor_flops``, the tensor-core peaks,
    ``pcie_gen``, ``nvlink_bandwidth``) are read where present; None or absent means not known."""

    @property
    def name(self) -> str: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def memory_bandwidth(self) -> float: ...
    @property
    def fp32_flops(self) -> float: ...
    @property
    def fp16_flops(self) -> float: ...  # the tensor-core rate where the GPU has one
    @property
    def host_link_bandwidth_pinned(self) -> float: ...
    @property
    def host_link_bandwidth_pageable(self) -> float: ...
    @property
    def sm_count(self) -> int: ...


def _sheet(
    name: str,
    aliases: tuple[str, ...],
    gen: str,
    cc: tuple[int, int],
    sms: int,
    mem_gb: float,
    bw_gbs: float,
    fp32: float,
    fp64: float,
    fp16: float,
    tf32_tc: float,
    fp16_tc: float,
    bf16_tc: float,
    pcie: int,
    nvlink_gbs: float = 0.0,
    pageable: float | None = None,
    measured: bool = False,
    source: str = "",
    bridge: bool = False,
) -> GpuSheet:
    return GpuSheet(
        name=name,
        aliases=aliases,
        generation=gen,
        compute_capability=cc,
        sm_count=sms,
        memory_bytes=datasheet_memory_bytes(mem_gb),
        memory_bandwidth=bw_gbs * _GB,
        fp32_flops=fp32 * _T,
        fp64_flops=fp64 * _T,
        fp16_flops=fp16 * _T,
        tf32_tensor_flops=tf32_tc * _T,
        fp16_tensor_flops=fp16_tc * _T,
        bf16_tensor_flops=bf16_tc * _T,
        pcie_gen=pcie,
        host_link_bandwidth_pinned=pinned_copy_rate(pcie),
        host_link_bandwidth_pageable=pageable if pageable is not None else pageable_copy_rate(pcie),
        nvlink_bandwidth=nvlink_gbs * _GB,
        measured=measured,
        source=source,
        nvlink_bridge=bridge,
    )


GPUS: tuple[GpuSheet, ...] = (
    # ---------------------------------------------------------------- measured (profile database)
    # Kepler K80 board: 8.73 TF FP32 boost, 2.91 TF FP64, 480 GB/s, 24 GB, 2 x GK210 with 13 SMX each;
    # one CUDA device = one die = half of each. No fast FP16, no tensor cores. (Tesla K80 datasheet)
    _sheet(
        "Tesla K80",
        ("K80", "Tesla_K80"),
        "kepler",
        (3, 7),
        13,
        12,
        240,
        8.73 / 2,
        2.91 / 2,
        8.73 / 2,
        0,
        0,
        0,
        3,
        pageable=5.56e9,
        measured=True,
        source="Tesla K80 datasheet (board / 2)",
    ),
    # Maxwell M40 24GB: 7 TF FP32 (FP64 1/32), 288 GB/s, 24 SMs. (Tesla M40 24GB datasheet)
    _sheet(
        "Tesla M40",
        ("M40", "Tesla_M40"),
        "maxwell",
        (5, 2),
        24,
        24,
        288,
        7.0,
        7.0 / 32,
        7.0,
        0,
        0,
        0,
        3,
        pageable=6.24e9,
        measured=True,
        source="Tesla M40 24GB datasheet",
    ),
    # Pascal P100 PCIe 16GB: 9.3 TF FP32, 4.7 FP64, 18.7 FP16 (2x, no tensor cores), 732 GB/s, 56 SMs.
    _sheet(
        "Tesla P100-PCIE-16GB",
        ("P100", "P100-PCIE-16GB", "Tesla_P100-PCIE-16GB"),
        "pascal",
        (6, 0),
        56,
        16,
        732,
        9.3,
        4.7,
        18.7,
        0,
        0,
        0,
        3,
        pageable=4.54e9,
        measured=True,
        source="Tesla P100 datasheet (PCIe)",
    ),
    # Volta V100 PCIe 32GB: 14 TF FP32, 7 FP64, 112 FP16 tensor (no BF16/TF32), 900 GB/s, 80 SMs.
    # (PCIe card: no NVLink.) (Tesla V100 datasheet)
    _sheet(
        "Tesla V100-PCIE-32GB",
        ("V100", "V100-32GB", "V100-PCIE-32GB", "Tesla_V100-PCIE-32GB"),
        "volta",
        (7, 0),
        80,
        32,
        900,
        14.0,
        7.0,
        28.0,
        0,
        112,
        0,
        3,
        pageable=4.24e9,
        measured=True,
        source="Tesla V100 datasheet (PCIe)",
    ),
    # Turing Quadro RTX 6000: 16.3 TF FP32, 0.51 FP64 (1/32), 130.5 FP16 tensor (full-rate FP32
    # accumulate on Quadro; no BF16/TF32), 672 GB/s, 72 SMs, NVLink bridge 100 GB/s. (Quadro RTX 6000 datasheet)
    _sheet(
        "Quadro RTX 6000",
        ("RTX6000", "Quadro_RTX_6000"),
        "turing",
        (7, 5),
        72,
        24,
        672,
        16.3,
        16.3 / 32,
        32.6,
        0,
        130.5,
        0,
        3,
        nvlink_gbs=100,
        pageable=4.18e9,
        measured=True,
        source="Quadro RTX 6000 datasheet",
        bridge=True,
    ),
    # Ampere A100 SXM4 40GB: 19.5 TF FP32, 9.7 FP64, 156 TF32 / 312 FP16 / 312 BF16 tensor (dense),
    # 1,555 GB/s, 108 SMs, NVLink 600 GB/s, PCIe Gen4. (NVIDIA A100 Tensor Core GPU datasheet)
    _sheet(
        "NVIDIA A100-SXM4-40GB",
        ("A100", "A100-40GB", "A100-SXM4-40GB", "NVIDIA_A100-SXM4-40GB"),
        "ampere",
        (8, 0),
        108,
        40,
        1555,
        19.5,
        9.7,
        78.0,
        156,
        312,
        312,
        4,
        nvlink_gbs=600,
        pageable=4.66e9,
        measured=True,
        source="NVIDIA A100 datasheet (SXM4 40GB)",
    ),
    # ---------------------------------------------------------------- datasheet only
    # A100 SXM4 80GB: compute as the 40GB; HBM2e 2,039 GB/s. (NVIDIA A100 datasheet)
    _sheet(
        "NVIDIA A100-SXM4-80GB",
        ("A100-80GB", "A100-SXM4-80GB", "A100-SXM-80GB"),
        "ampere",
        (8, 0),
        108,
        80,
        2039,
        19.5,
        9.7,
        78.0,
        156,
        312,
        312,
        4,
        nvlink_gbs=600,
        source="NVIDIA A100 datasheet (SXM4 80GB)",
    ),
    # Ampere A10G (AWS G5; NVIDIA publishes no datasheet): GA102 with 80 SMs at 1.71 GHz: FP32
    # 35 TF; tensor FP16/BF16 70 TF and TF32 35 TF dense as AWS/Baseten's comparison reports
    # (half the A10's per-SM tensor rate); 24 GB GDDR6, 600 GB/s, PCIe Gen4. Uncertain figures.
    _sheet(
        "NVIDIA A10G",
        ("A10G",),
        "ampere",
        (8, 6),
        80,
        24,
        600,
        35.0,
        35.0 / 32,
        35.0,
        35,
        70,
        70,
        4,
        source="AWS EC2 G5 docs / Baseten A10 vs A10G (no NVIDIA datasheet; uncertain)",
    ),
    # Ada L40S: 91.6 TF FP32, 183 TF32 / 362 FP16 / 362 BF16 tensor (dense; 366/733 sparse),
    # 48 GB GDDR6, 864 GB/s, 142 SMs, PCIe Gen4, no NVLink. (NVIDIA L40S datasheet)
    _sheet(
        "NVIDIA L40S",
        ("L40S",),
        "ada",
        (8, 9),
        142,
        48,
        864,
        91.6,
        91.6 / 64,
        91.6,
        183,
        362,
        362,
        4,
        source="NVIDIA L40S datasheet",
    ),
    # Ada L4: 30.3 TF FP32, 60 TF32 / 121 FP16 / 121 BF16 tensor (dense), 24 GB GDDR6, 300 GB/s,
    # 58 SMs, PCIe Gen4 x16. (NVIDIA L4 datasheet)
    _sheet(
        "NVIDIA L4",
        ("L4",),
        "ada",
        (8, 9),
        58,
        24,
        300,
        30.3,
        30.3 / 64,
        30.3,
        60,
        121,
        121,
        4,
        source="NVIDIA L4 datasheet",
    ),
    # Ada GeForce RTX 4090: 82.6 TF FP32, tensor with FP32 accumulate 165.2 FP16/BF16, 82.6 TF32
    # (dense; GeForce runs FP32-accumulate at half the FP16-accumulate rate), 24 GB GDDR6X,
    # 1,008 GB/s, 128 SMs, PCIe Gen4. (NVIDIA Ada Lovelace architecture whitepaper, appendix)
    _sheet(
        "NVIDIA GeForce RTX 4090",
        ("RTX4090", "RTX-4090", "4090"),
        "ada",
        (8, 9),
        128,
        24,
        1008,
        82.6,
        82.6 / 64,
        82.6,
        82.6,
        165.2,
        165.2,
        4,
        source="NVIDIA Ada Lovelace whitepaper (RTX 4090)",
    ),
    # Turing T4: 8.1 TF FP32, 65 TF FP16 tensor (mixed precision), no BF16/TF32, 16 GB GDDR6,
    # 320 GB/s, 40 SMs, PCIe Gen3. (NVIDIA T4 datasheet)
    _sheet(
        "Tesla T4",
        ("T4", "Tesla_T4"),
        "turing",
        (7, 5),
        40,
        16,
        320,
        8.1,
        8.1 / 32,
        16.2,
        0,
        65,
        0,
        3,
        source="NVIDIA T4 datasheet",
    ),
    # Hopper H100 SXM5 80GB: 67 TF FP32, 34 FP64, 494.7 TF32 / 989.4 FP16 / 989.4 BF16 tensor (dense;
    # 989/1979 sparse), HBM3 3.35 TB/s, 132 SMs, NVLink 900 GB/s, PCIe Gen5. (NVIDIA H100 datasheet)
    _sheet(
        "NVIDIA H100 80GB HBM3",
        ("H100", "H100-SXM", "H100-SXM5", "H100-SXM5-80GB"),
        "hopper",
        (9, 0),
        132,
        80,
        3350,
        67.0,
        34.0,
        133.8,
        494.7,
        989.4,
        989.4,
        5,
        nvlink_gbs=900,
        source="NVIDIA H100 datasheet (SXM)",
    ),
    # Hopper H100 PCIe 80GB: 51 TF FP32, 26 FP64, 378 TF32 / 756 FP16 / 756 BF16 tensor (dense),
    # HBM2e 2.0 TB/s, 114 SMs, NVLink bridge 600 GB/s, PCIe Gen5. (NVIDIA H100 datasheet (PCIe) /
    # H100 PCIe product brief PB-11133-001)
    _sheet(
        "NVIDIA H100 PCIe",
        ("H100-PCIe", "H100-PCIE-80GB"),
        "hopper",
        (9, 0),
        114,
        80,
        2000,
        51.0,
        26.0,
        102.0,
        378,
        756,
        756,
        5,
        nvlink_gbs=600,
        source="NVIDIA H100 datasheet (PCIe), product brief PB-11133-001",
        bridge=True,
    ),
    # Hopper H200 SXM 141GB: compute as H100 SXM; HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s, PCIe
    # Gen5. (NVIDIA H200 datasheet)
    _sheet(
        "NVIDIA H200",
        ("H200", "H200-SXM", "H200-SXM-141GB"),
        "hopper",
        (9, 0),
        132,
        141,
        4800,
        67.0,
        34.0,
        133.8,
        494.7,
        989.4,
        989.4,
        5,
        nvlink_gbs=900,
        source="NVIDIA H200 datasheet (SXM)",
    ),
    # Blackwell B200 (HGX B200, per GPU): 75 TF FP32, 37 FP64, 1,125 TF32 / 2,250 FP16 / 2,250 BF16
    # tensor (dense; the datasheet's 8-GPU sparse figures / 8 / 2), 180 GB HBM3e at 8 TB/s, 148 SMs,
    # NVLink 5 1.8 TB/s, PCIe Gen5 host link. (NVIDIA HGX B200 / DGX B200 datasheets)
    _sheet(
        "NVIDIA B200",
        ("B200", "B200-SXM", "HGX-B200"),
        "blackwell",
        (10, 0),
        148,
        180,
        8000,
        75.0,
        37.0,
        150.0,
        1125,
        2250,
        2250,
        5,
        nvlink_gbs=1800,
        source="NVIDIA HGX B200 / DGX B200 datasheets (per GPU)",
    ),
)

# FP8 tensor-core peaks, TFLOP/s, dense with FP32 accumulation (cuBLASLt's FP8 GEMMs, which
# torch._scaled_mm calls, accumulate in FP32). Datasheets give them with 2:4 sparsity: halved here.
# GPUs not listed have no FP8 tensor cores (compute capability below FP8_FROM_CAPABILITY).
FP8_TENSOR_TFLOPS: dict[str, float] = {
    "NVIDIA L40S": 733.0,  # NVIDIA L40S datasheet: FP8 733 / 1,466 (sparse)
    "NVIDIA L4": 242.5,  # NVIDIA L4 datasheet: FP8 485 (sparse)
    "NVIDIA GeForce RTX 4090": 330.3,  # Ada whitepaper, appendix: FP8 with FP32 accumulate 330.3 / 660.6
    "NVIDIA H100 80GB HBM3": 1978.9,  # NVIDIA H100 datasheet (SXM): FP8 3,958 (sparse)
    "NVIDIA H100 PCIe": 1513.0,  # NVIDIA H100 datasheet (PCIe): FP8 3,026 (sparse)
    "NVIDIA H200": 1978.9,  # NVIDIA H200 datasheet (SXM): FP8 3,958 (sparse)
    "NVIDIA B200": 4500.0,  # HGX B200 datasheet: FP8 72 PFLOPS for 8 GPUs (sparse): / 8 / 2
}
# The first compute capability with FP8 tensor cores (Ada 8.9; Hopper 9.0 and later).
FP8_FROM_CAPABILITY = (8, 9)
GPUS = tuple(replace(g, fp8_tensor_flops=FP8_TENSOR_TFLOPS.get(g.name, 0.0) * _T) for g in GPUS)

# The measured GPU of each calibrated generation (its database name).
MEASURED_GENERATION_GPU: dict[str, str] = {g.generation: g.name for g in GPUS if g.measured}


def _norm(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


_INDEX: dict[str, GpuSheet] = {}
for _g in GPUS:
    for _n in (_g.name, *_g.aliases):
        _INDEX.setdefault(_norm(_n), _g)


def find_gpu(name: str) -> GpuSheet | None:
    """The sheet whose name or alias matches ``name`` (case, spaces, dashes ignored), or None."""
    return _INDEX.get(_norm(name))


def _table_sheet(gpu: GpuFacts) -> GpuSheet | None:
    """The sheet of the table that ``gpu``'s name or one of its aliases names, or None."""
    for name in (gpu.name, *gpu.aliases):
        hit = find_gpu(name)
        if hit is not None:
            return hit
    return None


def gpu_sheet(gpu: str | GpuSheet | GpuFacts) -> GpuSheet:
    """A :class:`GpuSheet` from a sheet, a name / alias, or a GPU the database describes
    (``gpemu.db.GpuSpec``, matched by name and aliases); a GPU the table does not have becomes a
    sheet of its own (see :func:`sheet_from_spec`). Raises ``KeyError`` for an unknown name."""
    if isinstance(gpu, GpuSheet):
        return gpu
    if isinstance(gpu, str):
        hit = find_gpu(gpu)
        if hit is None:
            raise KeyError(f"unknown GPU {gpu!r}; known: {', '.join(g.short_name for g in GPUS)}")
        return hit
    return _table_sheet(gpu) or sheet_from_spec(gpu)


def sheet_from_spec(spec: GpuFacts, generation: str | None = None) -> GpuSheet:
    """A sheet for a GPU the table does not know, from its database description. The spec's own
    figures are used where it has them (``gpemu gpus add`` records generation, compute capability,
    tensor-core peaks, PCIe generation, NVLink); what it leaves unknown (None) is inferred: FP16
    above 2.5x FP32 is taken as tensor-core FP16, the generation is :data:`DEFAULT_GENERATION`,
    the PCIe generation :data:`DEFAULT_PCIE_GEN`; an unknown compute capability stays (0, 0). A GPU
    with FP8 tensor cores (:data:`FP8_FROM_CAPABILITY` or later) whose FP8 peak is not known runs
    FP8 at twice its BF16 tensor rate, as every GPU of the table does."""

    def own(attr: str, default: float) -> float:
        v = getattr(spec, attr, None)
        return default if v is None else float(v)

    fp32, fp16 = float(spec.fp32_flops), float(spec.fp16_flops)
    guessed_tensor = fp16 if fp16 > 2.5 * fp32 else 0.0
    cc = getattr(spec, "compute_capability", None)
    bf16_tensor = own("bf16_tensor_flops", 0.0)
    has_fp8 = cc is not None and len(cc) == 2 and (int(cc[0]), int(cc[1])) >= FP8_FROM_CAPABILITY
    return GpuSheet(
        name=str(spec.name),
        aliases=tuple(spec.aliases),
        generation=generation or getattr(spec, "generation", None) or DEFAULT_GENERATION,
        compute_capability=(int(cc[0]), int(cc[1])) if cc else (0, 0),
        sm_count=int(spec.sm_count),
        memory_bytes=int(spec.memory_bytes),
        memory_bandwidth=float(spec.memory_bandwidth),
        fp32_flops=fp32,
        fp64_flops=own("fp64_flops", fp32 / 32),
        fp16_flops=own("fp16_nontensor_flops", 2 * fp32 if guessed_tensor else fp16),
        tf32_tensor_flops=own("tf32_tensor_flops", 0.0),
        fp16_tensor_flops=own("fp16_tensor_flops", guessed_tensor),
        bf16_tensor_flops=bf16_tensor,
        pcie_gen=int(getattr(spec, "pcie_gen", None) or DEFAULT_PCIE_GEN),
        host_link_bandwidth_pinned=float(spec.host_link_bandwidth_pinned),
        host_link_bandwidth_pageable=float(spec.host_link_bandwidth_pageable),
        nvlink_bandwidth=own("nvlink_bandwidth", 0.0),
        source=getattr(spec, "source", "") or "built from a GpuSpec (not in the datasheet table)",
        fp8_tensor_flops=own("fp8_tensor_flops", 2 * bf16_tensor if has_fp8 else 0.0),
    )


# ---------------------------------------------------------------------- generations
def donor_chain(generation: str | None) -> tuple[str, ...]:
    """Whose calibrated curves and measurements a GPU of ``generation`` takes, nearest first
    (:data:`DONORS`; an unknown generation takes :data:`DEFAULT_GENERATION`'s)."""
    return DONORS.get(generation or DEFAULT_GENERATION, DONORS[DEFAULT_GENERATION])


def generation_capability(generation: str) -> tuple[int, int] | None:
    """The compute capability most sheets of ``generation`` have (Ampere: 8.0, the A100's;
    Ada 8.9), or None for a generation the table does not have."""
    seen: dict[tuple[int, int], int] = {}
    for s in GPUS:
        if s.generation == generation:
            seen[s.compute_capability] = seen.get(s.compute_capability, 0) + 1
    return max(seen, key=lambda cc: (seen[cc], cc)) if seen else None


def first_generation_with(unit: str) -> str:
    """The oldest generation with a sheet that has ``unit`` (a rate field of :class:`GpuSheet`
    such as ``"tf32_tensor_flops"``): GPUs of older generations have none."""
    return min((s.generation for s in GPUS if getattr(s, unit) > 0), key=GENERATIONS.index)


def compute_capability(gpu: GpuFacts) -> tuple[int, int]:
    """(major, minor) of a GPU: its own (``gpemu.db.GpuSpec.compute_capability``), else that of
    the sheet its name or an alias names, else its generation's usual one, else
    :data:`DEFAULT_GENERATION`'s (the generation it is priced as)."""
    own = getattr(gpu, "compute_capability", None)
    if own:
        return int(own[0]), int(own[1])
    sheet = _table_sheet(gpu)
    if sheet is not None:
        return sheet.compute_capability
    for generation in (getattr(gpu, "generation", None), DEFAULT_GENERATION):
        usual = generation_capability(generation) if generation else None
        if usual is not None:
            return usual
    raise LookupError(f"the GPU table has no {DEFAULT_GENERATION} GPU to take the compute capability of")

"""Datasheet facts of the six GPUs the shipped measurements come from.

Sources (NVIDIA public datasheets / product briefs):
- A100: "NVIDIA A100 Tensor Core GPU" datasheet (SXM4 40GB: 19.5 TFLOPS FP32, 312 TFLOPS FP16
  tensor core dense, 1,555 GB/s HBM2, 108 SMs, PCIe Gen4 x16 host link).
- Quadro RTX 6000: "Quadro RTX 6000" datasheet (16.3 TFLOPS FP32, 130.5 TFLOPS FP16 tensor,
  24 GB GDDR6, 672 GB/s, 72 SMs, PCIe Gen3 x16).
- Tesla K80: "Tesla K80" datasheet (board: 8.73 TFLOPS FP32 boost, 24 GB, 480 GB/s, two GK210 dies
  with 13 SMX each). CUDA sees each die as its own device, so one emulated K80 is one die:
  half of the board's FLOPs, memory and bandwidth. Kepler has no fast FP16: fp16 = fp32 rate.
- Tesla M40: "Tesla M40 24GB" datasheet (7 TFLOPS FP32, 24 GB GDDR5, 288 GB/s, 24 SMs,
  PCIe Gen3 x16). Maxwell has no fast FP16: fp16 = fp32 rate.
- Tesla P100 PCIe 16GB: "Tesla P100" datasheet (9.3 TFLOPS FP32, 18.7 TFLOPS FP16, 732 GB/s,
  56 SMs, PCIe Gen3 x16).
- Tesla V100 PCIe 32GB: "Tesla V100" datasheet (14 TFLOPS FP32, 112 TFLOPS FP16 tensor,
  900 GB/s, 80 SMs, PCIe Gen3 x16).

Memory capacity is the datasheet size in GiB (NVIDIA's "GB" for these boards); CUDA reports a few
hundred MiB less on the real boards.

Host link, pinned: the PCIe link's theoretical rate (Gen3 x16 15.75 GB/s, Gen4 x16 31.5 GB/s)
times 0.8, the fraction page-locked copies typically reach. Host link, pageable: measured, the
median over the 36 models of the GPEmu artifact's host-to-GPU input copies at batch 256
(3x224x224 float32 per sample), which went through pageable memory.
"""

from __future__ import annotations

from .records import GpuSpec

__all__ = ["SHIPPED_GPUS", "ARTIFACT_FOLDER_NAMES"]

_GiB = 1 << 30
_GEN3 = 15.75e9 * 0.8
_GEN4 = 31.5e9 * 0.8

SHIPPED_GPUS: tuple[GpuSpec, ...] = (
    GpuSpec(
        name="NVIDIA A100-SXM4-40GB",
        aliases=("A100", "A100-40GB", "A100-SXM4-40GB", "NVIDIA_A100-SXM4-40GB"),
        memory_bytes=40 * _GiB, fp32_flops=19.5e12, fp16_flops=312e12, memory_bandwidth=1555e9,
        host_link_bandwidth_pinned=_GEN4, host_link_bandwidth_pageable=4.66e9, sm_count=108,
    ),
    GpuSpec(
        name="Quadro RTX 6000",
        aliases=("RTX6000", "Quadro_RTX_6000"),
        memory_bytes=24 * _GiB, fp32_flops=16.3e12, fp16_flops=130.5e12, memory_bandwidth=672e9,
        host_link_bandwidth_pinned=_GEN3, host_link_bandwidth_pageable=4.18e9, sm_count=72,
    ),
    GpuSpec(
        name="Tesla K80",
        aliases=("K80", "Tesla_K80"),
        memory_bytes=12 * _GiB, fp32_flops=8.73e12 / 2, fp16_flops=8.73e12 / 2, memory_bandwidth=240e9,
        host_link_bandwidth_pinned=_GEN3, host_link_bandwidth_pageable=5.56e9, sm_count=13,
    ),
    GpuSpec(
        name="Tesla M40",
        aliases=("M40", "Tesla_M40"),
        memory_bytes=24 * _GiB, fp32_flops=7.0e12, fp16_flops=7.0e12, memory_bandwidth=288e9,
        host_link_bandwidth_pinned=_GEN3, host_link_bandwidth_pageable=6.24e9, sm_count=24,
    ),
    GpuSpec(
        name="Tesla P100-PCIE-16GB",
        aliases=("P100", "P100-PCIE-16GB", "Tesla_P100-PCIE-16GB"),
        memory_bytes=16 * _GiB, fp32_flops=9.3e12, fp16_flops=18.7e12, memory_bandwidth=732e9,
        host_link_bandwidth_pinned=_GEN3, host_link_bandwidth_pageable=4.54e9, sm_count=56,
    ),
    GpuSpec(
        name="Tesla V100-PCIE-32GB",
        aliases=("V100", "V100-32GB", "V100-PCIE-32GB", "Tesla_V100-PCIE-32GB"),
        memory_bytes=32 * _GiB, fp32_flops=14e12, fp16_flops=112e12, memory_bandwidth=900e9,
        host_link_bandwidth_pinned=_GEN3, host_link_bandwidth_pageable=4.24e9, sm_count=80,
    ),
)

# Folder names in the GPEmu artifact -> our canonical names (used by the converter).
ARTIFACT_FOLDER_NAMES: dict[str, str] = {
    "NVIDIA_A100-SXM4-40GB": "NVIDIA A100-SXM4-40GB",
    "Quadro_RTX_6000": "Quadro RTX 6000",
    "Tesla_K80": "Tesla K80",
    "Tesla_M40": "Tesla M40",
    "Tesla_P100-PCIE-16GB": "Tesla P100-PCIE-16GB",
    "Tesla_V100-PCIE-32GB": "Tesla V100-PCIE-32GB",
}

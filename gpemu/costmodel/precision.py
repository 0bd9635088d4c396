"""Numeric precision: which peak an op runs against, and how many bytes it moves.

:class:`Precision` is what the emulator passes: the dtype GEMMs/convolutions compute in (float32,
or float16/bfloat16 under autocast or for a ``.half()`` model) and PyTorch's two TF32 switches.
Its defaults are PyTorch's own (since 1.12): TF32 off for matmul, on for cuDNN convolutions —
which is also how the database's "fp32" measurements ran on the A100.

Rules (``compute_peak``):

* fp16 / bf16 GEMM, convolution, attention: the GPU's tensor-core peak for that dtype; without
  such tensor cores the non-tensor rate (P100: 2x FP32 for fp16; bf16 on Volta/Turing and fp16
  on Kepler/Maxwell: the FP32 rate).
* float8 (``torch._scaled_mm``'s operands): the GPU's FP8 tensor-core peak (Ada, Hopper,
  Blackwell); a GPU without one (torch refuses the op there) is priced as if the operands were
  fp16, on its fp16 path.
* fp32: TF32 tensor cores when the switch for that op family allows it and the GPU has them
  (Ampere and later), else the FP32 (SIMT) peak.
* float64: the FP64 peak.
* Memory-bound classes run against memory bandwidth in every precision; what changes is their
  bytes (``byte_scale``: an op recorded in fp32 moves half the bytes in fp16/bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .classify import COMPUTE_CLASSES, OpClass
from .gpus import GpuSheet

__all__ = [
    "Precision",
    "FP32",
    "compute_peak",
    "simt_peak",
    "effective_dtype",
    "byte_scale",
    "HALF",
    "FLOAT8",
    "tf32_matmul",
    "tf32_cudnn",
]

HALF = ("float16", "bfloat16")
FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_CONV = (OpClass.CONV, OpClass.CONV_GROUPED, OpClass.CONV_DEPTHWISE)


@dataclass(frozen=True)
class Precision:
    """How the emulated program computes.

    ``dtype``: the dtype float32 ops are priced in — ``"float32"`` (default), or ``"float16"`` /
    ``"bfloat16"`` for a program under ``torch.autocast`` or with a half-precision model whose ops
    were recorded in fp32. Ops recorded in a half dtype keep it whatever this says.
    ``allow_tf32_matmul`` = ``torch.backends.cuda.matmul.allow_tf32`` (GEMM, attention);
    ``allow_tf32_cudnn`` = ``torch.backends.cudnn.allow_tf32`` (convolutions).
    """

    dtype: str = "float32"
    allow_tf32_matmul: bool = False
    allow_tf32_cudnn: bool = True

    def __post_init__(self) -> None:
        name = str(self.dtype).replace("torch.", "")
        if name not in _ITEMSIZE:
            raise ValueError(f"Precision.dtype must be one of {', '.join(_ITEMSIZE)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", name)

    @classmethod
    def from_torch(cls, dtype: Any = None) -> Precision:
        """The current process's TF32 switches (``torch.backends``), with ``dtype`` (default fp32)."""
        return cls(dtype=str(dtype or torch.float32), allow_tf32_matmul=tf32_matmul(), allow_tf32_cudnn=tf32_cudnn())


# What torch.backends.cuda.matmul.allow_tf32 (also set by set_float32_matmul_precision) and
# torch.backends.cudnn.allow_tf32 read, without their Python property layers: the emulator keys
# every cached price on them (~60 ns a call), since they put fp32 GEMMs and convolutions on
# tensor cores or FMA units.
tf32_matmul = torch._C._get_cublas_allow_tf32
tf32_cudnn = torch._C._get_cudnn_allow_tf32


FP32 = Precision()


def effective_dtype(op_dtype: str, precision: Precision) -> str:
    """The dtype an op runs in: a float32 op takes the precision's dtype (autocast / .half())."""
    return precision.dtype if op_dtype == "float32" else op_dtype


def byte_scale(op_dtype: str, precision: Precision) -> float:
    """Factor on an op's recorded bytes when it runs in the precision's dtype instead."""
    if op_dtype != "float32" or precision.dtype == "float32":
        return 1.0
    return _ITEMSIZE[precision.dtype] / 4.0


def compute_peak(gpu: GpuSheet, op_class: OpClass, dtype: str, precision: Precision) -> tuple[str, float]:
    """(path, FLOP/s) a compute-class op of ``dtype`` runs at: path ``"tensor"`` or ``"simt"``."""
    if op_class not in COMPUTE_CLASSES:
        raise ValueError(f"{op_class} is priced by memory bandwidth, not a compute peak")
    if dtype in FLOAT8:
        if gpu.fp8_tensor_flops > 0:
            return "tensor", gpu.fp8_tensor_flops
        dtype = "float16"
    if dtype in HALF:
        tensor = gpu.fp16_tensor_flops if dtype == "float16" else gpu.bf16_tensor_flops
        if tensor > 0:
            return "tensor", tensor
        if dtype == "float16" and gpu.fp16_flops > gpu.fp32_flops:
            return "simt", gpu.fp16_flops
        return "simt", gpu.fp32_flops
    if dtype == "float64":
        return "simt", gpu.fp64_flops
    allow = precision.allow_tf32_cudnn if op_class in _CONV else precision.allow_tf32_matmul
    if allow and gpu.tf32_tensor_flops > 0:
        return "tensor", gpu.tf32_tensor_flops
    return "simt", gpu.fp32_flops


def simt_peak(gpu: GpuSheet, dtype: str) -> float:
    """The non-tensor-core FLOP rate for ``dtype`` (fp16: the GPU's FP16 rate; bf16: the FP32 rate)."""
    if dtype == "float16":
        return max(gpu.fp16_flops, gpu.fp32_flops)
    if dtype == "float64":
        return gpu.fp64_flops
    return gpu.fp32_flops

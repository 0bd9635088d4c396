"""gpemu.costmodel: what GPU work costs when no measurement says — ops + GPU + precision in, seconds out.

A pure library (no emulator runtime): classify aten ops (:mod:`.classify`), price them with
efficiency curves calibrated on the profile database per GPU generation (:mod:`.model`,
``data/params.json``), for measured GPUs and datasheet-only ones (:mod:`.gpus`), in fp32, TF32,
fp16 or bf16 (:mod:`.precision`).

    from gpemu.costmodel import default_model, classify, Precision
    m = default_model()
    feat = classify(torch.ops.aten.mm.default, (a, b), {}, out)       # inside a TorchDispatchMode
    m.op_seconds(feat, "H100", Precision("bfloat16"))                  # one kernel's GPU seconds
    m.module_seconds(model, (x,), "L4")                                 # StepSeconds(forward, backward, ±)

Modules: ``flops`` (FLOP formulas, grouped-conv backward corrected), ``classify`` (op class +
features), ``record`` (a dispatch mode recording a module's ops on meta), ``table`` (many ops as
arrays), ``curve`` (the time form), ``precision``, ``gpus`` (datasheets), ``model`` (the
calibrated model).

It imports nothing else of gpemu (the bottom layer of ``.importlinter``'s core layers). Calibration
is a tool's job: ``python -m gpemu.profiler.costfit`` (:mod:`gpemu.profiler.costfit`,
:mod:`gpemu.profiler.costdata`) reads the profile database and the repository's example models
and writes ``data/params.json``.
"""

from __future__ import annotations

from .classify import COMPUTE_CLASSES, MEMORY_CLASSES, OpClass, OpFeatures, classify
from .comm import Collective, Link, collective_seconds, gpu_link
from .gpus import DONORS, GPUS, GpuSheet, find_gpu, gpu_sheet
from .model import CostModel, StepSeconds, Uncertainty, curve_key, default_model, op_seconds
from .precision import FP32, Precision, compute_peak
from .record import OpRecorder, StepOps, record_step

__all__ = [
    "OpClass",
    "OpFeatures",
    "classify",
    "COMPUTE_CLASSES",
    "MEMORY_CLASSES",
    "GpuSheet",
    "GPUS",
    "DONORS",
    "gpu_sheet",
    "find_gpu",
    "CostModel",
    "StepSeconds",
    "Uncertainty",
    "curve_key",
    "default_model",
    "op_seconds",
    "Precision",
    "FP32",
    "compute_peak",
    "OpRecorder",
    "StepOps",
    "record_step",
    "Collective",
    "Link",
    "collective_seconds",
    "gpu_link",
]

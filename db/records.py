"""The plain values the profile database hands out and takes in.

These dataclasses are the contract of docs/architecture.md: other modules (costs, memory,
cuda_api, the profiler) see only these, never SQLAlchemy rows.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GpuSpec",
    "SPEC_PROVENANCES",
    "OPTIONAL_GPU_FIELDS",
    "parse_compute_capability",
    "ModelInfo",
    "Lookup",
    "Measurement",
    "UnknownNameError",
    "MissingMeasurementError",
    "KINDS",
    "KIND_UNITS",
    "TIME_KINDS",
    "MEMORY_KINDS",
    "BATCH_INDEPENDENT",
    "PROVENANCES",
    "check_batch_size",
    "check_kind",
    "normalize_name",
]

# Every kind of measurement and the one unit its value is stored in (time in seconds,
# memory in bytes), so no caller ever guesses a unit.
KIND_UNITS: dict[str, str] = {
    "forward": "seconds",
    "backward": "seconds",
    "h2d_transfer": "seconds",  # host-to-GPU copy of one input batch
    "d2h_transfer": "seconds",
    "model_transfer": "seconds",  # moving the model's parameters to the GPU (batch independent)
    "optimizer_step": "seconds",
    "ddp_iteration": "seconds",  # one DDP training iteration; world_size says how many ranks
    "peak_memory": "bytes",
    "persistent_memory": "bytes",
    "h2d_transfer_pinned": "seconds",  # the same input-batch copy from page-locked memory
    "max_batch_size": "samples",  # largest batch size that fit in GPU memory (batch independent)
}
KINDS: tuple[str, ...] = tuple(KIND_UNITS)
TIME_KINDS = tuple(k for k, u in KIND_UNITS.items() if u == "seconds")
MEMORY_KINDS = tuple(k for k, u in KIND_UNITS.items() if u == "bytes")
# Kinds measured once per (GPU, model), stored with batch_size 0 and valid at any batch size.
BATCH_INDEPENDENT = ("model_transfer", "max_batch_size")
PROVENANCES = ("measured", "interpolated", "extrapolated")
# The source tag of the shipped measurements (the GPEmu artifact). Their "backward" is everything
# the authors' profiler timed after the forward: the loss, zero_grad, backward and an SGD step
# (gpemu.costmodel.measured_loop); a "backward" measured by `gpemu profile` is the backward pass.
ARTIFACT_SOURCE = "gpemu-artifact"


class UnknownNameError(ValueError):
    """A GPU or model name the database does not know; the message lists close matches."""

    def __init__(
        self, what: str, name: Any, valid: Iterable[str], extra_keys: Iterable[str] = (), hint: str = ""
    ) -> None:
        valid = list(valid)
        keys = {v.lower(): v for v in list(valid) + list(extra_keys)}
        close = difflib.get_close_matches(str(name).lower(), list(keys), n=3, cutoff=0.5)
        # Show the canonical spelling of each suggestion once.
        seen: list[str] = []
        for c in close:
            if keys[c] not in seen:
                seen.append(keys[c])
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:60] + "..."
        listing = f"{what}s: {', '.join(valid) or '(none)'}"
        if seen:
            text = f"unknown {what} {shown}; did you mean {' or '.join(repr(s) for s in seen)}? Valid {listing}"
        else:
            text = f"unknown {what} {shown}; valid {listing}"
        if hint:  # how to get a name that is not there (e.g. adding a GPU from its datasheet)
            text += f"; {hint}"
        super().__init__(text)
        self.name = name
        self.suggestions = seen
        self.valid = valid


class MissingMeasurementError(LookupError, ValueError):
    """The database has no measurement of this kind for this GPU and model."""


# Where a GPU's facts came from: the datasheet table gpemu ships (gpemu.costmodel.gpus.GPUS),
# numbers a user entered (`gpemu gpus add`, an imported file), or rates `gpemu profile` measured.
SPEC_PROVENANCES = ("datasheet", "user", "profiled")
# Facts a GPU may leave unknown (None): the cost model then infers them from the required ones.
OPTIONAL_GPU_FIELDS = (
    "generation",
    "compute_capability",
    "fp64_flops",
    "fp16_nontensor_flops",
    "tf32_tensor_flops",
    "fp16_tensor_flops",
    "bf16_tensor_flops",
    "pcie_gen",
    "nvlink_bandwidth",
)
_POSITIVE_GPU_FIELDS = (
    "memory_bytes",
    "fp32_flops",
    "fp16_flops",
    "memory_bandwidth",
    "host_link_bandwidth_pinned",
    "host_link_bandwidth_pageable",
    "sm_count",
)
# 0 means "this GPU has no such unit" (no TF32 before Ampere, no NVLink on a PCIe card).
_NON_NEGATIVE_GPU_FIELDS = (
    "fp64_flops",
    "fp16_nontensor_flops",
    "tf32_tensor_flops",
    "fp16_tensor_flops",
    "bf16_tensor_flops",
    "nvlink_bandwidth",
)


def parse_compute_capability(value: Any) -> tuple[int, int] | None:
    """``(9, 0)``, ``[9, 0]``, ``"9.0"`` or ``9.0`` -> ``(9, 0)``; None and ``""`` -> None.
    ValueError for anything else."""
    if value is None or value == "":
        return None
    major = minor = None
    if isinstance(value, str):
        text = value.strip().strip("()[]")
        parts = [p.strip() for p in text.replace(",", ".").split(".") if p.strip()]
        if len(parts) in (1, 2) and all(p.isdigit() for p in parts):
            major, minor = int(parts[0]), int(parts[1]) if len(parts) == 2 else 0
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_whole(v) for v in value):
        major, minor = int(value[0]), int(value[1])
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        number = float(value)
        major, minor = int(number), int(round((number - int(number)) * 10))
    if major is None or minor is None or not (1 <= major <= 99 and 0 <= minor <= 9):
        raise ValueError(f"compute capability must be MAJOR.MINOR such as 8.0 or 9.0, got {value!r}")
    return major, minor


def _is_whole(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet facts of one GPU model. Bandwidths in bytes/s, FLOP rates in FLOP/s.

    The first nine fields are required. ``fp16_flops`` is the GPU's FP16 peak as one number: the
    tensor-core rate (FP32 accumulation, dense) where the GPU has tensor cores, else the non-tensor
    FP16 rate. The optional fields below it are what the cost model prices ops with
    (``gpemu.costmodel.GpuSheet`` has the same names, its ``fp16_flops`` being
    ``fp16_nontensor_flops`` here); None means not known, 0 means the GPU has no such unit.
    """

    name: str  # as torch.cuda.get_device_name() reports it on the real GPU
    aliases: tuple[str, ...]
    memory_bytes: int
    fp32_flops: float
    fp16_flops: float
    memory_bandwidth: float
    host_link_bandwidth_pinned: float
    host_link_bandwidth_pageable: float
    sm_count: int
    generation: str | None = None  # kepler ... blackwell (gpemu.costmodel.gpus.GENERATIONS)
    compute_capability: tuple[int, int] | None = None
    fp64_flops: float | None = None
    fp16_nontensor_flops: float | None = None
    tf32_tensor_flops: float | None = None  # dense tensor-core peaks, FP32 accumulation
    fp16_tensor_flops: float | None = None
    bf16_tensor_flops: float | None = None
    pcie_gen: int | None = None  # the host link's PCIe generation (x16)
    nvlink_bandwidth: float | None = None  # total NVLink bandwidth per GPU (all links, both directions)
    source: str = ""  # where the figures come from (a datasheet's title, a URL)
    provenance: str = "user"  # one of SPEC_PROVENANCES

    def __post_init__(self) -> None:
        if isinstance(self.aliases, str) or not all(isinstance(a, str) and a.strip() for a in self.aliases):
            raise ValueError(f"GpuSpec.aliases must be a list of non-empty names, got {self.aliases!r}")
        object.__setattr__(self, "aliases", tuple(a.strip() for a in self.aliases))
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("GpuSpec.name must be a non-empty string such as 'Tesla V100-PCIE-32GB'")
        for fname in _POSITIVE_GPU_FIELDS:
            v = getattr(self, fname)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"GpuSpec.{fname} of {self.name!r} must be a positive number, got {v!r}")
        for fname in _NON_NEGATIVE_GPU_FIELDS:
            v = getattr(self, fname)
            if v is not None and (
                not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v < 0
            ):
                raise ValueError(
                    f"GpuSpec.{fname} of {self.name!r} must be a number >= 0 (0: the GPU has none) "
                    f"or empty (not known), got {v!r}"
                )
        try:
            object.__setattr__(self, "compute_capability", parse_compute_capability(self.compute_capability))
        except ValueError as exc:
            raise ValueError(f"GpuSpec.compute_capability of {self.name!r}: {exc}") from None
        g = self.generation
        if g is not None and (not isinstance(g, str) or not g.isalpha() or not g.islower()):
            raise ValueError(
                f"GpuSpec.generation of {self.name!r} must be an architecture name such as "
                f"'ampere' or 'hopper', got {g!r}"
            )
        p = self.pcie_gen
        if p is not None and (not _is_whole(p) or not 1 <= p <= 9):
            raise ValueError(f"GpuSpec.pcie_gen of {self.name!r} must be a PCIe generation from 1 to 9, got {p!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"GpuSpec.source of {self.name!r} must be text, got {self.source!r}")
        if self.provenance not in SPEC_PROVENANCES:
            raise ValueError(
                f"GpuSpec.provenance of {self.name!r} must be one of {', '.join(SPEC_PROVENANCES)}, "
                f"got {self.provenance!r}"
            )

    @property
    def short_name(self) -> str:
        """The short alias researchers type (e.g. 'V100'), or the name itself."""
        return self.aliases[0] if self.aliases else self.name


@dataclass(frozen=True)
class ModelInfo:
    """Structural facts of one model (for recognising a user's model and FLOP-based costs)."""

    name: str
    class_name: str
    param_count: int
    param_bytes: int
    buffer_bytes: int
    fwd_flops_per_sample: float
    fwd_bwd_flops_per_sample: float
    fingerprint: str | None = None
    input_size: int | None = None  # square image side the measurements used (224 for ImageNet)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("ModelInfo.name must be a non-empty string such as 'resnet50'")
        for fname in ("param_count", "param_bytes", "buffer_bytes", "fwd_flops_per_sample", "fwd_bwd_flops_per_sample"):
            v = getattr(self, fname)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ModelInfo.{fname} of {self.name!r} must be a number >= 0, got {v!r}")


@dataclass(frozen=True)
class Lookup:
    """One answer of the database: the value, its unit and how it was obtained."""

    value: float
    unit: str  # "seconds" | "bytes" | "samples" (max_batch_size only)
    provenance: str  # "measured" | "interpolated" | "extrapolated"


@dataclass(frozen=True)
class Measurement:
    """One measured value, as the profiler writes it and export/import carries it."""

    gpu: str
    model: str
    kind: str
    batch_size: int  # 0 for batch-independent kinds (model_transfer)
    value: float
    unit: str | None = None  # derived from kind when None; must match the kind's unit
    world_size: int = 1
    samples: int | None = None
    std: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    source: str = ""
    measured_at: str | None = None  # ISO 8601
    metadata: Mapping[str, Any] = field(default_factory=dict)  # tool versions, notes


def normalize_name(name: str) -> str:
    """Key for forgiving name matching: case, spaces, '_' and '-' do not matter."""
    return "".join(ch for ch in name.lower() if ch not in " _-")


def check_kind(kind: Any) -> str:
    if kind not in KIND_UNITS:
        raise ValueError(f"unknown measurement kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    return kind


def check_batch_size(batch_size: Any) -> int:
    """A batch size must be a whole number >= 1 (bools, floats and strings are refused)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
        raise ValueError(f"batch size must be an integer >= 1, got {batch_size!r} ({type(batch_size).__name__})")
    if batch_size < 1:
        raise ValueError(f"batch size must be an integer >= 1, got {batch_size}")
    return int(batch_size)

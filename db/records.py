"""The plain values the profile database hands out and takes in.

These dataclasses are the contract of docs/architecture.md: other modules (costs, memory,
cuda_api, the profiler) see only these, never SQLAlchemy rows.
"""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = [
    "GpuSpec",
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


class UnknownNameError(ValueError):
    """A GPU or model name the database does not know; the message lists close matches."""

    def __init__(self, what: str, name: Any, valid: Iterable[str], extra_keys: Iterable[str] = ()) -> None:
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
        super().__init__(text)
        self.name = name
        self.suggestions = seen
        self.valid = valid


class MissingMeasurementError(LookupError, ValueError):
    """The database has no measurement of this kind for this GPU and model."""


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet facts of one GPU model. Bandwidths in bytes/s, FLOP rates in FLOP/s."""

    name: str  # as torch.cuda.get_device_name() reports it on the real GPU
    aliases: tuple[str, ...]
    memory_bytes: int
    fp32_flops: float
    fp16_flops: float
    memory_bandwidth: float
    host_link_bandwidth_pinned: float
    host_link_bandwidth_pageable: float
    sm_count: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "aliases", tuple(self.aliases))
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("GpuSpec.name must be a non-empty string such as 'Tesla V100-PCIE-32GB'")
        for fname in ("memory_bytes", "fp32_flops", "fp16_flops", "memory_bandwidth",
                      "host_link_bandwidth_pinned", "host_link_bandwidth_pageable", "sm_count"):
            v = getattr(self, fname)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"GpuSpec.{fname} of {self.name!r} must be a positive number, got {v!r}")

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
        raise ValueError(
            f"batch size must be an integer >= 1, got {batch_size!r} ({type(batch_size).__name__})"
        )
    if batch_size < 1:
        raise ValueError(f"batch size must be an integer >= 1, got {batch_size}")
    return int(batch_size)

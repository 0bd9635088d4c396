"""A GPU from its datasheet numbers, in the units a datasheet prints them (`gpemu gpus add`).

One table (:data:`FIELDS`) says every field's key, unit, range and meaning; the command line's
options and a YAML/JSON file use the same keys, and :func:`spec_from_datasheet` checks either
the same way: the first bad field is one ``ValueError`` naming it and what is valid, and nothing
is written. What a datasheet leaves out (which generations have TF32 / BF16 / FP16 tensor cores,
the usual compute capability, the PCIe generation and the host-copy rates, memory "GB" read as
GiB) is taken from the one place of GPU facts, ``gpemu.costmodel.gpus``, never restated here.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpemu.costmodel.gpus import (
    DEFAULT_PCIE_GEN,
    GENERATIONS,
    PINNED_SHARE,
    datasheet_memory_bytes,
    first_generation_with,
    generation_capability,
    pageable_copy_rate,
    pinned_copy_rate,
)

from .records import GpuSpec, normalize_name, parse_compute_capability

__all__ = [
    "FIELDS",
    "Field",
    "spec_from_datasheet",
    "read_datasheet_file",
    "datasheet_of",
    "check_names_free",
]

_GiB = 1 << 30  # (a unit, for the memory_gb field's scale and datasheet_of)


@dataclass(frozen=True)
class Field:
    key: str  # file key; the option is --key with '-' for '_'
    kind: str  # "text", "names", "int", "float", "generation", "cc"
    help: str
    low: float | None = None
    high: float | None = None
    required: bool = False
    scale: float = 1.0  # datasheet unit -> GpuSpec unit


FIELDS: tuple[Field, ...] = (
    Field(
        "name",
        "text",
        "what torch.cuda.get_device_name() reports on the real GPU, e.g. 'NVIDIA GeForce RTX 3090'",
        required=True,
    ),
    Field("aliases", "names", "short names for --gpu, the first shown in tables (e.g. RTX3090)"),
    Field("generation", "generation", "architecture; decides which calibrated curves price it", required=True),
    Field("compute_capability", "cc", "MAJOR.MINOR, e.g. 8.6 [default: the generation's usual one]"),
    Field("sms", "int", "streaming multiprocessors (SMs)", 1, 1024, required=True),
    Field(
        "memory_gb",
        "float",
        "memory as the datasheet says it, in GB (24 for a 24 GB card; stored as GiB, as every shipped GPU is)",
        0.25,
        4096,
        required=True,
        scale=_GiB,
    ),
    Field("bandwidth_gbs", "float", "memory bandwidth, GB/s", 1, 100_000, required=True, scale=1e9),
    Field("fp32_tflops", "float", "FP32 peak (non-tensor), TFLOP/s", 0.01, 10_000, required=True, scale=1e12),
    Field(
        "fp64_tflops",
        "float",
        "FP64 peak, TFLOP/s [default: not known; the cost model assumes 1/32 of FP32]",
        0,
        10_000,
        scale=1e12,
    ),
    Field(
        "fp16_tflops", "float", "FP16 peak without tensor cores, TFLOP/s [default: not known]", 0, 10_000, scale=1e12
    ),
    Field(
        "tf32_tensor_tflops",
        "float",
        "TF32 tensor-core peak, dense (NVIDIA's 'with sparsity' figure / 2), "
        "TFLOP/s; 0: none [default: 0 before Ampere]",
        0,
        100_000,
        scale=1e12,
    ),
    Field(
        "fp16_tensor_tflops",
        "float",
        "FP16 tensor-core peak with FP32 accumulate, dense, TFLOP/s; 0: none [default: 0 before Volta]",
        0,
        100_000,
        scale=1e12,
    ),
    Field(
        "bf16_tensor_tflops",
        "float",
        "BF16 tensor-core peak, dense, TFLOP/s; 0: none [default: 0 before Ampere]",
        0,
        100_000,
        scale=1e12,
    ),
    Field("pcie_gen", "int", f"PCIe generation of the x16 host link [default: {DEFAULT_PCIE_GEN}]", 1, 7),
    Field(
        "nvlink_gbs",
        "float",
        "total NVLink bandwidth per GPU, GB/s (all links, both directions); 0: none [default: 0]",
        0,
        100_000,
        scale=1e9,
    ),
    Field(
        "host_pinned_gbs",
        "float",
        f"host->GPU copies from pinned memory, GB/s [default: {PINNED_SHARE:g} x the PCIe link]",
        0.1,
        10_000,
        scale=1e9,
    ),
    Field(
        "host_pageable_gbs",
        "float",
        "host->GPU copies from pageable memory, GB/s [default: what the shipped GPUs with that PCIe generation have]",
        0.1,
        10_000,
        scale=1e9,
    ),
    Field("source", "text", "where the numbers come from (datasheet title or URL)"),
)
_BY_KEY = {f.key: f for f in FIELDS}
# Keys of `gpemu db export` GPU entries: such a file goes to `gpemu db import` instead.
_EXPORT_KEYS = {"memory_bytes", "fp32_flops", "memory_bandwidth", "sm_count"}


def _unit(key: str) -> str:
    """The unit a field is given in, for errors (a FLOP/s figure typed as TFLOP/s is the usual slip)."""
    for suffix, unit in (("_tflops", " TFLOP/s"), ("_gbs", " GB/s"), ("_gb", " GB")):
        if key.endswith(suffix):
            return unit
    return ""


def _check(f: Field, value: Any) -> Any:
    """The value of one field, checked; ValueError naming the field and what is valid."""
    label = f"{f.key} (--{f.key.replace('_', '-')})"
    if f.kind == "text":
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{label} must be non-empty text, got {value!r}")
        return value.strip()
    if f.kind == "names":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n.strip() for n in names):
            raise ValueError(f"{label} must be a list of short names such as [RTX3090], got {value!r}")
        return tuple(n.strip() for n in names)
    if f.kind == "generation":
        if not isinstance(value, str) or value.strip().lower() not in GENERATIONS:
            raise ValueError(f"{label} must be one of {', '.join(GENERATIONS)}, got {value!r}")
        return value.strip().lower()
    if f.kind == "cc":
        try:
            return parse_compute_capability(value)
        except ValueError:
            raise ValueError(f"{label} must be MAJOR.MINOR such as 8.6 or 9.0, got {value!r}") from None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if f.kind == "int":
        ok = ok and float(value).is_integer()
    rng = f"from {f.low:g} to {f.high:g}" + _unit(f.key)
    if not ok or not (f.low <= value <= f.high):
        what = "a whole number" if f.kind == "int" else "a number"
        shown = f"{value:g}" if isinstance(value, numbers.Real) and not isinstance(value, bool) else repr(value)
        raise ValueError(f"{label} must be {what} {rng}, got {shown}")
    return int(value) if f.kind == "int" else float(value)


def spec_from_datasheet(values: Mapping[str, Any], *, provenance: str = "user") -> GpuSpec:
    """A :class:`GpuSpec` from datasheet numbers keyed as in :data:`FIELDS` (None: left out).

    Raises ValueError for the first bad field: an unknown key, a missing required one, a value
    out of its range, or a tensor-core figure a GPU of that generation cannot have."""
    v = _checked_fields(values)
    _check_tensor_cores(v)
    return _spec(v, provenance)


def _checked_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """Every field of :data:`FIELDS` checked (None where left out); ValueError for the first
    unknown, missing or bad one."""
    unknown = sorted(k for k in values if k not in _BY_KEY)
    if unknown:
        if _EXPORT_KEYS & set(values):
            raise ValueError(
                "this is a GPU entry of the `gpemu db export` format (memory_bytes, fp32_flops, ...): "
                "import such a file with `gpemu db import FILE`"
            )
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; valid fields: {', '.join(_BY_KEY)}")
    v: dict[str, Any] = {}
    for f in FIELDS:
        raw = values.get(f.key)
        if raw is None or (isinstance(raw, str) and not raw.strip() and f.kind != "text") or raw == ():
            if f.required:
                raise ValueError(f"{f.key} (--{f.key.replace('_', '-')}) is required: {f.help}")
            v[f.key] = None
            continue
        v[f.key] = _check(f, raw)
    return v


_TENSOR_CORE_FIELDS = {
    "tf32_tensor_tflops": "tf32_tensor_flops",
    "fp16_tensor_tflops": "fp16_tensor_flops",
    "bf16_tensor_tflops": "bf16_tensor_flops",
}


def _check_tensor_cores(v: dict[str, Any]) -> None:
    """Tensor-core figures the generation can have, in TFLOP/s: a unit older generations lack is
    0 (ValueError when given), and a figure under a quarter of FP32 is a unit slip."""
    gen = v["generation"]
    for key, unit in _TENSOR_CORE_FIELDS.items():
        first = first_generation_with(unit)
        if GENERATIONS.index(gen) < GENERATIONS.index(first):
            if v[key]:
                raise ValueError(
                    f"{key} (--{key.replace('_', '-')}): {gen} GPUs have no such tensor cores (the "
                    f"first generation with them is {first}); give 0 or leave it out"
                )
            v[key] = 0.0
    fp32 = v["fp32_tflops"]
    for key in ("fp16_tensor_tflops", "bf16_tensor_tflops", "tf32_tensor_tflops"):
        if v[key] and v[key] < fp32 / 4:
            raise ValueError(
                f"{key} (--{key.replace('_', '-')}) = {v[key]:g} TFLOP/s is under a quarter of the FP32 "
                f"peak ({fp32:g}): give TFLOP/s (not FLOP/s or GFLOP/s), or 0 for none"
            )


def _spec(v: dict[str, Any], provenance: str) -> GpuSpec:
    """The GpuSpec of checked fields; what they leave out is filled in from the GPU facts (PCIe
    generation, host-copy rates, the generation's compute capability)."""

    def scaled(key: str) -> float | None:
        return None if v[key] is None else v[key] * _BY_KEY[key].scale

    pcie = v["pcie_gen"] or DEFAULT_PCIE_GEN
    fp32 = v["fp32_tflops"] * _BY_KEY["fp32_tflops"].scale
    fp16_plain = scaled("fp16_tflops")
    return GpuSpec(
        name=v["name"],
        aliases=v["aliases"] or (),
        memory_bytes=datasheet_memory_bytes(v["memory_gb"]),
        fp32_flops=fp32,
        fp16_flops=max(scaled("fp16_tensor_tflops") or 0.0, fp16_plain or 0.0) or fp32,
        memory_bandwidth=v["bandwidth_gbs"] * _BY_KEY["bandwidth_gbs"].scale,
        host_link_bandwidth_pinned=scaled("host_pinned_gbs") or pinned_copy_rate(pcie),
        host_link_bandwidth_pageable=scaled("host_pageable_gbs") or pageable_copy_rate(pcie),
        sm_count=v["sms"],
        generation=v["generation"],
        compute_capability=v["compute_capability"] or generation_capability(v["generation"]),
        fp64_flops=scaled("fp64_tflops"),
        fp16_nontensor_flops=fp16_plain,
        tf32_tensor_flops=scaled("tf32_tensor_tflops"),
        fp16_tensor_flops=scaled("fp16_tensor_tflops"),
        bf16_tensor_flops=scaled("bf16_tensor_tflops"),
        pcie_gen=pcie,
        nvlink_bandwidth=scaled("nvlink_gbs") or 0.0,
        source=v["source"] or "entered with `gpemu gpus add`",
        provenance=provenance,
    )


def datasheet_of(spec: GpuSpec) -> dict[str, Any]:
    """A GpuSpec back in datasheet units and :data:`FIELDS` keys (unknown facts left out)."""

    def per(x: float | None, scale: float) -> float | None:
        return None if x is None else round(x / scale, 6)

    out: dict[str, Any] = {
        "name": spec.name,
        "aliases": list(spec.aliases),
        "generation": spec.generation,
        "compute_capability": f"{spec.compute_capability[0]}.{spec.compute_capability[1]}"
        if spec.compute_capability
        else None,
        "sms": spec.sm_count,
        "memory_gb": per(spec.memory_bytes, _GiB),
        "bandwidth_gbs": per(spec.memory_bandwidth, 1e9),
        "fp32_tflops": per(spec.fp32_flops, 1e12),
        "fp64_tflops": per(spec.fp64_flops, 1e12),
        "fp16_tflops": per(spec.fp16_nontensor_flops, 1e12),
        "tf32_tensor_tflops": per(spec.tf32_tensor_flops, 1e12),
        "fp16_tensor_tflops": per(spec.fp16_tensor_flops, 1e12),
        "bf16_tensor_tflops": per(spec.bf16_tensor_flops, 1e12),
        "pcie_gen": spec.pcie_gen,
        "nvlink_gbs": per(spec.nvlink_bandwidth, 1e9),
        "host_pinned_gbs": per(spec.host_link_bandwidth_pinned, 1e9),
        "host_pageable_gbs": per(spec.host_link_bandwidth_pageable, 1e9),
        "source": spec.source or None,
    }
    return {k: x for k, x in out.items() if x is not None}


def read_datasheet_file(path: str | Path) -> list[dict[str, Any]]:
    """The GPU entries of a YAML or JSON file: one mapping of :data:`FIELDS` keys, a list of
    them, or ``{"gpus": [...]}``. ValueError naming the file for anything else."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if isinstance(data, dict) and data.get("format") == "gpemu-profile-db":
        raise ValueError(f"{path} is a `gpemu db export` file: import it with `gpemu db import {path}`")
    if isinstance(data, dict) and isinstance(data.get("gpus"), list):
        data = data["gpus"]
    entries: Iterable[Any] = data if isinstance(data, list) else [data]
    out = []
    for i, e in enumerate(entries, 1):
        if not isinstance(e, dict):
            raise ValueError(
                f"{path}: GPU #{i} must be a mapping of datasheet fields (name, generation, sms, "
                f"memory_gb, ...), got {type(e).__name__}"
            )
        out.append(e)
    if not out:
        raise ValueError(f"{path} holds no GPU")
    return out


def check_names_free(spec: GpuSpec, known: Iterable[GpuSpec], replace: bool) -> None:
    """ValueError when ``spec``'s name or an alias already names another GPU, or its name is a GPU
    that exists (unless ``replace``; never a shipped one)."""
    for other in known:
        if other.name == spec.name:
            if other.provenance == "datasheet":
                raise ValueError(f"{spec.name!r} ships with gpemu (datasheet): add yours under another name")
            if not replace:
                raise ValueError(f"{spec.name!r} is already in the database: pass --replace to update it")
            continue
        theirs = {normalize_name(n): n for n in (other.name, *other.aliases)}
        for n in (spec.name, *spec.aliases):
            if normalize_name(n) in theirs:
                raise ValueError(f"{n!r} already names {other.name} ({other.short_name}); pick another alias")

"""The GPUs the database ships: every sheet of ``gpemu.costmodel.gpus.GPUS``, the one place of GPU facts.

That table holds each GPU's datasheet figures and their sources (NVIDIA's datasheets and
whitepapers, one K80 being one GK210 die as CUDA sees it); this module only turns its sheets into
database rows (:class:`~gpemu.db.GpuSpec`, provenance ``datasheet``). Six of them (K80, M40,
P100, V100, Quadro RTX 6000, A100 40GB) have the GPEmu artifact's measurements; the others are
datasheet-only and priced by the cost model.

The table is imported only when the database is built (importing the cost model package loads
torch); whether a built database is current is decided from the table's source text
(:func:`gpu_facts_digest`), so opening a current database never imports it.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .records import GpuSpec

if TYPE_CHECKING:
    from gpemu.costmodel.gpus import GpuSheet

__all__ = ["shipped_gpus", "spec_from_sheet", "gpu_facts_digest"]


def spec_from_sheet(sheet: GpuSheet, provenance: str = "datasheet") -> GpuSpec:
    """The database row of one datasheet (every fact the cost model needs, losslessly)."""
    return GpuSpec(
        name=sheet.name,
        aliases=tuple(sheet.aliases),
        memory_bytes=int(sheet.memory_bytes),
        fp32_flops=float(sheet.fp32_flops),
        # The legacy single FP16 figure: tensor cores where the GPU has them.
        fp16_flops=float(max(sheet.fp16_tensor_flops, sheet.fp16_flops)),
        memory_bandwidth=float(sheet.memory_bandwidth),
        host_link_bandwidth_pinned=float(sheet.host_link_bandwidth_pinned),
        host_link_bandwidth_pageable=float(sheet.host_link_bandwidth_pageable),
        sm_count=int(sheet.sm_count),
        generation=sheet.generation,
        compute_capability=sheet.compute_capability,
        fp64_flops=float(sheet.fp64_flops),
        fp16_nontensor_flops=float(sheet.fp16_flops),
        tf32_tensor_flops=float(sheet.tf32_tensor_flops),
        fp16_tensor_flops=float(sheet.fp16_tensor_flops),
        bf16_tensor_flops=float(sheet.bf16_tensor_flops),
        pcie_gen=int(sheet.pcie_gen),
        nvlink_bandwidth=float(sheet.nvlink_bandwidth),
        source=sheet.source,
        provenance=provenance,
    )


@functools.lru_cache(maxsize=1)
def shipped_gpus() -> tuple[GpuSpec, ...]:
    """Every GPU of the datasheet table, as database rows (the measured six first, table order)."""
    from gpemu.costmodel.gpus import GPUS

    return tuple(spec_from_sheet(s) for s in GPUS)


@functools.lru_cache(maxsize=1)
def gpu_facts_digest() -> str:
    """Hash of the datasheet table's source: a changed table means default databases get rebuilt."""
    package = sys.modules["gpemu"]  # imported already: gpemu.db is its subpackage
    path = Path(str(package.__file__)).resolve().parent / "costmodel" / "gpus.py"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:  # installed without sources: hash the rows themselves (imports the table)
        return hashlib.sha256(repr(shipped_gpus()).encode()).hexdigest()


def __getattr__(name: str) -> Any:  # SHIPPED_GPUS, as before schema 2, without importing torch at import
    if name == "SHIPPED_GPUS":
        return shipped_gpus()
    raise AttributeError(f"module 'gpemu.db.specs' has no attribute {name!r}")

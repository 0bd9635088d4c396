"""A GPU's compute capability, from its database row or the datasheet table.

The capability decides what a GPU of that generation runs (tensor cores, which attention kernel
torch picks) and what ``torch.cuda.get_device_capability()`` reports. The database stores it for
every shipped GPU and for GPUs added with their generation (`gpemu gpus add`); a GPU added before
the database stored it is matched by name against ``gpemu.costmodel.gpus.GPUS``, or takes its
generation's usual capability.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compute_capability", "generation_capability"]

# A GPU the database and the datasheet table know nothing about: the cost model prices it as an
# Ampere GPU (gpemu.costmodel.gpus.sheet_from_spec), so it reports the A100's capability.
_UNKNOWN = (8, 0)


def compute_capability(spec: Any) -> tuple[int, int]:
    """(major, minor) of a GPU: its own ``compute_capability`` (a ``gpemu.db.GpuSpec`` field),
    else the datasheet sheet its name or an alias matches, else its generation's usual one."""
    own = getattr(spec, "compute_capability", None)
    if own:
        if isinstance(own, str):
            major, _, minor = own.partition(".")
            return int(major), int(minor or 0)
        return int(own[0]), int(own[1])
    from gpemu.costmodel.gpus import find_gpu

    names = [getattr(spec, "name", spec if isinstance(spec, str) else None), *(getattr(spec, "aliases", ()) or ())]
    for text in names:
        if isinstance(text, str):
            sheet = find_gpu(text)
            if sheet is not None:
                return tuple(sheet.compute_capability)  # type: ignore[return-value]
    generation = getattr(spec, "generation", None)
    cc = generation_capability(generation) if generation else None
    return cc if cc is not None else _UNKNOWN


def generation_capability(generation: str) -> tuple[int, int] | None:
    """The compute capability most datasheet sheets of ``generation`` have (Ampere: 8.0, the
    A100's; Ada 8.9), or None for a generation the table does not have."""
    from gpemu.costmodel.gpus import GPUS

    seen: dict[tuple[int, int], int] = {}
    for s in GPUS:
        if s.generation == generation:
            cc = (int(s.compute_capability[0]), int(s.compute_capability[1]))
            seen[cc] = seen.get(cc, 0) + 1
    return max(seen, key=lambda cc: (seen[cc], cc)) if seen else None

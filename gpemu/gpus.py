"""Facts about GPU models that the profile database does not hold: compute capability.

The capability decides what a GPU of that generation runs (tensor cores, which attention kernel
torch picks) and what ``torch.cuda.get_device_capability()`` reports.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compute_capability"]

# Real compute capabilities of the GPU models gpemu emulates (name fragment -> (major, minor)).
# Longer fragments first so "RTX 6000" does not match "A6000" rules etc.
_CAPABILITY: tuple[tuple[str, tuple[int, int]], ...] = (
    ("B200", (10, 0)), ("H200", (9, 0)), ("H100", (9, 0)), ("L40", (8, 9)), ("L4", (8, 9)), ("4090", (8, 9)),
    ("A100", (8, 0)), ("A6000", (8, 6)), ("A40", (8, 6)), ("A30", (8, 0)), ("A10", (8, 6)), ("RTX6000", (7, 5)),
    ("RTX 6000", (7, 5)), ("T4", (7, 5)), ("V100", (7, 0)), ("P100", (6, 0)), ("P40", (6, 1)),
    ("M40", (5, 2)), ("K80", (3, 7)),
)


def compute_capability(spec: Any) -> tuple[int, int]:
    """(major, minor) of a GPU spec: its own field if the database has one, else the known table."""
    own = getattr(spec, "compute_capability", None)
    if own:
        if isinstance(own, str):
            major, _, minor = own.partition(".")
            return int(major), int(minor or 0)
        return int(own[0]), int(own[1])
    names = [getattr(spec, "name", str(spec))] + list(getattr(spec, "aliases", ()) or ())
    for text in names:
        key = text.upper().replace("_", " ").replace("-", " ")
        squeezed = key.replace(" ", "")
        for fragment, cc in _CAPABILITY:
            if fragment.replace(" ", "") in squeezed:
                return cc
    return (7, 0)

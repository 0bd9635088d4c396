"""Symmetric memory (async tensor parallel's fused all-gather-matmul, NVSHMEM all-to-all) is
refused in one line: it maps other GPUs' memory into this one's, which an emulated GPU does not
have. The refusal says what to turn off."""

from __future__ import annotations

from types import ModuleType
from typing import Any, NoReturn

from ..patching import Patcher

__all__ = ["SYMMETRIC_MEMORY_MODULE", "SymmetricMemoryRefused", "refuse_symmetric_memory"]

SYMMETRIC_MEMORY_MODULE = "torch.distributed._symmetric_memory"
# The module's doors into symmetric memory (the rest are helpers over what they return).
_DOORS = ("empty", "rendezvous", "enable_symm_mem_for_group", "get_symm_mem_workspace", "set_backend")


class SymmetricMemoryRefused(RuntimeError):
    """A program asked for symmetric memory on emulated GPUs."""


def _refuse(*args: Any, **kwargs: Any) -> NoReturn:
    raise SymmetricMemoryRefused(
        "gpemu: symmetric memory (async tensor parallel, NVSHMEM) maps peer GPUs' memory, which emulated GPUs do "
        "not have: turn async TP off (torchtitan: parallelism.enable_async_tensor_parallel = false; "
        "torch._inductor.config._micro_pipeline_tp = False); plain tensor parallel runs emulated"
    )


def refuse_symmetric_memory(patcher: Patcher, module: ModuleType) -> None:
    """Replace the module's doors (now, or when a program imports it) with the refusal."""
    for name in _DOORS:
        if hasattr(module, name):
            patcher.replace(module, name, _refuse)

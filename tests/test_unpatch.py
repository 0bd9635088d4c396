"""gpemu.unpatch() leaves torch exactly as it was.

A snapshot of every attribute of torch, torch.cuda (and its submodules), torch.accelerator,
torch.backends, torch.distributed, torch.Tensor, torch.nn.Module, GradScaler and DDP is taken
before patching and compared (by identity) after unpatching.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.distributed
import torch.nn.parallel

import gpemu

# Entries torch itself changes as a side effect of being used (caches, warning registries).
_VOLATILE = {"__warningregistry__", "_cached_device_count", "_tls", "_lazy_seed_tracker", "_queued_calls"}


def _owners() -> dict[str, object]:
    owners: dict[str, object] = {}
    for name, mod in list(sys.modules.items()):
        if mod is None:
            continue
        if name == "torch" or any(
            name == p or name.startswith(p + ".")
            for p in (
                "torch.cuda",
                "torch.accelerator",
                "torch.backends",
                "torch.distributed",
                "torch.nn.parallel",
                "torch.amp",
                "torch.optim",
                "torch.utils.data",
            )
        ):
            owners[name] = mod
    owners["class:torch.Tensor"] = torch.Tensor
    owners["class:torch.nn.Module"] = torch.nn.Module
    owners["class:GradScaler"] = torch.amp.GradScaler
    owners["class:cuda.amp.GradScaler"] = torch.cuda.amp.GradScaler
    owners["class:DDP"] = torch.nn.parallel.DistributedDataParallel
    owners["class:DataParallel"] = torch.nn.DataParallel
    from torch.nn.parallel import _functions

    owners["class:Scatter"] = _functions.Scatter
    return owners


def _snapshot() -> dict[tuple[str, str], object]:
    snap: dict[tuple[str, str], object] = {}
    for owner_name, owner in _owners().items():
        try:
            items = dict(vars(owner))
        except TypeError:
            continue
        for attr, value in items.items():
            if attr in _VOLATILE:
                continue
            snap[(owner_name, attr)] = value
    return snap


def _diff(before: dict, after: dict) -> list[str]:
    problems = []
    for key in before.keys() | after.keys():
        if key[0] not in {k[0] for k in before}:  # a module first imported while patched
            continue
        if key not in after:
            problems.append(f"{key} removed")
        elif key not in before:
            problems.append(f"{key} added")
        elif after[key] is not before[key] and not (
            isinstance(before[key], (int, float, str, bool, type(None))) and before[key] == after[key]
        ):
            problems.append(f"{key} changed: {before[key]!r} -> {after[key]!r}")
    return sorted(problems)


def _exercise() -> None:
    """Touch the surface so lazy state (initialisation, streams, seeds) is created."""
    torch.cuda.init()
    torch.cuda.set_device(1)
    torch.manual_seed(1)
    torch.cuda.get_rng_state()
    with torch.cuda.device(0):
        torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda.current_stream()
    torch.accelerator.set_device_index(0)
    torch.accelerator.current_stream().is_capturing()
    torch.cuda.memory_allocated()
    torch.amp.GradScaler("cuda").get_scale()
    torch.cuda.nvtx.range_push("x")
    torch.cuda.nvtx.range_pop()


@pytest.mark.slow
def test_unpatch_restores_every_attribute() -> None:
    before = _snapshot()
    was_initialized = torch.cuda.is_initialized()
    # (None on the CPU build; a CUDA build reports the accelerator it was built for, GPU or not)
    accelerator = torch.accelerator.current_accelerator()
    gpemu.patch(gpu="V100", num_gpus=2)
    assert torch.cuda.is_available() and torch.cuda.device_count() == 2
    during = _snapshot()
    assert _diff(before, during), "patching changed nothing: the snapshot cannot see patches"
    _exercise()
    gpemu.unpatch()
    after = _snapshot()
    assert _diff(before, after) == []
    assert torch.cuda.is_available() is False
    assert torch.cuda.device_count() == 0
    assert torch.cuda.is_initialized() == was_initialized
    assert torch.accelerator.current_accelerator() == accelerator
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


@pytest.mark.slow
def test_patch_unpatch_twice_is_clean() -> None:
    before = _snapshot()
    for gpus in (1, 3):
        gpemu.patch(gpu="A100", num_gpus=gpus)
        assert torch.cuda.device_count() == gpus
        _exercise() if gpus > 1 else torch.cuda.synchronize()
        gpemu.unpatch()
    assert _diff(before, _snapshot()) == []
    # CPU torch still works normally afterwards (seeding was the crash path).
    torch.manual_seed(0)
    assert torch.ones(2).sum().item() == 2.0


def test_unpatch_from_another_thread_state() -> None:
    """Per-thread current devices do not leak into the next run."""
    gpemu.patch(gpu="V100", num_gpus=4)
    seen = []

    def worker() -> None:
        torch.cuda.set_device(3)
        seen.append(torch.cuda.current_device())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [3] and torch.cuda.current_device() == 0
    gpemu.unpatch()
    gpemu.patch(gpu="V100", num_gpus=4)
    assert torch.cuda.current_device() == 0

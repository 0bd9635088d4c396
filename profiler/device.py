"""Facts about the device being profiled: its name, the run's metadata, and a GpuSpec.

A GPU the database does not know yet gets a GpuSpec whose rates are *measured* here with short
microbenchmarks (matrix multiply for FLOP/s, a device copy for memory bandwidth, pinned and
pageable host copies for the host link), since CUDA does not report them.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

from gpemu.db import GpuSpec

__all__ = [
    "NoGpuError",
    "resolve_device",
    "device_name",
    "device_memory",
    "run_metadata",
    "measure_gpu_spec",
    "tool_version",
]


class NoGpuError(ValueError):
    """Profiling was asked of a CUDA GPU that this machine does not have."""


def tool_version() -> str:
    try:
        import gpemu

        return str(gpemu.__version__)
    except Exception:  # pragma: no cover - partially installed tree
        return "unknown"


def resolve_device(device: str) -> torch.device:
    """``'cuda'``, ``'cuda:1'`` or ``'cpu'``; refuses CUDA without a GPU, with what to do instead."""
    text = device.strip().lower()
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = (
                "this PyTorch has no CUDA support (CPU build)"
                if torch.version.cuda is None
                else "PyTorch sees no CUDA GPU"
            )
            raise NoGpuError(
                f"gpemu profile measures real GPUs, but {build}. Run it on a machine with an NVIDIA "
                f"GPU, or pass --device cpu to run the same pipeline on the CPU (recorded under the "
                f"GPU name 'cpu'; useful for testing, not for emulation)."
            )
        dev = torch.device(text if ":" in text else "cuda:0")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise NoGpuError(
                f"device {text!r} does not exist: this machine has {count} GPU(s), cuda:0..cuda:{count - 1}"
            )
        return dev
    raise ValueError(f"unknown device {device!r}; valid: cuda, cuda:N, cpu")


def device_name(device: torch.device) -> str:
    """The name ``torch.cuda.get_device_name`` reports (what the emulator shows), or ``cpu``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def device_memory(device: torch.device, memory_limit: int | None) -> int:
    """Bytes the device offers a model: the GPU's memory, or the CPU cap / host RAM."""
    if device.type == "cuda":
        total = int(torch.cuda.get_device_properties(device).total_memory)
        return min(total, memory_limit) if memory_limit else total
    if memory_limit:
        return memory_limit
    import psutil

    return int(psutil.virtual_memory().total)


def _driver_version() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            out = subprocess.run(
                [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            return out.strip().splitlines()[0].strip() or None
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    try:
        # CUDA driver API version, e.g. 12040 (CUDA builds only: torch's stubs do not declare it)
        v = torch._C._cuda_getDriverVersion()  # type: ignore[attr-defined]
        return f"cuda-driver-api {v // 1000}.{(v % 1000) // 10}"
    except Exception:
        return None


def run_metadata(device: torch.device, gpu_name: str, memory_bytes: int) -> dict[str, Any]:
    """Provenance attached to every row this run writes."""
    meta: dict[str, Any] = {
        "gpu_name": gpu_name,
        "gpu_memory_bytes": memory_bytes,
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": _driver_version() if device.type == "cuda" else None,
        "host": socket.gethostname(),
        "platform": platform.platform(terse=True),
        "tool": "gpemu profile",
        "tool_version": tool_version(),
    }
    if device.type == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(device)
        meta["cudnn"] = torch.backends.cudnn.version()
    else:
        meta["cpu_count"] = os.cpu_count()
        meta["torch_threads"] = torch.get_num_threads()
    return meta


def _best_of(fn: Callable[[], object], sync: Callable[[], None], repeats: int = 3) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _matmul_rate(a: torch.Tensor, sync: Callable[[], None]) -> float:
    """FLOP/s of ``a @ a`` (square), best of 3."""
    n = int(a.shape[0])
    return 2 * n**3 / _best_of(lambda: torch.mm(a, a), sync)


def measure_gpu_spec(device: torch.device, name: str, memory_bytes: int) -> GpuSpec:
    """A GpuSpec for a device the database does not know, rates measured (best of 3)."""
    is_cuda = device.type == "cuda"
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if is_cuda else (lambda: None)
    n = 4096 if is_cuda else 512
    a = torch.randn(n, n, device=device)
    fp32 = _matmul_rate(a, sync)
    # CPU fp16 matmul is emulated; the fp32 rate is the honest upper figure.
    fp16 = _matmul_rate(a.half(), sync) if is_cuda else fp32
    del a  # free the matrices before the bandwidth buffers
    nbytes = (256 if is_cuda else 32) << 20
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    bandwidth = 2 * nbytes / _best_of(lambda: buf.clone(), sync)  # read + write
    host = torch.empty(nbytes, dtype=torch.uint8)
    if is_cuda:
        pinned = host.pin_memory()
        link_pinned = nbytes / _best_of(lambda: pinned.to(device, non_blocking=True), sync)
        link_pageable = nbytes / _best_of(lambda: host.to(device), sync)
        sms = int(torch.cuda.get_device_properties(device).multi_processor_count)
    else:
        link_pinned = link_pageable = nbytes / _best_of(lambda: host.clone(), sync)
        sms = os.cpu_count() or 1
    # No short alias is invented: "A100" for an 80GB board would clash with the shipped 40GB one.
    return GpuSpec(
        name=name,
        aliases=(),
        memory_bytes=int(memory_bytes),
        fp32_flops=float(fp32),
        fp16_flops=float(fp16),
        memory_bandwidth=float(bandwidth),
        host_link_bandwidth_pinned=float(link_pinned),
        host_link_bandwidth_pageable=float(link_pageable),
        sm_count=sms,
    )

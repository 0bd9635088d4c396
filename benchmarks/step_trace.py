"""Where a real GPU's training step spends its time, phase by phase: kernels, the GPU idle between
them, and the host's launches; the measurements the host model (docs/host-side.md) lacks.

``benchmarks/vs_real_gpu.py`` compares gpemu with the phase totals ``gpemu profile`` stored for a
real H100 (CUDA events: forward with its loss, backward, SGD step). Behind a modelled host the
emulated backward is 18% short of those totals, and the H100's own single-kernel curves do not
close the gap, so what is missing is not a kernel's price. This script runs the same loop as the
profiler (``profiler/measure.py``: gradients set to None, forward and loss, backward, SGD-momentum
step, each phase between synchronisations) under ``torch.profiler`` and splits each phase into:

* ``ms``: the phase, from its start to the end of its synchronisation;
* ``kernels`` and ``kernel ms``: the GPU kernels (and memory copies and sets) that ran in it, and
  their summed durations; ``busy ms``: the union of their intervals;
* ``idle ms``: the phase less ``busy ms``: the GPU waiting (for launches, or between kernels);
* ``launches`` and ``launch us``: the CUDA runtime's launch calls on the host, and their mean;
* ``issue ms``: from the phase's start to its last launch call's end (the host issuing it).

On the GPU's machine (one short run: 24 cases, about a minute)::

    python benchmarks/step_trace.py --out step-trace.json

Not for an emulated GPU: the device's events come from the profiler's CUDA tracing (CUPTI), which
an emulated GPU does not feed. Anywhere, the same loop on the CPU (``--device cpu``: no kernels,
the bookkeeping only)::

    python benchmarks/step_trace.py --device cpu --models resnet18 --batches 2 --iterations 1
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _common import machine  # (puts the repository on sys.path)
from torch.nn import functional as F

from examples import tvmodels

PHASES = ("forward", "backward", "optimizer_step")
# The twelve models and two batch sizes of the stored H100 measurements (benchmarks/data/README.md).
MODELS = (
    "alexnet,densenet121,googlenet,mobilenet_v2,mobilenet_v3_large,mobilenet_v3_small,resnet18,resnet50,"
    "resnext50_32x4d,shufflenet_v2_x0_5,squeezenet1_0,vgg16"
)
# Host-side CUDA runtime and driver calls that launch work onto a stream.
_LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernelEx",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)


@dataclass(frozen=True)
class PhaseTrace:
    """One phase of one step (see the module docstring for each field)."""

    ms: float
    kernels: int
    kernel_ms: float
    busy_ms: float
    idle_ms: float
    launches: int
    launch_us: float
    issue_ms: float


@dataclass(frozen=True)
class Interval:
    """A span on the profiler's timeline, in microseconds."""

    start: float
    end: float


def union_us(spans: list[Interval]) -> float:
    """Microseconds covered by at least one of ``spans``."""
    total, reach = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end <= reach:
            continue
        total += s.end - max(s.start, reach)
        reach = s.end
    return total


def split_phase(window: Interval, device_spans: list[Interval], launch_spans: list[Interval]) -> PhaseTrace:
    """A phase's figures from the device work and launch calls that started inside ``window``."""
    inside = [s for s in device_spans if window.start <= s.start < window.end]
    calls = [s for s in launch_spans if window.start <= s.start < window.end]
    busy = union_us(inside)
    ms = (window.end - window.start) / 1e3
    return PhaseTrace(
        ms=ms,
        kernels=len(inside),
        kernel_ms=sum(s.end - s.start for s in inside) / 1e3,
        busy_ms=busy / 1e3,
        idle_ms=max(0.0, ms - busy / 1e3),
        launches=len(calls),
        launch_us=sum(s.end - s.start for s in calls) / len(calls) if calls else 0.0,
        issue_ms=(max(s.end for s in calls) - window.start) / 1e3 if calls else 0.0,
    )


def trace_case(name: str, batch: int, device: torch.device, iterations: int, warmup: int = 3) -> dict[str, PhaseTrace]:
    """The profiler's loop on ``name`` at ``batch``: each phase of the last of ``iterations``
    profiled steps (after ``warmup`` steps)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model = tvmodels.MODELS[name]().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step(tag: str) -> None:
        opt.zero_grad(set_to_none=True)
        sync()
        with record_function(f"{tag}forward"):
            out = model(x)
            loss = F.cross_entropy(out[0] if isinstance(out, tuple) else out, y)
            sync()
        with record_function(f"{tag}backward"):
            loss.backward()
            sync()
        with record_function(f"{tag}optimizer_step"):
            opt.step()
            sync()

    for _ in range(warmup):
        step("warmup:")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(iterations):
            step(f"step{i}:")
    events = prof.events()
    last = f"step{iterations - 1}:"
    windows = {
        e.name[len(last) :]: Interval(e.time_range.start, e.time_range.end) for e in events if e.name.startswith(last)
    }
    device_spans = [
        Interval(e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    launch_spans = [Interval(e.time_range.start, e.time_range.end) for e in events if e.name in _LAUNCH_CALLS]
    return {ph: split_phase(windows[ph], device_spans, launch_spans) for ph in PHASES}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=MODELS, help="torchvision models, comma-separated (default: the stored twelve)")
    p.add_argument("--batches", default="32,128", help="batch sizes, comma-separated (default 32,128)")
    p.add_argument("--iterations", type=int, default=3, help="profiled steps per case; the last is reported")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (no kernels: the bookkeeping only)")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    a = p.parse_args()
    names = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in tvmodels.MODELS]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; valid: {', '.join(tvmodels.MODELS)}")
    try:
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError:
        p.error(f"--batches must be whole numbers separated by commas, got {a.batches!r}")
    if a.iterations < 1 or any(b < 1 for b in batches):
        p.error("--iterations and every batch size must be at least 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: run this on the GPU's machine, or give --device cpu to check the script")
    device = torch.device(a.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"machine: {machine()}; torch {torch.__version__}; device {gpu}")
    head = f"{'model':20} {'bs':>4} {'phase':15} {'ms':>8} {'kernels':>8} {'kernel ms':>10} {'busy ms':>8}"
    print(head + f" {'idle ms':>8} {'launches':>9} {'launch us':>10} {'issue ms':>9}")
    rows = []
    for name in names:
        for bs in batches:
            phases = trace_case(name, bs, device, a.iterations)
            for ph, t in phases.items():
                print(
                    f"{name:20} {bs:4d} {ph:15} {t.ms:8.2f} {t.kernels:8d} {t.kernel_ms:10.2f} {t.busy_ms:8.2f} "
                    f"{t.idle_ms:8.2f} {t.launches:9d} {t.launch_us:10.1f} {t.issue_ms:9.2f}",
                    flush=True,
                )
            rows.append({"model": name, "batch": bs, **{ph: asdict(t) for ph, t in phases.items()}})
    if a.out:
        a.out.write_text(
            json.dumps({"machine": machine(), "torch": torch.__version__, "gpu": gpu, "cases": rows}, indent=1)
        )
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

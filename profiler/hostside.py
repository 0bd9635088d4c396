"""``gpemu profile --host-side``: the host's framework issue time on the GPU it drives.

What the emulator's host model (:mod:`gpemu.time.launch`, ``--host``) charges per op, measured on
a real GPU host so that a lab can model its own machine (``--host db:NAME``):

* **per op of an eager forward pass**: a small training-shaped module chain (convolution, batch
  norm, ReLU, pooling, linear layers) at batch 1, its weights requiring gradients, called
  ``inner`` times back to back; host seconds over the ops that launch kernels;
* **per op of a backward pass**: ``torch.autograd.backward`` of as many such forwards, issued by
  autograd's engine (gradient accumulations included);
* **per launch**: a bare tiny op (``torch.add(a, b, out=c)``, no autograd, no module) on the GPU
  less the same op on the CPU build: what launching a kernel adds to the dispatcher's path (the
  CUDA runtime and the driver).

Each figure is host time with the GPU kept busy ahead (:class:`~gpemu.profiler.ops.Blocker`, the
kernels' sweep's blocker): the blocker's matrix products are enqueued first, so the host never
waits for the GPU while it issues; an event recorded after the blocker and still pending when the
host has issued everything proves it (the blocker doubles and the sample is taken again where it
does not). The median of the samples is kept.

Ops are counted as the emulator charges them: torch's own dispatch of the same calls on the CPU
build (a ``TorchDispatchMode`` on a CPU copy), less views and allocations, which launch nothing.

Host time is read with ``time.perf_counter``: on a real GPU, the host's wall clock; under
``gpemu run --clock virtual`` the emulated host's time, so profiling an emulated GPU behind a
``--host`` preset reads back that preset's issue time (tests/test_host_record.py).
"""

from __future__ import annotations

import re
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpemu.db.host_records import HostRecord, check_host_name
from gpemu.time.launch import cpu_name, measure_reference_loop_ms

from .ops import Blocker

__all__ = ["HostSideTiming", "probe_chain", "count_kernel_ops", "measure_host_side", "host_record", "default_host_name"]

Timer = Callable[[], float]

# Calls that launch no kernel: allocations (views are told by their schema).
_NO_KERNEL = frozenset(("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh"))


@dataclass(frozen=True)
class HostSideTiming:
    """What :func:`measure_host_side` measured (seconds per op; ops per pass as counted)."""

    forward_op_s: float
    backward_op_s: float
    launch_s: float
    forward_ops: int  # kernel-launching ops of one forward of the chain
    backward_ops: int  # the same of one backward
    inner: int  # passes per sample
    samples: int
    blocker_matmuls: int  # the blocker's size at the end (matrix products)
    covered: bool  # every sample's issue ran ahead of the GPU


def probe_chain() -> nn.Sequential:
    """The module chain whose issue time is measured: small layers of a CNN and an MLP head."""
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10)]
    return nn.Sequential(*layers)


class _OpCounter(TorchDispatchMode):
    """Counts the dispatched ops that launch a kernel (neither a view nor an allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func._schema.name not in _NO_KERNEL:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def count_kernel_ops(fn: Callable[[], object]) -> int:
    """Kernel-launching ops ``fn()`` dispatches (run it on CPU tensors: see the module docstring)."""
    counter = _OpCounter()
    with counter:
        fn()
    return counter.ops


def _pass_ops(chain: nn.Module, batch: torch.Tensor) -> tuple[int, int]:
    """(forward, backward) kernel-launching ops of ``chain`` on the CPU build, gradients already
    there (so the backward's accumulations count, as in every step after the first)."""
    cpu_chain, cpu_batch = _copy_to(chain, batch, torch.device("cpu"))
    out = cpu_chain(cpu_batch)
    grad = torch.ones_like(out)
    torch.autograd.backward(out, grad)
    holder: list[torch.Tensor] = []
    forward = count_kernel_ops(lambda: holder.append(cpu_chain(cpu_batch)))
    backward = count_kernel_ops(lambda: torch.autograd.backward(holder[0], grad))
    return forward, backward


def _copy_to(chain: nn.Module, batch: torch.Tensor, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    copy = probe_chain().to(device)
    copy.load_state_dict({k: v.to(device) for k, v in chain.state_dict().items()})
    return copy, batch.to(device)


def _issue_seconds(
    issue: Callable[[], object], device: torch.device, blocker: Blocker, timer: Timer, prepare: Callable[[], object]
) -> tuple[float, bool]:
    """Host seconds of ``issue()`` behind the blocker (``prepare()`` first, untimed), and whether
    the GPU was still busy with the blocker when the host had issued everything."""
    marker = torch.cuda.Event()
    while True:
        torch.cuda.synchronize(device)
        prepare()
        blocker.run()
        marker.record()
        t0 = timer()
        issue()
        seconds = timer() - t0
        covered = not marker.query()
        torch.cuda.synchronize(device)
        if covered or not blocker.grow():
            return seconds, covered


def measure_host_side(
    device: torch.device, samples: int = 7, inner: int = 8, timer: Timer | None = None
) -> HostSideTiming:
    """The host's issue time per forward op, per backward op and per launch on CUDA ``device``
    (module docstring); ``timer``: the host clock (default ``time.perf_counter``, read at call)."""
    if device.type != "cuda":
        raise ValueError(f"host-side profiling times the host issuing to a CUDA GPU; {device} is not one")
    # (looked up at each call: under `gpemu run --clock virtual` time.perf_counter is the
    # program's emulated clock, installed after this module was imported)
    clock = timer if timer is not None else (lambda: time.perf_counter())
    torch.manual_seed(0)
    with torch.cuda.device(device):
        chain, batch = probe_chain().to(device).train(), torch.randn(1, 16, 8, 8, device=device)
        forward_ops, backward_ops = _pass_ops(chain, batch)
        blocker = Blocker(device)
        grad = torch.ones(1, 10, device=device)
        outs: list[torch.Tensor] = []

        def forwards() -> None:
            outs[:] = [chain(batch) for _ in range(inner)]

        def backwards() -> None:
            for out in outs:
                torch.autograd.backward(out, grad)

        forwards()
        backwards()  # (warm-up: cuDNN's choices, the allocator, gradients allocated)
        fwd, bwd, covered = [], [], True
        for _ in range(samples):
            s, ok = _issue_seconds(forwards, device, blocker, clock, prepare=outs.clear)
            fwd.append(s / (inner * forward_ops))
            s, ok2 = _issue_seconds(backwards, device, blocker, clock, prepare=forwards)
            bwd.append(s / (inner * backward_ops))
            covered = covered and ok and ok2
        launch = _launch_seconds(device, blocker, clock, samples)
    forward_s, backward_s = statistics.median(fwd), statistics.median(bwd)
    return HostSideTiming(
        forward_op_s=forward_s,
        backward_op_s=backward_s,
        launch_s=min(launch, forward_s, backward_s),  # (a share of each op's issue time)
        forward_ops=forward_ops,
        backward_ops=backward_ops,
        inner=inner,
        samples=samples,
        blocker_matmuls=blocker.count,
        covered=covered,
    )


def _launch_seconds(device: torch.device, blocker: Blocker, clock: Timer, samples: int, n: int = 64) -> float:
    """A bare tiny op's host seconds on ``device`` less on the CPU build (median of ``samples``)."""

    def bare(on: torch.device) -> Callable[[], None]:
        a, out = torch.ones(16, device=on), torch.empty(16, device=on)

        def issue() -> None:
            for _ in range(n):
                torch.add(a, a, out=out)

        return issue

    gpu, cpu = bare(device), bare(torch.device("cpu"))
    gpu()
    cpu()
    on_gpu, on_cpu = [], []
    for _ in range(samples):
        on_gpu.append(_issue_seconds(gpu, device, blocker, clock, prepare=lambda: None)[0] / n)
        t0 = clock()
        cpu()
        on_cpu.append((clock() - t0) / n)
    return max(0.0, statistics.median(on_gpu) - statistics.median(on_cpu))


def default_host_name() -> str:
    """This machine's host name as a record name (lower case; other characters as '-')."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", socket.gethostname().lower()).strip("-._")
    return check_host_name((slug or "host")[:64])


def host_record(name: str, gpu: str, timing: HostSideTiming, meta: dict[str, Any] | None = None) -> HostRecord:
    """The database record of ``timing``, measured here on ``gpu``, under ``name``."""
    metadata = {
        "forward_ops": timing.forward_ops,
        "backward_ops": timing.backward_ops,
        "inner": timing.inner,
        "samples": timing.samples,
        "blocker_matmuls": timing.blocker_matmuls,
        "covered": timing.covered,
        "chain": "3 x (conv3x3 16ch, batch norm, relu), avgpool, linear 16-16, relu, linear 16-10; batch 1",
        **(meta or {}),
    }
    return HostRecord(
        name=check_host_name(name),
        cpu=cpu_name(),
        torch_version=torch.__version__,
        gpu=gpu,
        forward_op_s=timing.forward_op_s,
        backward_op_s=timing.backward_op_s,
        launch_s=timing.launch_s,
        reference_ms=measure_reference_loop_ms(cpu=True),
        metadata=metadata,
    )

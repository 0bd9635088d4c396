"""The host side of a GPU step: what a real framework spends issuing kernels, and the launch queue.

On a real GPU, eager PyTorch spends host time on every op it issues (Python, the dispatcher,
autograd, the caching allocator, the driver's launch call) before the kernel can start, and the
host blocks when a stream's launch queue is full. The emulator issues the same work in much less
time (or more; either way its own time is forgiven, :mod:`gpemu.time.host`), so that time is
modelled instead, by :class:`HostModel`:

- ``dispatch_s``: the framework's host seconds per op, measured on this machine by a short probe
  of eager dispatch on the CPU build (:func:`probe_dispatch_seconds`, cached per machine and
  torch version): what the CPU build spends per small op is a fair proxy for its Python +
  dispatcher + autograd part; plus what the probe cannot show (:data:`UNPROBED_OP_S`: the CUDA
  build's per-op runtime and module calls, measured on a real GPU host and scaled here);
- ``launch_s``: the driver's per-launch cost (cudaLaunchKernel and the CUDA runtime around it),
  a published figure: 4-5 us per launch (an NVIDIA forum measurement of 10,000 launches);
- both scaled to the target host (``--host``: ``this`` machine, a speed relative to it such as
  ``0.7x``, a preset of a measured host, :data:`HOST_PRESETS`, or a host recorded in the profile
  database by ``gpemu profile --host-side``, ``db:NAME``, :func:`recorded_hosts`);
- ``queue_depth``: launches a stream holds before the host blocks (about 1,000 per stream in the
  same measurement: the 1,001st launch waited for the stream's oldest kernel to finish; each of
  three streams held its own 1,000).

``--host none`` turns the model off: no modelled host time, no bounded queue (GPU time only, as
gpemu priced it before).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..clock import REAL

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy import Engine

__all__ = [
    "HostModel",
    "HOST_PRESETS",
    "HostPreset",
    "RECORDED_PREFIX",
    "recorded_hosts",
    "LAUNCH_QUEUE_DEPTH",
    "DRIVER_LAUNCH_S",
    "UNPROBED_OP_S",
    "host_model",
    "check_host",
    "probe_dispatch_seconds",
    "reference_loop_ms",
    "measure_reference_loop_ms",
    "cpu_name",
]

# Launches a stream holds before cudaLaunchKernel blocks: about a thousand (NVIDIA developer forum
# "CUDA stream are blocked when launching lots of kernels (>1000)", 2018: launches took 4-5 us
# until ~1,000 were pending, then one kernel's time each; three streams held 1,000 each).
LAUNCH_QUEUE_DEPTH = 1024
# The driver's host time per kernel launch (same measurement: 4-5 us a launch while the queue
# had room), on the measuring host; scaled with the framework's time to the target host.
DRIVER_LAUNCH_S = 4.5e-6


@dataclass(frozen=True)
class HostPreset:
    """A measured host: its framework seconds per op (driver launch included), and the time of
    the reference loop of interpreter work there (:func:`reference_loop_ms`): host work measured
    on this machine is scaled by the ratio of the two machines' loops."""

    op_s: float
    reference_ms: float
    note: str
    # The same per op of a backward pass (issued by autograd's C++ engine: no Python frames, no
    # module calls), driver launch included; None: as ``op_s``.
    backward_op_s: float | None = None
    # The kernel launch's part of ``op_s``; None: the published DRIVER_LAUNCH_S.
    launch_s: float | None = None


# Per-op issue time of measured hosts: eager PyTorch's host time per step (benchmarks/overhead.py
# --real) over the kernels the step issues (counted by torch's own dispatch of the same step).
HOST_PRESETS: dict[str, HostPreset] = {
    # The 16-core 2.1 GHz Xeon VM behind the H100 of benchmarks/data (docs/time.md): eager
    # PyTorch's issue time of a training step (overhead.py --real) over the ops gpemu charges in
    # its forward, loss and backward, the SGD step's ~1 ms aside: ResNet-50/32 15.6 ms for 408
    # ops (38 us), AlexNet/32 ~2.8 ms for 57 (49 us); its ResNet-50/32 forward took 9.9 ms for
    # ~235 ops (42 us). About 40 us per op, cuDNN's and cuBLAS's set-up per call included.
    # Its reference loop took 6.8-7.5 ms in the calls of that session (14.7-18.4 ms while busy).
    # Its backward passes, where host-bound (a small model at batch 32: the GPU's kernels priced at a
    # fifth to a third of the pass), took 41 us per op gpemu charges in them, pooled (the profiler's
    # loop sets gradients to None before each step, so those passes launched no gradient
    # accumulation): DenseNet-121 33.2 ms for 908 ops (37 us), MobileNetV3-small 8.74 ms for 190
    # (46 us), ShuffleNetV2-x0.5 10.96 ms for 189 (58 us; partly GPU-bound): about the forward's
    # figure, its forwards having taken 40-49 us per op (MobileNetV3-small 8.51 ms / 213,
    # ShuffleNetV2 11.89 / 242).
    "h100-xeon": HostPreset(
        40e-6, 7.2, "the H100's 2.1 GHz Xeon host of benchmarks/data (eager issue time per op)", 41e-6
    ),
}

# What eager PyTorch spends per op on a GPU host that this machine's probe (the CPU build's
# dispatch of functional calls on tiny CPU tensors) cannot show: the CUDA build's per-op runtime
# (the caching allocator, device and stream guards, cuDNN's and cuBLAS's per-call set-up, the
# CUDA runtime around a launch beyond DRIVER_LAUNCH_S) and nn.Module calls. Taken from the one
# CUDA host measured, the H100's (HOST_PRESETS["h100-xeon"]: 40 us per op at a reference loop of
# 7.2 ms), less the probe's dispatch at that host's speed (6.5 us here at 6.3 ms, so ~7.4 us
# there) and the launch: about 28 us there. Scaled to this machine by the reference loops; with
# it, `--host this` on that host would read its own 40 us instead of a quarter of it.
UNPROBED_OP_S = 28e-6
UNPROBED_REFERENCE_MS = HOST_PRESETS["h100-xeon"].reference_ms  # (the host it was taken on)

_PROBE_VERSION = 1
# ``--host db:NAME``: the host recorded under NAME in the profile database.
RECORDED_PREFIX = "db:"


def recorded_hosts(engine: Engine) -> dict[str, HostPreset]:
    """The hosts ``gpemu profile --host-side`` recorded in the database at ``engine``, as presets
    by name (their issue times as measured; the reference loop timed there)."""
    from ..db.host_records import read_hosts

    return {
        h.name: HostPreset(
            h.forward_op_s,
            h.reference_ms,
            f"recorded host {h.name}: {h.cpu}, torch {h.torch_version}, on {h.gpu}, {h.measured_at[:10]}",
            h.backward_op_s,
            h.launch_s,
        )
        for h in read_hosts(engine)
    }


@dataclass(frozen=True)
class HostModel:
    """What the emulated host spends per op it issues (see the module docstring)."""

    dispatch_s: float  # framework (Python, dispatcher, autograd) seconds per op on the target host
    launch_s: float  # the driver's seconds per kernel launch on the target host
    queue_depth: int = LAUNCH_QUEUE_DEPTH  # launches a stream holds before the host blocks
    source: str = ""  # where the figures come from (said in summaries)
    # The target host's seconds per second of framework work measured on this machine (host
    # time the emulator measures here by running torch's own code, e.g. an optimizer's step).
    scale: float = 1.0
    # The framework's seconds per op of a backward pass (autograd's engine issues it), when
    # measured apart; None: as ``dispatch_s``.
    backward_dispatch_s: float | None = None

    @property
    def op_s(self) -> float:
        """Host seconds to issue one op that launches one kernel."""
        return self.dispatch_s + self.launch_s

    @property
    def backward_op_s(self) -> float:
        """The same for an op of a backward pass."""
        dispatch = self.dispatch_s if self.backward_dispatch_s is None else self.backward_dispatch_s
        return dispatch + self.launch_s

    def issue_seconds(self, ops: int, launches: int | None = None) -> float:
        """Host seconds to issue ``ops`` framework calls launching ``launches`` kernels (default:
        one each)."""
        return ops * self.dispatch_s + (ops if launches is None else launches) * self.launch_s


def check_host(spec: str | None, recorded: Mapping[str, HostPreset] | None = None) -> str | None:
    """``spec`` when it is a valid ``--host`` value, else a ValueError saying what is valid
    (``recorded``: the database's recorded hosts, :func:`recorded_hosts`; None: a ``db:`` name
    is not checked)."""
    if spec is None:
        return None
    text = spec.strip().lower()
    if text in ("none", "this") or text in HOST_PRESETS:
        return text
    if text.startswith(RECORDED_PREFIX) and (recorded is None or text[len(RECORDED_PREFIX) :] in recorded):
        return text
    speed = _speed(text)
    if speed is None or not 0.01 <= speed <= 100:
        names = ", ".join(RECORDED_PREFIX + name for name in recorded or {}) or "none yet"
        raise ValueError(
            f"host must be 'this' (this machine), 'none' (no modelled host time), a speed relative to this "
            f"machine from 0.01x to 100x (e.g. 0.7x), a preset ({', '.join(HOST_PRESETS)}), or a host recorded "
            f"by `gpemu profile --host-side` (in this database: {names}); got {spec!r}"
        )
    return text


def _speed(text: str) -> float | None:
    try:
        return float(text[:-1] if text.endswith("x") else text)
    except ValueError:
        return None


def host_model(
    spec: str | None, cache_dir: Path | None = None, recorded: Mapping[str, HostPreset] | None = None
) -> HostModel | None:
    """The host model ``--host`` names (None for ``none``); see :func:`check_host`. A recorded
    host (``db:NAME``) is looked up in ``recorded`` (:func:`recorded_hosts`)."""
    text = check_host(spec, recorded if recorded is not None else {}) or "none"
    if text == "none":
        return None
    preset = HOST_PRESETS.get(text) or (recorded or {}).get(text[len(RECORDED_PREFIX) :])
    if preset is not None:
        return _preset_model(preset, text, cache_dir)
    probed = probe_dispatch_seconds(cache_dir)
    unprobed = UNPROBED_OP_S * reference_loop_ms(cache_dir) / UNPROBED_REFERENCE_MS
    speed = 1.0 if text == "this" else float(_speed(text) or 1.0)
    where = "this machine" if speed == 1.0 else f"{speed:g}x this machine"
    return HostModel(
        (probed + unprobed) / speed,
        DRIVER_LAUNCH_S / speed,
        source=f"{where}: eager dispatch {probed * 1e6:.2f} us/op measured here + {unprobed * 1e6:.1f} us"
        f" the CUDA build adds (measured on the H100's host, scaled) + {DRIVER_LAUNCH_S * 1e6:.1f} us launch",
        scale=1.0 / speed,
    )


def cpu_name() -> str:
    """This machine's CPU model name (``/proc/cpuinfo``; the platform's processor elsewhere)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def _preset_model(preset: HostPreset, name: str, cache_dir: Path | None) -> HostModel:
    """A measured host's model: its issue time per op, of which a kernel launch (its own figure,
    or the published one), the rest the framework's dispatch."""
    launch = DRIVER_LAUNCH_S if preset.launch_s is None else preset.launch_s
    share = min(1.0, launch / preset.op_s) if preset.op_s > 0 else 0.0
    backward = None if preset.backward_op_s is None else max(0.0, preset.backward_op_s - preset.op_s * share)
    return HostModel(
        preset.op_s * (1 - share),
        preset.op_s * share,
        source=f"preset {name}: {preset.note}" if name in HOST_PRESETS else preset.note,
        scale=preset.reference_ms / reference_loop_ms(cache_dir),
        backward_dispatch_s=backward,
    )


def _machine_key() -> str:
    """This machine and torch build, as the probe's cache key."""
    import torch

    return f"v{_PROBE_VERSION}|{cpu_name()}|{os.cpu_count()}|torch {torch.__version__}|{platform.python_version()}"


_MEMO: dict[str, float] = {}


def _reference_work(n: int = 20_000) -> int:
    # The kinds of work the emulator's host path does: calls, attribute reads, dict look-ups,
    # small tuples and objects. Fixed, so its time measures the interpreter's speed here (the
    # figures in docs/time.md and every benchmark's machine line use it).
    table: dict[tuple[int, int], int] = {}
    acc = 0
    for i in range(n):
        p = _Point(i, i & 7)
        key = (p.y, i & 63)
        table[key] = table.get(key, 0) + p.x
        acc += len(key) + (p.x >> 3)
    return acc + len(table)


class _Point:
    __slots__ = ("x", "y")

    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y


def reference_loop_ms(cache_dir: Path | None = None) -> float:
    """This machine's time of the reference loop of interpreter work (the fastest of 15, ms, in
    the thread's CPU time; cached as the dispatch probe is): how fast its interpreter is, to scale
    to a preset's host.

    Note: CPU time, not the wall clock, because the figure is cached for good: a wall-clock
    reading taken while the machine was busy (10.5 ms here, against 6.4 ms idle) scaled every
    later run's host work by that moment's load."""
    return _cached("reference_cpu_ms", cache_dir, lambda: measure_reference_loop_ms(cpu=True), 1e-3, 1e4)


def measure_reference_loop_ms(cpu: bool = False) -> float:
    """The fastest of 15 timings of the reference loop, in ms, measured now (``benchmarks/
    machine.py`` prints it beside every benchmark figure, on the wall clock, so that a busy
    machine shows). The fastest, as ``timeit`` advises: slower ones measure other processes, not
    this machine's speed. ``cpu``: in the thread's CPU time (what a recorded host keeps, and the
    cached :func:`reference_loop_ms`)."""
    timer = time.thread_time if cpu else REAL.perf_counter
    _reference_work(5_000)
    times = []
    for _ in range(15):
        t0 = timer()
        _reference_work()
        times.append(timer() - t0)
    return 1e3 * min(times)


def _cached(what: str, cache_dir: Path | None, measure: Callable[[], float], low: float, high: float) -> float:
    key = f"{_machine_key()}|{what}"
    path = cache_dir / "host-probe.json" if cache_dir is not None else None
    value = _MEMO.get(key)
    if value is not None and path is None:
        return value
    stored = _read_cache(path)
    if value is None:
        value = stored.get(key)
        if not isinstance(value, float) or not low < value < high:
            value = measure()
    if stored.get(key) != value:  # (measured now, or by this process for another cache folder)
        stored[key] = value
        _write_cache(path, stored)
    _MEMO[key] = value
    return value


def probe_dispatch_seconds(cache_dir: Path | None = None) -> float:
    """Eager PyTorch's host seconds per op on this machine (the CPU build): the lower quartile of
    seven rounds of a small training-shaped op mix (a convolution, batch norm, ReLU, addition and
    a linear layer on tiny tensors whose weights require gradients), so the kernels' own work is
    negligible; in the thread's CPU time, so that a loaded host measures what an idle one does
    (a wall-clock probe at load 9 read 5 ms per op, and was kept). Measured once per machine and
    torch version (~50 ms) and cached in ``cache_dir/host-probe.json``."""
    return _cached("dispatch_s", cache_dir, _measure, 0.0, 1e-3)


def _measure() -> float:
    import torch
    from torch.nn import functional as F

    with torch.inference_mode(False):
        x = torch.ones(1, 4, 4, 4)
        w = torch.ones(4, 4, 3, 3, requires_grad=True)
        g = torch.ones(4, requires_grad=True)
        lw = torch.ones(4, 16, requires_grad=True)

        def mix() -> None:  # five ops
            y = F.conv2d(x, w, padding=1)
            y = F.batch_norm(y, None, None, g, g, training=True)
            y = F.relu(y) + y
            F.linear(y.view(4, 16), lw)

        for _ in range(50):
            mix()
        rounds = []
        for _ in range(7):
            t = time.thread_time()  # (CPU time: on a busy host, waiting for a core is no dispatch work)
            for _ in range(40):
                mix()
            rounds.append((time.thread_time() - t) / 200)
    rounds.sort()
    return rounds[1]


def _read_cache(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path | None, data: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # (an unwritable cache: measured again next time)

"""The ``torch.cuda`` / ``torch.accelerator`` / ``torch.backends`` surface (component ``gpemu.cuda_api``).

On the CPU build of torch these functions return 0/False, assert "not compiled with CUDA", or do
not exist. :class:`CudaSurface` answers them for the emulated GPUs of one run: each of its public
methods carries the name of the torch function it stands for, and :data:`SURFACE` says which
torch module attribute each replaces. :func:`install` applies that table through the run's
patcher (so ``gpemu.unpatch()`` restores every original); because several ``torch.cuda``
submodules import functions by name (``from . import current_device``), every module-level
reference to a replaced original under ``torch`` is replaced too.

* devices: availability, count, current device (per thread, like CUDA), names, properties with
  the GPU model's real compute capability, ``torch.cuda.device`` contexts;
* streams and events: the time engine's (``torch.cuda.Stream``/``Event`` are subclasses bound to
  this run);
* memory statistics from the per-device trackers (``rt.memory``);
* seeding and RNG state per emulated device (no ``default_generators`` exist on the CPU build,
  so torch's lazy seed callbacks must never run);
* cuDNN flags and availability.
"""

from __future__ import annotations

import collections
import random
import struct
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .costmodel.gpus import compute_capability
from .devices import cuda_index
from .time import EmuEvent, VirtualStream
from .units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .memory import MemoryTracker
    from .runtime import Runtime

__all__ = ["install", "CudaSurface", "EmuDeviceProperties", "compute_capability", "SURFACE"]

_CUDNN_VERSION = 91002  # cuDNN shipped with CUDA builds of torch 2.x (reported by cudnn.version())


@dataclass(frozen=True)
class EmuDeviceProperties:
    """Shaped like ``torch._C._CudaDeviceProperties`` (the fields scripts read)."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    max_threads_per_multi_processor: int = 2048
    warp_size: int = 32
    regs_per_multiprocessor: int = 65536
    shared_memory_per_block: int = 49152
    shared_memory_per_multiprocessor: int = 98304
    L2_cache_size: int = 6 * 1024 * 1024
    uuid: str = ""
    pci_bus_id: int = 0
    pci_device_id: int = 0
    pci_domain_id: int = 0
    gcnArchName: str = "NVIDIA CUDA"

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // (1024 * 1024)}MB, "
            f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
            f"L2_cache_size={self.L2_cache_size // (1024 * 1024)}MB)"
        )


def _properties(spec: Any, index: int) -> EmuDeviceProperties:
    major, minor = compute_capability(spec)
    name = getattr(spec, "full_name", None) or getattr(spec, "name", "GPU")
    l2 = getattr(spec, "l2_cache_bytes", None) or (40 if major >= 8 else 6) * 1024 * 1024
    return EmuDeviceProperties(
        name=str(name),
        major=major,
        minor=minor,
        total_memory=int(spec.memory_bytes),
        multi_processor_count=int(getattr(spec, "sm_count", 0) or 0),
        L2_cache_size=int(l2),
        uuid=f"GPU-e0e0e0e0-{index:04x}-4000-8000-{zlib.crc32(str(name).encode()):012x}",
        pci_bus_id=index,
    )


_ACCELERATOR_DTYPES = frozenset(
    (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
        torch.bfloat16,
    )
)
_SYNC_DEBUG_MODES = {"default": 0, "warn": 1, "error": 2}


class CudaSurface:
    """``torch.cuda`` and friends for the emulated GPUs of one run (``rt.cuda``).

    Every public method is named after the torch function it replaces (see :data:`SURFACE`) and
    behaves as that function does on a machine with these GPUs; it can be called directly on an
    instance (tests do) without patching anything."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.initialized = False
        self._lock = threading.Lock()
        # Callbacks queued through torch.cuda._lazy_call after patching: run at (emulated) init.
        # torch's own queue (from before patching) targets real CUDA and is left alone.
        self._queued: list[Callable[[], Any]] = []
        self._seeds = [torch.initial_seed()] * rt.num_devices
        self._offsets = [0] * rt.num_devices
        self._properties = [_properties(spec, i) for i, spec in enumerate(rt.gpus)]
        self._capabilities = [compute_capability(spec) for spec in rt.gpus]
        self._sync_debug_mode = 0
        self._nvtx = threading.local()
        self.Stream, self.Event, self.StreamContext = _bound_classes(self)
        self.device_index_context = _accelerator_device_index(self)

    # ------------------------------------------------------------ reading device arguments
    def device_index(self, device: Any = None, optional: bool = True) -> int:
        """torch.cuda-style device argument -> validated emulated device index.

        Accepts None (current device), ints, 'cuda'/'cuda:N' strings, torch.device, and
        torch.cuda.device contexts. Negative ints are returned as-is (torch treats them as no-ops).
        """
        rt = self.rt
        if device is None:
            if not optional:
                raise ValueError("Expected a torch.device with a specified index or an integer, but got: None")
            return rt.current_device
        if isinstance(device, int) and not isinstance(device, bool) and device < 0:
            return device
        try:
            index = cuda_index(device, rt.current_device)
        except ValueError as exc:
            raise ValueError(f"Expected a cuda device (int, 'cuda:N' or torch.device), but got: {device!r}") from exc
        if index is None:
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return rt.check_device(index)

    def _memory(self, device: Any = None) -> MemoryTracker:
        return self.rt.memory[self.device_index(device)]

    # ------------------------------------------------------------ initialisation / lazy calls
    def is_initialized(self) -> bool:
        return self.initialized

    def _lazy_init(self) -> None:
        # Real CUDA runs queued callbacks here; they touch default_generators and C functions
        # that do not exist on the CPU build, so the emulator only records "initialised".
        if self.initialized:
            return
        with self._lock:
            if self.initialized:
                return
            self.rt.patcher.replace(torch.cuda, "_initialized", True)
            self.initialized = True
            queued, self._queued = self._queued, []
        for call in queued:
            self._run_queued(call)

    def init(self) -> None:
        self._lazy_init()

    def _lazy_call(self, callable: Callable[[], Any], **kwargs: Any) -> None:
        if kwargs.get("seed") or kwargs.get("seed_all"):
            return  # seeding is handled by the emulated seed functions below
        if self.initialized:
            self._run_queued(callable)
        else:
            with self._lock:
                self._queued.append(callable)

    def _run_queued(self, callable: Callable[[], Any]) -> None:
        try:
            callable()
        except Exception:  # a real-CUDA callback (C functions absent): nothing to emulate
            if self.rt.config.debug:
                self.rt.say_once(f"skipped a lazy CUDA callback {getattr(callable, '__name__', callable)!r}")

    # ------------------------------------------------------------ devices
    def is_available(self) -> bool:
        return self.rt.num_devices > 0

    def device_count(self) -> int:
        return self.rt.num_devices

    def current_device(self) -> int:
        self._lazy_init()
        return self.rt.current_device

    def set_device(self, device: Any) -> None:
        i = self.device_index(device, optional=False)
        if i >= 0:
            self._lazy_init()
            self.rt.current_device = i

    def _exchange_device(self, device: int) -> int:
        if device < 0:
            return -1
        previous = self.rt.current_device
        self.rt.current_device = self.rt.check_device(device)
        self._lazy_init()
        return previous

    def _maybe_exchange_device(self, device: int) -> int:
        if device < 0:
            return -1
        previous = self.rt.current_device
        self.rt.current_device = self.rt.check_device(device)
        return previous

    def get_device_name(self, device: Any = None) -> str:
        return self.get_device_properties(device).name

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        p = self.get_device_properties(device)
        return (p.major, p.minor)

    def get_device_properties(self, device: Any = None) -> EmuDeviceProperties:
        self._lazy_init()
        i = self.device_index(device)
        if i < 0:
            raise AssertionError("Invalid device id")
        return self._properties[i]

    def can_device_access_peer(self, device: Any, peer_device: Any) -> bool:
        return self.device_index(device) != self.device_index(peer_device)

    def get_arch_list(self) -> list[str]:
        return ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100"]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return self._capabilities[self.rt.current_device] >= (8, 0) or bool(including_emulation)

    def is_tf32_supported(self) -> bool:
        return self._capabilities[self.rt.current_device] >= (8, 0)

    def synchronize(self, device: Any = None) -> None:
        self._lazy_init()
        self.rt.engine.synchronize(self.device_index(device), "torch.cuda.synchronize")

    def ipc_collect(self) -> None:
        self._lazy_init()

    def utilization(self, device: Any = None) -> int:
        """Percent of the last second the device's GPU was busy (what nvidia-smi samples)."""
        i = self.device_index(device)
        rt = self.rt
        now = rt.engine.now()
        window_start = now - 1.0
        busy = []
        for span in reversed(rt.recorder.spans):  # newest last: stop once spans are older
            if span.end <= window_start and span.start <= window_start:
                if span.device == i:
                    break
                continue
            if span.device == i:
                busy.append((max(span.start, window_start), min(span.end, now)))
        busy.sort()
        total, cursor = 0.0, window_start
        for start, end in busy:  # union of intervals: overlapping streams count once
            start = max(start, cursor)
            if end > start:
                total += end - start
                cursor = end
        return int(round(100 * min(total, 1.0)))

    def device_memory_used(self, device: Any = None) -> int:
        return self.memory_reserved(device)

    def set_sync_debug_mode(self, debug_mode: int | str) -> None:
        if isinstance(debug_mode, str):
            if debug_mode not in _SYNC_DEBUG_MODES:
                raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
            debug_mode = _SYNC_DEBUG_MODES[debug_mode]
        self._sync_debug_mode = int(debug_mode)

    def get_sync_debug_mode(self) -> int:
        return self._sync_debug_mode

    # ------------------------------------------------------------ streams and events
    def current_stream(self, device: Any = None) -> VirtualStream:
        self._lazy_init()
        return self.rt.engine.stream(self.device_index(device))

    def default_stream(self, device: Any = None) -> VirtualStream:
        self._lazy_init()
        return self.rt.engine.default_stream(self.device_index(device))

    def set_stream(self, stream: Any) -> None:
        if stream is None:
            return
        self.rt.engine.set_stream(stream)

    def stream(self, stream: Any) -> Any:
        """``with torch.cuda.stream(s):`` (a no-op for None)."""
        return self.StreamContext(stream)

    def is_current_stream_capturing(self) -> bool:
        """Whether a CUDA graph capture is under way on the current stream (:mod:`gpemu.graphs`)."""
        return self.rt.engine.capture_here(self.rt.current_device) is not None

    # ------------------------------------------------------------ memory statistics
    def memory_allocated(self, device: Any = None) -> int:
        return int(self._memory(device).allocated)

    def max_memory_allocated(self, device: Any = None) -> int:
        return int(self._memory(device).peak_allocated)

    def memory_reserved(self, device: Any = None) -> int:
        return int(self._memory(device).reserved)

    def max_memory_reserved(self, device: Any = None) -> int:
        return int(self._memory(device).peak_reserved)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._memory(device).reset_peak()

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        self._memory(device).reset_accumulated()

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._lazy_init()
        i = self.device_index(device)
        m = self.rt.memory[i]
        total = int(self.rt.gpus[i].memory_bytes)
        # Free memory as CUDA reports it: the card's total minus what this process reserved
        # (the tracker's capacity may be smaller than the card: CUDA context, fractions).
        return max(0, min(int(m.capacity), total) - int(m.reserved)), total

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        m = self._memory(device)
        stats: dict[str, Any] = dict(m.stats())
        for pool in ("all", "large_pool", "small_pool"):
            scale = 1 if pool == "all" else 0  # no pool split: totals under "all"
            stats[f"requested_bytes.{pool}.current"] = int(m.allocated) * scale
            stats[f"requested_bytes.{pool}.peak"] = int(m.peak_allocated) * scale
        return collections.OrderedDict(sorted(stats.items()))

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        i = self.device_index(device)
        rows = [
            ("Allocated memory", self.memory_allocated(i), self.max_memory_allocated(i)),
            ("Reserved memory", self.memory_reserved(i), self.max_memory_reserved(i)),
        ]
        free, total = self.mem_get_info(i)
        title = f"PyTorch CUDA memory summary, device ID {i} (gpemu: emulated {self._properties[i].name})"
        lines = [
            "|" + "=" * 75 + "|",
            f"|{title:^75}|",
            "|" + "-" * 75 + "|",
            f"| {'Metric':<35}| {'Cur Usage':>17} | {'Peak Usage':>17} |",
            "|" + "-" * 75 + "|",
        ]
        for label, cur, peak in rows:
            lines.append(f"| {label:<35}| {format_bytes(cur):>17} | {format_bytes(peak):>17} |")
        lines.append("|" + "-" * 75 + "|")
        lines.append(f"| {'Device total / free':<35}| {format_bytes(total):>17} | {format_bytes(free):>17} |")
        lines.append("|" + "=" * 75 + "|")
        return "\n".join(lines) + "\n"

    def empty_cache(self) -> None:
        for m in self.rt.memory:
            m.empty_cache()

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self._memory(device).set_fraction(fraction)

    # ------------------------------------------------------------ seeding / RNG state
    def manual_seed(self, seed: int) -> None:
        i = self.rt.current_device
        self._seeds[i] = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        self._offsets[i] = 0

    def manual_seed_all(self, seed: int) -> None:
        for i in range(self.rt.num_devices):
            self._seeds[i] = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
            self._offsets[i] = 0

    def seed(self) -> None:
        self.manual_seed(random.SystemRandom().getrandbits(63))

    def seed_all(self) -> None:
        self.manual_seed_all(random.SystemRandom().getrandbits(63))

    def initial_seed(self) -> int:
        self._lazy_init()
        return self._seeds[self.rt.current_device]

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        i = self.device_index(device)
        # CUDA's Philox generator state: 8-byte seed + 8-byte offset, as a CPU uint8 tensor.
        raw = struct.pack("<QQ", self._seeds[i], self._offsets[i])
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.rt.num_devices)]

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        i = self.device_index(device)
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8 or new_state.numel() != 16:
            raise ValueError(
                "RNG state must be a torch.ByteTensor of 16 bytes (as returned by torch.cuda.get_rng_state())"
            )
        seed_value, offset = struct.unpack("<QQ", bytes(new_state.cpu().contiguous().numpy().tobytes()))
        self._seeds[i], self._offsets[i] = seed_value, offset

    def set_rng_state_all(self, new_states: Iterable[torch.Tensor]) -> None:
        for i, s in enumerate(new_states):
            self.set_rng_state(s, i)

    # ------------------------------------------------------------ NVTX (no-op ranges)
    def range_push(self, msg: str) -> int:
        self._nvtx.depth = getattr(self._nvtx, "depth", 0) + 1
        return self._nvtx.depth - 1

    def range_pop(self) -> int:
        depth = getattr(self._nvtx, "depth", 0)
        if depth == 0:
            return -1
        self._nvtx.depth = depth - 1
        return depth - 1

    def mark(self, msg: str) -> None:
        return None

    # ------------------------------------------------------------ torch.accelerator
    def current_accelerator(self, check_available: bool = False) -> torch.device:
        return torch.device("cuda")

    def accelerator_device_capability(self, device: Any = None) -> dict[str, Any]:
        """``torch.accelerator.get_device_capability``: the dtypes the device supports."""
        self.get_device_properties(device)  # validates the device
        return {"supported_dtypes": set(_ACCELERATOR_DTYPES)}

    def empty_host_cache(self) -> None:
        """``torch.accelerator.memory.empty_host_cache``: the pinned pool is kept (as CUDA's)."""

    # ------------------------------------------------------------ torch.backends
    def cudnn_is_available(self) -> bool:
        return True

    def cudnn_version(self) -> int:
        return _CUDNN_VERSION

    def cudnn_is_acceptable(self, tensor: torch.Tensor) -> bool:
        # nn.RNN/LSTM/GRU ask before flattening weights for cuDNN; the real check loads libcudnn
        # and warns "library not found". "Not acceptable" takes the plain path silently
        # (weights stay as they are; there is no data to flatten anyway).
        return False

    def is_built(self) -> bool:
        return True


def _bound_classes(surface: CudaSurface) -> tuple[type, type, type]:
    """``torch.cuda.Stream``, ``Event`` and ``StreamContext`` of one run: subclasses of the time
    engine's classes whose constructors read device arguments like torch and use this run."""

    class Stream(VirtualStream):
        """``torch.cuda.Stream(device=None, priority=0)`` on an emulated GPU."""

        __slots__ = ()

        def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            if kwargs:
                raise TypeError(
                    f"gpemu streams do not support {', '.join(sorted(kwargs))} "
                    "(external/foreign CUDA streams cannot exist in emulation)"
                )
            engine = surface.rt.engine
            index = surface.device_index(device)
            VirtualStream.__init__(self, engine, index, priority, engine.next_stream_id(index))

    class Event(EmuEvent):
        """``torch.cuda.Event(enable_timing=False, blocking=False, interprocess=False)``."""

        def __init__(
            self,
            enable_timing: bool = False,
            blocking: bool = False,
            interprocess: bool = False,
            external: bool = False,
        ) -> None:
            super().__init__(surface.rt.engine, enable_timing, blocking, interprocess, external)

    class StreamContext:
        """``with torch.cuda.stream(s):`` makes ``s`` current on its device for this thread."""

        def __init__(self, stream: Any) -> None:
            self.stream = stream
            self._previous: VirtualStream | None = None

        def __enter__(self) -> Any:
            if self.stream is not None:
                self._previous = surface.rt.engine.set_stream(self.stream)
            return self.stream

        def __exit__(self, *exc: Any) -> None:
            if self.stream is not None and self._previous is not None:
                surface.rt.engine.set_stream(self._previous)

    for cls in (Stream, Event, StreamContext):
        cls.__module__ = "torch.cuda"
    return Stream, Event, StreamContext


def _accelerator_device_index(surface: CudaSurface) -> type:
    class device_index:
        """``with torch.accelerator.device_index(i):`` on the emulated devices."""

        def __init__(self, device: int | None, /) -> None:
            self.idx = device
            self.prev_idx = -1

        def __enter__(self) -> None:
            if self.idx is not None:
                self.prev_idx = surface._exchange_device(self.idx)

        def __exit__(self, *exc_info: object) -> None:
            if self.idx is not None:
                surface._maybe_exchange_device(self.prev_idx)

    return device_index


# torch attribute -> CudaSurface attribute, per torch module (a bare name: the same on both sides).
SURFACE: dict[str, tuple[str | tuple[str, str], ...]] = {
    "torch.cuda": (
        "is_initialized",
        "_lazy_init",
        "init",
        "_lazy_call",
        "is_available",
        "device_count",
        "current_device",
        "set_device",
        "_exchange_device",
        "_maybe_exchange_device",
        "get_device_name",
        "get_device_capability",
        "get_device_properties",
        "can_device_access_peer",
        "get_arch_list",
        "is_bf16_supported",
        "is_tf32_supported",
        "synchronize",
        "ipc_collect",
        "utilization",
        "device_memory_used",
        "set_sync_debug_mode",
        "get_sync_debug_mode",
        "Stream",
        "Event",
        "StreamContext",
        "current_stream",
        "default_stream",
        "set_stream",
        "stream",
        "is_current_stream_capturing",
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
        ("memory_cached", "memory_reserved"),
        ("max_memory_cached", "max_memory_reserved"),
        "reset_peak_memory_stats",
        ("reset_max_memory_allocated", "reset_peak_memory_stats"),
        ("reset_max_memory_cached", "reset_peak_memory_stats"),
        "reset_accumulated_memory_stats",
        "mem_get_info",
        "memory_stats",
        "memory_summary",
        "empty_cache",
        "set_per_process_memory_fraction",
        "manual_seed",
        "manual_seed_all",
        "seed",
        "seed_all",
        "initial_seed",
        "get_rng_state",
        "get_rng_state_all",
        "set_rng_state",
        "set_rng_state_all",
    ),
    "torch.cuda.nvtx": ("range_push", "range_pop", "mark"),
    "torch.accelerator": (
        "current_accelerator",
        ("current_device_index", "current_device"),
        ("current_device_idx", "current_device"),
        ("set_device_index", "set_device"),
        ("set_device_idx", "set_device"),
        "current_stream",
        "set_stream",
        "synchronize",
        ("get_device_capability", "accelerator_device_capability"),
        ("device_index", "device_index_context"),
        "empty_cache",
        ("get_memory_info", "mem_get_info"),
        "memory_stats",
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
        "reset_peak_memory_stats",
        "reset_accumulated_memory_stats",
    ),
    "torch.accelerator.memory": ("empty_host_cache",),
    # torch.backends.cudnn is a PropModule forwarding to the real module in ``.m``: that one is
    # patched, so nothing is left in the wrapper's own __dict__ after unpatching.
    "torch.backends.cudnn": (
        ("is_available", "cudnn_is_available"),
        ("version", "cudnn_version"),
        ("is_acceptable", "cudnn_is_acceptable"),
    ),
    "torch.backends.cuda": ("is_built",),
}


def _module(name: str) -> Any:
    obj: Any = torch
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    return getattr(obj, "m", obj) if name == "torch.backends.cudnn" else obj


def install(rt: Runtime) -> None:
    """Make the run's surface (``rt.cuda``) and apply :data:`SURFACE` through ``rt.patcher``."""
    surface = rt.cuda = CudaSurface(rt)
    rt.engine.set_stream_type(surface.Stream)
    replacements: list[tuple[Any, Any]] = []
    for module_name, entries in SURFACE.items():
        module = _module(module_name)
        for entry in entries:
            torch_name, ours = (entry, entry) if isinstance(entry, str) else entry
            new = getattr(surface, ours)
            original = getattr(module, torch_name, None)
            rt.patcher.replace(module, torch_name, new)
            if original is not None and not isinstance(original, (bool, int, float, str)):
                replacements.append((original, new))
    # One pass over torch's modules: swap every by-name copy of a replaced original.
    rt.patcher.replace_everywhere_many(replacements)

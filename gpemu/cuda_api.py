"""The ``torch.cuda`` / ``torch.accelerator`` / ``torch.backends`` surface (component ``gpemu.cuda_api``).

On the CPU build of torch these functions return 0/False, assert "not compiled with CUDA", or do
not exist. This component replaces them (through ``rt.patcher``, so ``gpemu.unpatch()`` restores
every original) with versions answering for the emulated GPUs of the run:

* devices: availability, count, current device (per thread, like CUDA), names, properties with
  the GPU model's real compute capability, ``torch.cuda.device`` contexts;
* streams and events: the time engine's classes installed as ``torch.cuda.Stream``/``Event``;
* memory statistics from the device engineer's per-device trackers (``rt.state["memory"]``);
* seeding and RNG state per emulated device (no ``default_generators`` exist on the CPU build,
  so torch's lazy seed callbacks must never run);
* cuDNN / TF32 flags, and ``GradScaler`` that stays enabled and keeps its scale on the host.

Several ``torch.cuda`` submodules import functions by name (``from . import current_device``),
so each replacement is applied to every module-level reference under ``torch``.
"""

from __future__ import annotations

import collections
import struct
import sys
import threading
import zlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "EmuDeviceProperties", "compute_capability", "device_index"]

# Real compute capabilities of the GPU models gpemu emulates (name fragment -> (major, minor)).
# Longer fragments first so "RTX 6000" does not match "A6000" rules etc.
_CAPABILITY: tuple[tuple[str, tuple[int, int]], ...] = (
    ("H200", (9, 0)), ("H100", (9, 0)), ("L40", (8, 9)), ("L4", (8, 9)), ("A100", (8, 0)),
    ("A6000", (8, 6)), ("A40", (8, 6)), ("A30", (8, 0)), ("A10", (8, 6)), ("RTX6000", (7, 5)),
    ("RTX 6000", (7, 5)), ("T4", (7, 5)), ("V100", (7, 0)), ("P100", (6, 0)), ("P40", (6, 1)),
    ("M40", (5, 2)), ("K80", (3, 7)),
)
_CUDNN_VERSION = 91002  # cuDNN shipped with CUDA builds of torch 2.x (reported by cudnn.version())


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
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1024 * 1024)}MB, "
                f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
                f"L2_cache_size={self.L2_cache_size // (1024 * 1024)}MB)")


def device_index(rt: "Runtime", device: Any = None, optional: bool = True) -> int:
    """torch.cuda-style device argument -> validated emulated device index.

    Accepts None (current device), ints, 'cuda'/'cuda:N' strings, torch.device, and
    torch.cuda.device contexts. Negative ints are returned as-is (torch treats them as no-ops).
    """
    if device is None:
        if not optional:
            raise ValueError("Expected a torch.device with a specified index or an integer, but got: None")
        return rt.current_device
    if isinstance(device, bool):
        raise ValueError(f"Expected a cuda device index, got {device!r}")
    if isinstance(device, int):
        return device if device < 0 else rt.check_device(device)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"Expected a cuda device such as 'cuda' or 'cuda:0', got {device!r}") from exc
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        if device.index is None:
            return rt.current_device
        return rt.check_device(device.index)
    idx = getattr(device, "idx", None)  # torch.cuda.device context object
    if isinstance(idx, int):
        return idx
    raise ValueError(f"Expected a cuda device (int, 'cuda:N' or torch.device), but got: {device!r}")


class _State:
    """Per-run state of the surface (``rt.state["cuda_api"]``)."""

    def __init__(self, rt: "Runtime", initial_seed: int) -> None:
        self.initialized = False
        self.lock = threading.Lock()
        # Callbacks queued through torch.cuda._lazy_call after patching: run at (emulated) init.
        # torch's own queue (from before patching) targets real CUDA and is left alone.
        self.queued: list[Callable[[], Any]] = []
        self.seeds = [initial_seed] * rt.num_devices
        self.offsets = [0] * rt.num_devices
        self.properties = [_properties(spec, i) for i, spec in enumerate(rt.gpus)]
        self.capabilities = [compute_capability(spec) for spec in rt.gpus]


def _properties(spec: Any, index: int) -> EmuDeviceProperties:
    major, minor = compute_capability(spec)
    name = getattr(spec, "full_name", None) or getattr(spec, "name", "GPU")
    l2 = getattr(spec, "l2_cache_bytes", None) or (40 if major >= 8 else 6) * 1024 * 1024
    return EmuDeviceProperties(
        name=str(name), major=major, minor=minor, total_memory=int(spec.memory_bytes),
        multi_processor_count=int(getattr(spec, "sm_count", 0) or 0), L2_cache_size=int(l2),
        uuid=f"GPU-e0e0e0e0-{index:04x}-4000-8000-{zlib.crc32(str(name).encode()):012x}", pci_bus_id=index,
    )


# --------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------
def install(rt: "Runtime") -> None:
    state = _State(rt, torch.initial_seed())
    rt.state["cuda_api"] = state
    replacements: dict[Any, Any] = {}  # original object -> replacement, applied everywhere below
    cuda = torch.cuda

    def on(module: ModuleType, name: str, new: Any) -> None:
        """Replace module.name and every other module-level reference to the same original."""
        original = getattr(module, name, None)
        if original is None or isinstance(original, (bool, int, float, str)):
            rt.patcher.replace(module, name, new)
        else:
            replacements[id(original)] = (original, new)
            rt.patcher.replace(module, name, new)

    def idx(device: Any = None, optional: bool = True) -> int:
        return device_index(rt, device, optional)

    def engine():
        eng = rt.state.get("engine")
        if eng is None:
            raise RuntimeError("gpemu: the time engine (gpemu.engine) is not installed")
        return eng

    def memory(device: Any = None):
        trackers = rt.state.get("memory")
        i = idx(device)
        if trackers is None:
            return None
        return trackers[i]

    # ------------------------------------------------------------ initialisation / lazy calls
    def is_initialized() -> bool:
        return state.initialized

    def lazy_init() -> None:
        # Real CUDA runs queued callbacks here; they touch default_generators and C functions
        # that do not exist on the CPU build, so the emulator only records "initialised".
        if not state.initialized:
            with state.lock:
                if state.initialized:
                    return
                rt.patcher.replace(cuda, "_initialized", True)
                state.initialized = True
                queued, state.queued = state.queued, []
            for call in queued:
                run_queued(call)

    def lazy_call(callable: Callable[[], Any], **kwargs: Any) -> None:
        if kwargs.get("seed") or kwargs.get("seed_all"):
            return  # seeding is handled by the emulated seed functions below
        if state.initialized:
            run_queued(callable)
        else:
            with state.lock:
                state.queued.append(callable)

    def run_queued(callable: Callable[[], Any]) -> None:
        try:
            callable()
        except Exception:  # a real-CUDA callback (C functions absent): nothing to emulate
            if rt.config.debug:
                rt.say_once(f"skipped a lazy CUDA callback {getattr(callable, '__name__', callable)!r}")

    for name, fn in (("is_initialized", is_initialized), ("_lazy_init", lazy_init), ("init", lazy_init),
                     ("_lazy_call", lazy_call)):
        on(cuda, name, fn)

    # ------------------------------------------------------------ devices
    def is_available() -> bool:
        return rt.num_devices > 0

    def device_count() -> int:
        return rt.num_devices

    def current_device() -> int:
        lazy_init()
        return rt.current_device

    def set_device(device: Any) -> None:
        i = idx(device, optional=False)
        if i >= 0:
            lazy_init()
            rt.current_device = i

    def exchange_device(device: int) -> int:
        if device < 0:
            return -1
        previous = rt.current_device
        rt.current_device = rt.check_device(device)
        lazy_init()
        return previous

    def maybe_exchange_device(device: int) -> int:
        if device < 0:
            return -1
        previous = rt.current_device
        rt.current_device = rt.check_device(device)
        return previous

    def get_device_name(device: Any = None) -> str:
        return get_device_properties(device).name

    def get_device_capability(device: Any = None) -> tuple[int, int]:
        p = get_device_properties(device)
        return (p.major, p.minor)

    def get_device_properties(device: Any = None) -> EmuDeviceProperties:
        lazy_init()
        i = idx(device)
        if i < 0:
            raise AssertionError("Invalid device id")
        return state.properties[i]

    def can_device_access_peer(device: Any, peer_device: Any) -> bool:
        return idx(device) != idx(peer_device)

    def get_arch_list() -> list[str]:
        return ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return state.capabilities[rt.current_device] >= (8, 0) or bool(including_emulation)

    def is_tf32_supported() -> bool:
        return state.capabilities[rt.current_device] >= (8, 0)

    def synchronize(device: Any = None) -> None:
        lazy_init()
        engine().synchronize(idx(device), "torch.cuda.synchronize")

    def ipc_collect() -> None:
        lazy_init()

    def utilization(device: Any = None) -> int:
        """Percent of the last second the device's GPU was busy (what nvidia-smi samples)."""
        i = idx(device)
        eng = rt.state.get("engine")
        now = eng.now() if eng is not None else 0.0
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

    def device_memory_used(device: Any = None) -> int:
        return memory_reserved(device)

    sync_debug = {"mode": 0}

    def set_sync_debug_mode(debug_mode: int | str) -> None:
        modes = {"default": 0, "warn": 1, "error": 2}
        if isinstance(debug_mode, str):
            if debug_mode not in modes:
                raise RuntimeError('invalid value of debug_mode, expected one of `default`, `warn`, `error`')
            debug_mode = modes[debug_mode]
        sync_debug["mode"] = int(debug_mode)

    def get_sync_debug_mode() -> int:
        return sync_debug["mode"]

    for name, fn in (
        ("is_available", is_available), ("device_count", device_count), ("current_device", current_device),
        ("set_device", set_device), ("_exchange_device", exchange_device),
        ("_maybe_exchange_device", maybe_exchange_device), ("get_device_name", get_device_name),
        ("get_device_capability", get_device_capability), ("get_device_properties", get_device_properties),
        ("can_device_access_peer", can_device_access_peer), ("get_arch_list", get_arch_list),
        ("is_bf16_supported", is_bf16_supported), ("is_tf32_supported", is_tf32_supported),
        ("synchronize", synchronize), ("ipc_collect", ipc_collect),
        ("set_sync_debug_mode", set_sync_debug_mode), ("get_sync_debug_mode", get_sync_debug_mode),
        ("utilization", utilization),
    ):
        on(cuda, name, fn)

    # ------------------------------------------------------------ streams and events
    from . import engine as engine_module

    stream_cls = engine_module.Stream  # has is_capturing() (False): Adam/AdamW ask for it

    def current_stream(device: Any = None):
        lazy_init()
        return engine().stream(idx(device))

    def default_stream(device: Any = None):
        lazy_init()
        return engine().default_stream(idx(device))

    def set_stream(stream: Any) -> None:
        if stream is None:
            return
        engine().set_stream(stream)

    class StreamContext:
        """``with torch.cuda.stream(s):`` makes ``s`` current on its device for this thread."""

        def __init__(self, stream: Any) -> None:
            self.stream = stream
            self._previous = None

        def __enter__(self) -> Any:
            if self.stream is not None:
                self._previous = engine().set_stream(self.stream)
            return self.stream

        def __exit__(self, *exc: Any) -> bool:
            if self.stream is not None and self._previous is not None:
                engine().set_stream(self._previous)
            return False

    def stream(stream: Any) -> StreamContext:
        return StreamContext(stream)

    def is_current_stream_capturing() -> bool:
        return False

    for name, fn in (
        ("Stream", stream_cls), ("Event", engine_module.Event), ("current_stream", current_stream),
        ("default_stream", default_stream), ("set_stream", set_stream), ("StreamContext", StreamContext),
        ("stream", stream), ("is_current_stream_capturing", is_current_stream_capturing),
    ):
        on(cuda, name, fn)

    # ------------------------------------------------------------ memory statistics
    def memory_allocated(device: Any = None) -> int:
        m = memory(device)
        return int(m.allocated) if m is not None else 0

    def max_memory_allocated(device: Any = None) -> int:
        m = memory(device)
        return int(m.peak_allocated) if m is not None else 0

    def memory_reserved(device: Any = None) -> int:
        m = memory(device)
        return int(m.reserved) if m is not None else 0

    def max_memory_reserved(device: Any = None) -> int:
        m = memory(device)
        if m is None:
            return 0
        return int(getattr(m, "peak_reserved", m.reserved))

    def reset_peak_memory_stats(device: Any = None) -> None:
        m = memory(device)
        if m is not None:
            m.reset_peak()

    def reset_accumulated_memory_stats(device: Any = None) -> None:
        m = memory(device)
        if m is not None and hasattr(m, "reset_accumulated"):
            m.reset_accumulated()

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        lazy_init()
        i = idx(device)
        total = int(rt.gpus[i].memory_bytes)
        m = memory(i)
        capacity = int(getattr(m, "capacity", total)) if m is not None else total
        used = memory_reserved(i)
        # Free memory as CUDA reports it: the card's total minus what this process reserved
        # (the tracker's capacity may be smaller than the card: CUDA context, fractions).
        return max(0, min(capacity, total) - used), total

    def memory_stats(device: Any = None) -> dict[str, Any]:
        m = memory(device)
        stats: dict[str, Any] = collections.OrderedDict()
        if m is None:
            return stats
        if hasattr(m, "stats"):  # the tracker's own torch-named counters
            stats.update(m.stats())
        values = {
            "allocated_bytes": (m.allocated, m.peak_allocated),
            "reserved_bytes": (m.reserved, getattr(m, "peak_reserved", m.reserved)),
            "active_bytes": (m.allocated, m.peak_allocated),
            "requested_bytes": (m.allocated, m.peak_allocated),
        }
        for key, (current, peak) in values.items():
            for pool in ("all", "large_pool", "small_pool"):
                scale = 1 if pool == "all" else 0  # no pool split: totals under "all"
                stats.setdefault(f"{key}.{pool}.current", int(current) * scale)
                stats.setdefault(f"{key}.{pool}.peak", int(peak) * scale)
        stats.setdefault("num_alloc_retries", int(getattr(m, "num_alloc_retries", 0)))
        stats.setdefault("num_ooms", int(getattr(m, "num_ooms", 0)))
        return collections.OrderedDict(sorted(stats.items()))

    def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
        i = idx(device)
        rows = [("Allocated memory", memory_allocated(i), max_memory_allocated(i)),
                ("Reserved memory", memory_reserved(i), max_memory_reserved(i))]
        free, total = mem_get_info(i)
        lines = ["|" + "=" * 75 + "|",
                 f"|{'PyTorch CUDA memory summary, device ID ' + str(i) + ' (gpemu: emulated ' + state.properties[i].name + ')':^75}|",
                 "|" + "-" * 75 + "|",
                 f"| {'Metric':<35}| {'Cur Usage':>17} | {'Peak Usage':>17} |",
                 "|" + "-" * 75 + "|"]
        for label, cur, peak in rows:
            lines.append(f"| {label:<35}| {_fmt_bytes(cur):>17} | {_fmt_bytes(peak):>17} |")
        lines.append("|" + "-" * 75 + "|")
        lines.append(f"| {'Device total / free':<35}| {_fmt_bytes(total):>17} | {_fmt_bytes(free):>17} |")
        lines.append("|" + "=" * 75 + "|")
        return "\n".join(lines) + "\n"

    def empty_cache() -> None:
        trackers = rt.state.get("memory")
        if trackers:
            for m in trackers:
                if hasattr(m, "empty_cache"):
                    m.empty_cache()

    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        m = memory(device)
        if m is not None and hasattr(m, "set_fraction"):
            m.set_fraction(fraction)

    for name, fn in (
        ("memory_allocated", memory_allocated), ("max_memory_allocated", max_memory_allocated),
        ("memory_reserved", memory_reserved), ("max_memory_reserved", max_memory_reserved),
        ("memory_cached", memory_reserved), ("max_memory_cached", max_memory_reserved),
        ("reset_peak_memory_stats", reset_peak_memory_stats),
        ("reset_max_memory_allocated", reset_peak_memory_stats),
        ("reset_max_memory_cached", reset_peak_memory_stats),
        ("reset_accumulated_memory_stats", reset_accumulated_memory_stats),
        ("mem_get_info", mem_get_info), ("memory_stats", memory_stats), ("memory_summary", memory_summary),
        ("empty_cache", empty_cache), ("set_per_process_memory_fraction", set_per_process_memory_fraction),
        ("device_memory_used", device_memory_used),
    ):
        on(cuda, name, fn)

    # ------------------------------------------------------------ seeding / RNG state
    def manual_seed(seed: int) -> None:
        i = rt.current_device
        state.seeds[i] = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        state.offsets[i] = 0

    def manual_seed_all(seed: int) -> None:
        for i in range(rt.num_devices):
            state.seeds[i] = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
            state.offsets[i] = 0

    def seed() -> None:
        manual_seed(_random_seed())

    def seed_all() -> None:
        manual_seed_all(_random_seed())

    def initial_seed() -> int:
        lazy_init()
        return state.seeds[rt.current_device]

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        i = idx(device)
        # CUDA's Philox generator state: 8-byte seed + 8-byte offset, as a CPU uint8 tensor.
        raw = struct.pack("<QQ", state.seeds[i], state.offsets[i])
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()

    def get_rng_state_all() -> list[torch.Tensor]:
        return [get_rng_state(i) for i in range(rt.num_devices)]

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        i = idx(device)
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8 or new_state.numel() != 16:
            raise ValueError("RNG state must be a torch.ByteTensor of 16 bytes (as returned by "
                             "torch.cuda.get_rng_state())")
        seed_value, offset = struct.unpack("<QQ", bytes(new_state.cpu().contiguous().numpy().tobytes()))
        state.seeds[i], state.offsets[i] = seed_value, offset

    def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
        for i, s in enumerate(new_states):
            set_rng_state(s, i)

    for name, fn in (
        ("manual_seed", manual_seed), ("manual_seed_all", manual_seed_all), ("seed", seed),
        ("seed_all", seed_all), ("initial_seed", initial_seed), ("get_rng_state", get_rng_state),
        ("get_rng_state_all", get_rng_state_all), ("set_rng_state", set_rng_state),
        ("set_rng_state_all", set_rng_state_all),
    ):
        on(cuda, name, fn)

    # ------------------------------------------------------------ NVTX (no-op ranges)
    nvtx_depth = threading.local()

    def range_push(msg: str) -> int:
        nvtx_depth.value = getattr(nvtx_depth, "value", 0) + 1
        return nvtx_depth.value - 1

    def range_pop() -> int:
        depth = getattr(nvtx_depth, "value", 0)
        if depth == 0:
            return -1
        nvtx_depth.value = depth - 1
        return depth - 1

    def mark(msg: str) -> None:
        return None

    for name, fn in (("range_push", range_push), ("range_pop", range_pop), ("mark", mark)):
        on(cuda.nvtx, name, fn)

    # ------------------------------------------------------------ torch.accelerator
    acc = torch.accelerator

    def current_accelerator(check_available: bool = False) -> torch.device:
        return torch.device("cuda")

    def current_device_index() -> int:
        return current_device()

    def set_device_index(device: Any) -> None:
        set_device(device)

    def acc_current_stream(device: Any = None):
        return current_stream(device)

    def acc_synchronize(device: Any = None) -> None:
        synchronize(device)

    def acc_get_device_capability(device: Any = None) -> dict[str, Any]:
        major, _ = get_device_capability(device)
        dtypes = {torch.float32, torch.float64, torch.float16, torch.int8, torch.uint8, torch.int16,
                  torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.bfloat16}
        return {"supported_dtypes": dtypes}

    class accelerator_device_index:
        """``with torch.accelerator.device_index(i):`` on the emulated devices."""

        def __init__(self, device: int | None, /) -> None:
            self.idx = device
            self.prev_idx = -1

        def __enter__(self) -> None:
            if self.idx is not None:
                self.prev_idx = exchange_device(self.idx)

        def __exit__(self, *exc_info: object) -> None:
            if self.idx is not None:
                maybe_exchange_device(self.prev_idx)

    for name, fn in (
        ("current_accelerator", current_accelerator), ("current_device_index", current_device_index),
        ("current_device_idx", current_device_index), ("set_device_index", set_device_index),
        ("set_device_idx", set_device_index), ("current_stream", acc_current_stream),
        ("set_stream", set_stream), ("synchronize", acc_synchronize),
        ("get_device_capability", acc_get_device_capability), ("device_index", accelerator_device_index),
        ("empty_cache", empty_cache),
        ("get_memory_info", mem_get_info), ("memory_stats", memory_stats),
        ("memory_allocated", memory_allocated), ("max_memory_allocated", max_memory_allocated),
        ("memory_reserved", memory_reserved), ("max_memory_reserved", max_memory_reserved),
        ("reset_peak_memory_stats", reset_peak_memory_stats),
        ("reset_accumulated_memory_stats", reset_accumulated_memory_stats),
    ):
        on(acc, name, fn)
    on(acc.memory, "empty_host_cache", lambda: None)

    # ------------------------------------------------------------ torch.backends
    # torch.backends.cudnn is a PropModule forwarding to the real module in ``.m``: patch that
    # one, so nothing is left in the wrapper's own __dict__ after unpatching.
    cudnn = getattr(torch.backends.cudnn, "m", torch.backends.cudnn)
    on(cudnn, "is_available", lambda: True)
    on(cudnn, "version", lambda: _CUDNN_VERSION)
    # nn.RNN/LSTM/GRU ask is_acceptable() before flattening weights for cuDNN; the real check
    # loads libcudnn and warns "library not found". Saying "not acceptable" takes the plain
    # path silently (weights stay as they are; there is no data to flatten anyway).
    on(cudnn, "is_acceptable", lambda tensor: False)
    on(torch.backends.cuda, "is_built", lambda: True)

    # ------------------------------------------------------------ GradScaler
    _install_grad_scaler(rt, engine)

    # One pass over torch's modules: swap every by-name copy of a replaced original.
    _replace_copies(rt, replacements)


def _replace_copies(rt: "Runtime", replacements: dict[int, tuple[Any, Any]]) -> None:
    if not replacements:
        return
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "torch" or mod_name.startswith("torch.")):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, value in items:
            hit = replacements.get(id(value))
            if hit is not None and hit[0] is value and getattr(mod, attr, None) is value:
                rt.patcher.replace(mod, attr, hit[1])


def _random_seed() -> int:
    import random

    return random.SystemRandom().getrandbits(63)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


# --------------------------------------------------------------------------------------------
# GradScaler
# --------------------------------------------------------------------------------------------
class _ScaleMirror:
    """The scaler's scale and growth tracker kept on the host.

    Emulated tensors hold no values, so ``torch._amp_update_scale_`` cannot change the scale;
    with no infs found (placeholders are never inf), the scale grows by ``growth_factor`` every
    ``growth_interval`` steps, exactly as on a GPU when training is healthy.
    """

    __slots__ = ("scale", "growth")

    def __init__(self, scale: float, growth: int = 0) -> None:
        self.scale = float(scale)
        self.growth = int(growth)


def _install_grad_scaler(rt: "Runtime", engine: Callable[[], Any]) -> None:
    from torch.amp import grad_scaler as gs

    cls = gs.GradScaler
    orig = {name: cls.__dict__[name] for name in
            ("_unscale_grads_", "_maybe_opt_step", "update", "get_scale", "_get_growth_tracker",
             "load_state_dict")}

    def emulated(self: Any) -> bool:
        return getattr(self, "_device", None) == "cuda" and getattr(self, "_enabled", False)

    def mirror(self: Any) -> _ScaleMirror:
        m = self.__dict__.get("_gpemu_mirror")
        if m is None:
            m = _ScaleMirror(self._init_scale, self._init_growth_tracker)
            self.__dict__["_gpemu_mirror"] = m
        return m

    def charge(device: torch.device, seconds: float, name: str) -> None:
        eng = rt.state.get("engine")
        if eng is not None and device.type == "cuda":
            eng.stream(device.index or 0).enqueue(seconds, "op", name)

    def _unscale_grads_(self: Any, optimizer: Any, inv_scale: Any, found_inf: Any, allow_fp16: bool) -> dict:
        if not emulated(self):
            return orig["_unscale_grads_"](self, optimizer, inv_scale, found_inf, allow_fp16)
        per_device: dict[torch.device, Any] = {}
        nbytes: dict[torch.device, int] = collections.defaultdict(int)
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                nbytes[grad.device] += grad.numel() * grad.element_size()
                if grad.device not in per_device:
                    per_device[grad.device] = torch.full((), 0.0, dtype=torch.float32, device=grad.device)
        for device, n in nbytes.items():
            # A memory-bound kernel: read and write every gradient once.
            bandwidth = float(getattr(rt.gpus[device.index or 0], "memory_bandwidth", 0) or 900e9)
            charge(device, 2 * n / bandwidth, "amp unscale")
        return per_device

    def _maybe_opt_step(self: Any, optimizer: Any, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
        if not emulated(self):
            return orig["_maybe_opt_step"](self, optimizer, optimizer_state, *args, **kwargs)
        eng = rt.state.get("engine")
        # found_inf.item() is a sync point on a real GPU: the host waits for the backward pass.
        for device in optimizer_state["found_inf_per_device"]:
            if eng is not None and device.type == "cuda":
                eng.stream(device.index or 0).synchronize("GradScaler.step")
        return optimizer.step(*args, **kwargs)

    def update(self: Any, new_scale: Any = None) -> None:
        if not emulated(self):
            return orig["update"](self, new_scale)
        _scale, _ = self._check_scale_growth_tracker("update")
        m = mirror(self)
        if new_scale is not None:
            if isinstance(new_scale, float):
                m.scale = new_scale
            else:
                if not (isinstance(new_scale, torch.Tensor) and new_scale.numel() == 1 and not new_scale.requires_grad):
                    raise AssertionError("new_scale should be a float or a 1-element torch.cuda.FloatTensor "
                                         "or torch.FloatTensor with requires_grad=False.")
                m.scale = float(new_scale.item())
            m.growth = 0
        else:
            found = [f for state in self._per_optimizer_states.values()
                     for f in state["found_inf_per_device"].values()]
            if len(found) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            m.growth += 1
            if m.growth >= self._growth_interval:
                m.scale *= self._growth_factor
                m.growth = 0
        # Keep the device-side tensors in step (their host shadows, where the device layer keeps them).
        with torch.no_grad():
            _scale.fill_(m.scale)
            if self._growth_tracker is not None:
                self._growth_tracker.fill_(m.growth)
        self._per_optimizer_states = collections.defaultdict(gs._refresh_per_optimizer_state)

    def get_scale(self: Any) -> float:
        if not emulated(self):
            return orig["get_scale"](self)
        return mirror(self).scale

    def _get_growth_tracker(self: Any) -> int:
        if not emulated(self):
            return orig["_get_growth_tracker"](self)
        return mirror(self).growth

    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        orig["load_state_dict"](self, state_dict)
        if emulated(self):
            self.__dict__["_gpemu_mirror"] = _ScaleMirror(state_dict["scale"], state_dict["_growth_tracker"])

    for name, fn in (("_unscale_grads_", _unscale_grads_), ("_maybe_opt_step", _maybe_opt_step),
                     ("update", update), ("get_scale", get_scale), ("_get_growth_tracker", _get_growth_tracker),
                     ("load_state_dict", load_state_dict)):
        fn.__name__ = name
        fn.__qualname__ = f"GradScaler.{name}"
        rt.patcher.replace(cls, name, fn)

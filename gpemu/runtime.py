"""The live state of one emulated run, and the single place that patches torch.

``gpemu.patch()`` builds an :class:`EmuConfig`, opens the profile database, creates a
:class:`Runtime`, and asks each component to install itself through the runtime's
:class:`~gpemu.patching.Patcher`. ``gpemu.unpatch()`` restores every original in reverse.

Components (each a module with ``install(rt: Runtime) -> None``) are listed in
``COMPONENTS`` in install order; each keeps its per-run state in its own typed field of the
runtime (``rt.engine``, ``rt.memory``, ``rt.tensors``, ...), so that unpatching and patching
again starts clean and nothing of a run outlives it in a module.

The one piece of process-wide state is which runtime is active (:func:`current`): torch itself
is process-wide, so at most one run patches it at a time. Code that torch calls without a way
to pass context (a tensor type's dispatch, a patched torch function) reaches its run through the
closures and objects its component made at install, or through :func:`current` at public entry
points.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .config import EmuConfig
from .devices import check_ordinal
from .patching import Patcher
from .recorder import Recorder
from .units import redact_url

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.db import GpuSpec, ProfileDB
    from gpemu.integrations.pinned_memory import PinnedState
    from gpemu.integrations.sharing.client import SharingBackend

    from .costs import CostState
    from .cuda_api import CudaSurface
    from .device import TensorState
    from .distributed.placement import Placement
    from .fastpaths.gradients import GradientState
    from .fastpaths.loss import LossState
    from .fastpaths.optimizer import OptimizerFastPath
    from .fastpaths.replay import ReplayState
    from .graphs import GraphState
    from .identify import IdentifyState
    from .memory import MemoryTracker
    from .model_time import ModelTime
    from .time import TimeEngine
    from .transfers import TransferState

__all__ = ["Runtime", "patch", "unpatch", "emulate", "current", "is_patched", "COMPONENTS"]

# Install order matters: the memory trackers and the time engine exist before the tensor type
# that uses them; the torch.cuda surface comes after the tensor type it hands out; the fast paths
# (gpemu.fastpaths: optional accelerators, off with config.replay=False) come after what they
# accelerate.
COMPONENTS: tuple[str, ...] = (
    "gpemu.memory",  # per-device memory tracker, OOM                  (device)
    "gpemu.time",  # virtual streams, events, deadline waits         (time)
    "gpemu.device",  # the emulated tensor type and its dispatch       (device)
    "gpemu.transfers",  # host<->GPU copy time                            (host side)
    "gpemu.ways_in",  # .cuda()/.to()/factories/Module.to               (device)
    "gpemu.optimizer_hooks",  # optimizer step time, iteration marks           (time)
    "gpemu.model_time",  # outermost module's forward/backward time        (time)
    "gpemu.fastpaths.replay",  # module forward/backward record/replay           (fast path)
    "gpemu.fastpaths.backward",  # engine-free loss.backward(), targeted gradients (fast path)
    "gpemu.fastpaths.loss",  # cross-entropy as one op after a recorded call   (fast path)
    "gpemu.fastpaths.optimizer",  # skipped optimizer steps, fast zero_grad      (fast path)
    "gpemu.fastpaths.value_entries",  # real values: the fast paths' host time forgiven (fast path)
    "gpemu.autocast",  # autocast('cuda') dtype behaviour                (device)
    "gpemu.attention",  # scaled_dot_product_attention's fused kernels    (device)
    "gpemu.flex_attention",  # FlexAttention's fused kernel, block masks       (device)
    "gpemu.float8",  # torch._scaled_mm: FP8 tensor cores' GPU check   (device)
    "gpemu.rnn",  # nn.LSTM / GRU / RNN as one cuDNN op             (device)
    "gpemu.serialization",  # torch.save/torch.load of emulated tensors       (device)
    "gpemu.cuda_api",  # torch.cuda / torch.accelerator / backends        (surface)
    "gpemu.graphs",  # torch.cuda.CUDAGraph: capture, replay, graph pools (surface)
    "gpemu.compiled",  # torch.compile: eager, or CUDA graph replays       (surface)
    "gpemu.grad_scaler",  # GradScaler enabled on emulated GPUs            (surface)
    "gpemu.distributed",  # nccl->gloo, emulated DDP                        (surface)
    "gpemu.integrations.pinned_memory",  # mlock-backed pin_memory()          (host side)
    "gpemu.integrations.sharing.client",  # GPU time through a sharing manager  (sharing)
    "gpemu.run_outputs",  # end-of-run summary, metrics JSON, Chrome trace  (observability)
)


@dataclass(eq=False)
class Runtime:
    """Everything an emulated run knows. One exists while gpemu is patched."""

    config: EmuConfig
    db: ProfileDB
    gpus: list[GpuSpec]  # spec of each emulated device, index order
    patcher: Patcher = field(default_factory=Patcher)
    recorder: Recorder = field(default_factory=Recorder)
    # Component state, each field filled by the component named beside it. The core components
    # are always installed (patch() installs every one of COMPONENTS before the run is used), so
    # their fields are required; the others are None while not in use (the fast paths with
    # config.replay=False, the cost state until first used, sharing when not configured).
    memory: list[MemoryTracker] = field(default_factory=list)  # gpemu.memory, one per device
    engine: TimeEngine = field(init=False, repr=False)  # gpemu.time
    tensors: TensorState = field(init=False, repr=False)  # gpemu.device
    transfers: TransferState = field(init=False, repr=False)  # gpemu.transfers
    model_time: ModelTime = field(init=False, repr=False)  # gpemu.model_time
    cuda: CudaSurface = field(init=False, repr=False)  # gpemu.cuda_api
    graphs: GraphState = field(init=False, repr=False)  # gpemu.graphs
    costs: CostState | None = None  # gpemu.costs (made on first use)
    identities: IdentifyState | None = None  # gpemu.identify (made on first use)
    replay: ReplayState | None = None  # gpemu.fastpaths.replay
    gradients: GradientState | None = None  # gpemu.fastpaths.replay (its gradients)
    loss: LossState | None = None  # gpemu.fastpaths.loss
    optimizer_fastpath: OptimizerFastPath | None = None  # gpemu.fastpaths.optimizer
    pinned: PinnedState | None = None  # gpemu.integrations.pinned_memory
    sharing: SharingBackend | None = None  # gpemu.integrations.sharing.client
    placement: Placement | None = None  # gpemu.distributed: the cluster, each rank's node
    at_exit: Any = None  # gpemu.run_outputs: the end-of-run output
    _local: threading.local = field(default_factory=threading.local, repr=False)

    # torch.cuda's current device is per thread, like CUDA's.
    @property
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    @current_device.setter
    def current_device(self, index: int) -> None:
        self.check_device(index)
        self._local.device = index

    @property
    def num_devices(self) -> int:
        return len(self.gpus)

    def check_device(self, index: int) -> int:
        """Validate a device index, raising like CUDA does for a bad ordinal."""
        return check_ordinal(index, len(self.gpus))

    def say_once(self, message: str) -> None:
        """Tell the user something once per run (provenance, fallbacks), on stderr: one write
        per line, marked with the process's rank in a multi-process job (so ranks' lines never
        mix within a line)."""
        if self.recorder.note(message):
            rank = _rank()
            tag = f"[gpemu rank {rank}]" if rank is not None else "[gpemu]"
            sys.stderr.write(f"{tag} {message}\n")
            sys.stderr.flush()


def _rank() -> int | None:
    """This process's rank when it is one of several (torch.distributed, or torchrun's
    LOCAL_RANK before the process group exists); None otherwise."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return None
    try:
        if dist.is_initialized():
            return int(dist.get_rank()) if dist.get_world_size() > 1 else None
        return int(dist.get_node_local_rank())  # raises when LOCAL_RANK is unset
    except (RuntimeError, ValueError, AttributeError):
        return None


_runtime: Runtime | None = None
_lock = threading.RLock()


def current() -> Runtime | None:
    """The active runtime, or None when gpemu is not patched."""
    return _runtime


def is_patched() -> bool:
    return _runtime is not None


def _build_runtime(config: EmuConfig) -> Runtime:
    from gpemu.db import open_profile_db

    db = open_profile_db(config)
    gpus = [db.gpu(name) for name in config.gpus_per_device]  # clear error for unknown names
    return Runtime(config=config, db=db, gpus=gpus)


def patch(config: EmuConfig | None = None, **settings: Any) -> Runtime:
    """Make torch see emulated GPUs. Settings as in :class:`EmuConfig` (gpu, num_gpus, model,
    db_url, memory, ...); unset ones come from ``GPEMU_*`` environment variables.

    Patching twice with the same settings is a no-op. A script that patches itself while it runs
    under ``gpemu run`` keeps the run the command line started (said once, naming any of the
    script's settings that differ); otherwise different settings need ``gpemu.unpatch()`` first.
    """
    global _runtime
    with _lock:
        cfg = config if config is not None else EmuConfig.from_env(**settings)
        if _runtime is not None:
            if config is None and not settings:
                return _runtime
            if _runtime.config == cfg:
                return _runtime
            differ = _differences(_runtime.config, cfg)
            if _runtime.config.enable:
                # The command line's settings win: the script is run by `gpemu run`.
                _runtime.say_once(
                    f"gpemu.patch() called under `gpemu run`: the run keeps the command line's settings ({differ})"
                )
                return _runtime
            raise RuntimeError(f"gpemu is already patched with other settings ({differ}); call gpemu.unpatch() first")
        rt = _build_runtime(cfg)
        _runtime = rt
        try:
            for name in COMPONENTS:
                importlib.import_module(name).install(rt)
        except BaseException:
            _runtime = None
            rt.patcher.restore_all()
            raise
        return rt


def _differences(active: EmuConfig, asked: EmuConfig) -> str:
    """``name=asked (run: active)`` for each setting that differs, credentials hidden."""
    items = []
    for f in fields(EmuConfig):
        if not f.compare or f.name == "enable":
            continue
        a, b = getattr(active, f.name), getattr(asked, f.name)
        if a != b:
            if f.name == "sharing" or f.name == "db_url":
                a, b = redact_url(a), redact_url(b)
            items.append(f"{f.name}={b!r} asked, {a!r} in use")
    return "; ".join(items) or "none differ"


def unpatch() -> None:
    """Restore every original torch attribute gpemu replaced. Safe to call when not patched."""
    global _runtime
    with _lock:
        rt = _runtime
        if rt is None:
            return
        try:
            rt.patcher.restore_all()
        finally:
            _runtime = None


@contextmanager
def emulate(config: EmuConfig | None = None, **settings: Any) -> Iterator[Runtime]:
    """Scoped form: ``with gpemu.emulate(gpu="A100", num_gpus=2): ...``."""
    rt = patch(config, **settings)
    try:
        yield rt
    finally:
        unpatch()

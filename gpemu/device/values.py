"""Value mode (``values="real"``, ``gpemu run --values real``): every emulated tensor also
carries its real values, computed on the CPU.

The mechanism is the host shadows' (:mod:`gpemu.device.shadows`) for every tensor: no size
limit, random ops computed too, the model's parameters carried from the host. This module holds
what the value mode adds to it:

* **random numbers** come from torch's CPU generator, seeded from the emulated CUDA generator's
  state (its seed, as the program seeded CUDA, and its Philox offset, which each random op
  advances by one): ``torch.cuda.manual_seed(s)`` makes the run repeat, and
  ``torch.cuda.set_rng_state`` (activation checkpointing's recomputation) draws the same numbers
  again. The program's own CPU generator is left as it was;
* **the host's room**: every value lives in host memory, so a run whose emulated allocations
  outgrow the host's available memory is refused with one line (:class:`HostMemoryRefused`);
* **values laid out as the emulated tensor** (:func:`laid_out`): a view the program takes of an
  emulated tensor is taken of its values too, so both must have the same strides.

The CPU's compute time is the emulator's own host time (every op is an emulator entry, forgiven:
:mod:`gpemu.time.host`), so emulated times are those of a run with placeholder values.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

__all__ = ["ValueMode", "HostMemoryRefused", "laid_out", "available_host_bytes", "HOST_SHARE"]

_GIB = float(1 << 30)
# The share of the host's available memory (at the start of the run) the values may take: the
# rest is the program's own (its data, the CPU copy of the model it built, Python).
HOST_SHARE = 0.85
_MIX = 0x9E3779B97F4A7C15  # (golden-ratio multiplier: neighbouring offsets give unrelated seeds)


class HostMemoryRefused(SystemExit):
    """The run's values would not fit in the host's memory: the program ends with one line (a
    SystemExit, so no traceback), before the host starts swapping or the OS kills it."""


def available_host_bytes() -> int | None:
    """The host's available memory (``MemAvailable`` in /proc/meminfo), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def laid_out(value: torch.Tensor, shape: Any, stride: Any) -> torch.Tensor:
    """``value`` with ``stride`` (a copy when its own strides differ): the values of an emulated
    tensor of that layout, so that views of both agree."""
    if tuple(value.stride()) == tuple(stride) or value.numel() <= 1:
        return value
    out = torch.empty_strided(tuple(shape), tuple(stride), dtype=value.dtype)
    out.copy_(value)
    return out


class ValueMode:
    """The value mode of one run (``TensorState.values``; None with placeholder values)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        available = available_host_bytes()
        self.host_limit = int(available * HOST_SHARE) if available is not None else None
        self.failed: set[str] = set()  # ops whose values could not be computed (said once each)

    # ------------------------------------------------------------------ random numbers
    def _philox(self, dev: int) -> tuple[int, int]:
        state = self.rt.cuda.get_rng_state(dev)
        seed, offset = struct.unpack("<QQ", bytes(state.numpy().tobytes()))
        return seed, offset

    def draw(self, dev: int) -> int:
        """The seed of emulated device ``dev``'s next random op (from its generator's seed and
        offset); the device's offset advances by one, as a CUDA kernel's Philox offset does."""
        seed, offset = self._philox(dev)
        next_state = struct.pack("<QQ", seed, (offset + 1) & 0xFFFF_FFFF_FFFF_FFFF)
        self.rt.cuda.set_rng_state(torch.frombuffer(bytearray(next_state), dtype=torch.uint8), dev)
        return (seed * _MIX + offset) & 0x7FFF_FFFF_FFFF_FFFF

    @staticmethod
    @contextmanager
    def seeded(seed: int) -> Iterator[None]:
        """Host computation drawing from torch's CPU generator seeded with ``seed`` (a backward
        recomputing its forward's dropout uses the forward's seed); the program's CPU generator
        is restored after."""
        cpu = torch.default_generator
        saved = cpu.get_state()
        cpu.manual_seed(seed)
        try:
            yield
        finally:
            cpu.set_state(saved)

    def random(self, dev: int) -> AbstractContextManager[None]:
        """Host computation of emulated device ``dev``'s random op (see :meth:`draw`)."""
        return self.seeded(self.draw(dev))

    # ------------------------------------------------------------------ the host's room
    def check_room(self, nbytes: int) -> None:
        """Refuse (one line) when ``nbytes`` more values would take the run's values past the host
        memory they may use: everything the emulated GPUs of this process hold, plus these."""
        limit = self.host_limit
        if limit is None or nbytes <= 0:
            return
        held = sum(m.allocated for m in self.rt.memory)
        if held + nbytes <= limit:
            return
        raise HostMemoryRefused(
            f"gpemu: --values real keeps every emulated tensor's values in host memory, and this run needs "
            f"{(held + nbytes) / _GIB:.1f} GiB of them where this host has {limit / _GIB:.1f} GiB for them "
            f"({HOST_SHARE:.0%} of its available memory): run it with placeholder values (the default, "
            "--values placeholders), a smaller model or batch, or on a host with more memory"
        )

    # ------------------------------------------------------------------ gaps
    def failed_op(self, name: str, exc: BaseException) -> str | None:
        """The line to say when an op's values could not be computed on the CPU (once per op)."""
        if name in self.failed:
            return None
        self.failed.add(name)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            f"values: {name} could not be computed on the CPU ({first[:200]}); its results read as zeros "
            "from here (please report it)"
        )

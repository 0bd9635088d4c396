"""CUDA graph capture on the emulated timeline: a capturing stream records its GPU work instead of
running it, and the host may not wait while a capture is under way.

On a real GPU, ``cudaStreamBeginCapture`` turns a stream's kernels into nodes of a graph: nothing
runs until the graph is launched, and any call that would wait for the capturing stream (a stream
or device synchronize, a blocking copy, ``.item()``) fails with "operation not permitted when
stream is capturing" and invalidates the capture. The engine (:mod:`gpemu.time.engine`) keeps one
:class:`StreamCapture` per capturing stream; work enqueued on it is appended as
:class:`CapturedWork`, and the run's graphs (:mod:`gpemu.graphs`) replay it.

Capture modes are CUDA's (``cudaStreamCaptureMode``, torch's ``capture_error_mode``): a sync point
is refused in the capturing thread in every mode, and in any thread while a ``"global"`` capture
is under way.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    from .streams import VirtualStream

__all__ = [
    "CAPTURE_MODES",
    "BACKWARD_MARK",
    "ITERATION_END",
    "CapturedWork",
    "StreamCapture",
    "capture_refusal",
    "CAPTURE_INVALIDATED",
]

CAPTURE_MODES = ("global", "thread_local", "relaxed")

# Book-keeping captured along with the kernels (zero seconds): a backward pass ran, an optimizer
# step ended an iteration. A replay repeats them, so a captured training step still counts as one.
BACKWARD_MARK = "backward mark"
ITERATION_END = "iteration end"

# What CUDA says at capture end after a refused call (cudaErrorStreamCaptureInvalidated).
CAPTURE_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"


class CapturedWork(NamedTuple):
    """One piece of GPU work a capture recorded (or a zero-second mark, see ``BACKWARD_MARK``)."""

    seconds: float
    kind: str
    name: str
    peak_bytes: int


class StreamCapture:
    """The capture under way on one stream: what it recorded, in order, and whether a refused call
    invalidated it (``invalid``: that call's reason)."""

    __slots__ = ("stream", "mode", "thread", "work", "invalid")

    def __init__(self, stream: VirtualStream, mode: str) -> None:
        if mode not in CAPTURE_MODES:  # (torch's message)
            raise RuntimeError(
                f"Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got {mode}"
            )
        self.stream = stream
        self.mode = mode
        self.thread = threading.get_ident()
        self.work: list[CapturedWork] = []
        self.invalid: str | None = None

    def record(self, seconds: float, kind: str, name: str, peak_bytes: int = 0) -> None:
        self.work.append(CapturedWork(seconds, kind, name, peak_bytes))

    def refuses(self, thread: int) -> bool:
        """Whether a sync point in ``thread`` is refused while this capture is under way."""
        return self.mode == "global" or thread == self.thread

    @property
    def seconds(self) -> float:
        """The GPU time of the recorded kernels, back to back."""
        return sum(w.seconds for w in self.work)


def capture_refusal(reason: str) -> RuntimeError:
    """The error CUDA gives a call that would wait for a capturing stream (torch's message)."""
    return RuntimeError(
        "CUDA error: operation not permitted when stream is capturing\n"
        f"(gpemu: {reason} waits for the GPU, which a CUDA graph capture cannot contain)"
    )

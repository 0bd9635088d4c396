"""The token steps of a generation or serving loop, noted as its model calls return (replayed or
op by op: ``rt.model_time.serving``): the records :mod:`gpemu.serving` computes the serving
metrics from (kept apart from them: the metrics need no torch, and :mod:`gpemu.observe`, which
uses them, is imported by ``gpemu run``'s bootstrap in processes that never import torch)."""

from __future__ import annotations

from typing import Any

import torch

from gpemu.serving import MAX_STEPS, TokenStep

__all__ = ["ServingLog"]


class ServingLog:
    """The token steps of one run (``rt.model_time.serving``): the first :data:`MAX_STEPS`."""

    def __init__(self) -> None:
        self.steps: list[TokenStep] = []
        # the bytes the call's object arguments hold, when its replay knows them (else walked)
        self.held: int | None = None

    def note(self, engine: Any, args: tuple, kwargs: dict, dev: int, t0: float) -> None:
        """Note an outermost call without autograd that just returned, if it was given token ids."""
        held, self.held = self.held, None
        if len(self.steps) >= MAX_STEPS:
            return
        ids = _token_ids(args, kwargs)
        if ids is None:
            return
        sequences = int(ids.shape[0]) if ids.dim() >= 2 else 1
        positions = int(ids.shape[-1]) if ids.dim() >= 1 else 1
        end = max(t0, engine.stream(dev).busy_until)
        if held is None:
            held = _cache_bytes(args, kwargs)
        self.steps.append(TokenStep(dev, t0, end, sequences, positions, held))


def _token_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor) and x.dim() <= 2 and not (x.is_floating_point() or x.dtype == torch.bool):
            return x
    return None


def _cache_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes of the memory blocks of the emulated tensors held by the call's non-tensor arguments."""
    blocks: dict[int, int] = {}
    seen: set[int] = set()
    for x in (*args, *kwargs.values()):
        if not isinstance(x, torch.Tensor):
            _collect(x, blocks, seen, 0)
    return sum(blocks.values())


_MAX_DEPTH = 6  # an HF cache: cache -> layers -> layer -> keys


def _collect(x: Any, blocks: dict[int, int], seen: set[int], depth: int) -> None:
    if isinstance(x, torch.Tensor):
        blk = getattr(x, "emu_block", None)  # (an emulated tensor's memory block; a host tensor: none)
        if blk is not None:
            blocks[id(blk)] = blk.size
        return
    if depth >= _MAX_DEPTH or id(x) in seen or isinstance(x, (torch.nn.Module, type, str, bytes)):
        return
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        items: Any = x
    elif isinstance(x, dict):
        items = x.values()
    else:
        attrs = getattr(x, "__dict__", None)
        if attrs is None or callable(x):
            return
        items = list(attrs.values())
    for v in items:
        _collect(v, blocks, seen, depth + 1)

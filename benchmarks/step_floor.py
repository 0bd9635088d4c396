"""The floor: the least host time a training step can take under an emulator built on a tensor
subclass and autograd, whatever it charges.

``overhead.py``'s step (input copy, forward, label copy, loss, backward, SGD step, zero_grad) made
of nothing but the torch objects each phase must hand back: wrapper tensors (as
``torch.Tensor._make_wrapper_subclass`` makes them) for the two copies and the label's host
values; one ``autograd.Function`` apply with a wrapper output for the forward and one for the
loss; a backward that gives ``--params`` parameters (16: AlexNet's) their gradients, wrappers kept
from step to step; a loop over the parameters for the SGD step and for ``zero_grad``. No time is
charged, no memory counted, no module or optimizer of torch's is called: what remains between this
floor and ``overhead.py``'s figure is the emulator's book-keeping and torch's own module and
optimizer calls.

Two floors:

* **engine**: every parameter an input of the forward's Function, ``loss.backward()`` through
  torch's autograd engine (what a subclass emulator pays without hub mode and engine-free backward);
* **engine-free**: one hub input and the two nodes' backward functions called directly (what
  gpemu's replay does for an ordinary training step, :mod:`gpemu.fastpaths.replay`).

    python benchmarks/step_floor.py
    python benchmarks/step_floor.py --params 148      # a GPT-2-small's parameter tensors
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import machine


class _Wrapper(torch.Tensor):
    """A tensor with metadata and no storage (what an emulated tensor is to torch)."""

    @staticmethod
    def __new__(cls, shape: tuple, requires_grad: bool = False) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=torch.float32, device="meta", requires_grad=requires_grad
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise RuntimeError(f"the floor runs no op ({func})")


def _make_step(n_params: int, engine: bool) -> Callable[[], None]:
    params = [_Wrapper((64, 64), requires_grad=True) for _ in range(n_params)]
    grads = [_Wrapper((64, 64)) for _ in range(n_params)]
    hub = _Wrapper((1,), requires_grad=True)

    class Forward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return _Wrapper((32, 1000))

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
            for p, g in zip(params, grads, strict=False):
                p.grad = g
            return (None,) * (1 + (n_params if engine else 1))

    class Loss(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return _Wrapper(())

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
            return _Wrapper((32, 1000)), None

    x, y = torch.empty(32, 3, 224, 224), torch.zeros(32, dtype=torch.long)
    ones = _Wrapper(())
    inputs = params if engine else [hub]

    def step() -> None:
        xe = _Wrapper(tuple(x.shape))
        out = Forward.apply(xe, *inputs)
        ye = _Wrapper(tuple(y.shape))
        ye.emu_shadow = y.clone()  # the label's values, known on the host
        loss = Loss.apply(out, ye)
        if engine:
            torch.autograd.backward([loss], [ones])
        else:
            Forward.backward(None, Loss.backward(None, ones)[0])
        for _ in params:  # the SGD step: at least a loop over the parameters
            pass
        for p in params:  # zero_grad(set_to_none=True)
            p.grad = None

    return step


def _median_us(step: Callable[[], None], iterations: int) -> float:
    for _ in range(min(500, iterations)):
        step()
    per_round = iterations // 30  # (main: --iterations >= 30)
    rounds = []
    for _ in range(30):
        t0 = time.perf_counter()
        for _ in range(per_round):
            step()
        rounds.append((time.perf_counter() - t0) / per_round)
    return 1e6 * statistics.median(rounds)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--params", type=int, default=16, help="parameter tensors (default 16, AlexNet's)")
    p.add_argument("--iterations", type=int, default=6000, help="steps timed per floor (default 6000)")
    a = p.parse_args()
    if a.params < 1 or a.iterations < 30:
        p.error("--params must be at least 1 and --iterations at least 30")
    print(f"machine: {machine()}; torch {torch.__version__}")
    for engine in (True, False):
        label = "engine (every parameter an input)" if engine else "engine-free (one hub input)"
        print(
            f"floor, {label:36} {_median_us(_make_step(a.params, engine), a.iterations):7.1f} us per step, "
            f"{a.params} parameter tensors"
        )


if __name__ == "__main__":
    main()

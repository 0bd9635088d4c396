"""Float8 training against bf16 on an emulated GPU: torchao's ``Float8Linear`` in an MLP block,
eager and ``torch.compile``'d, split into the kernels it launches.

    python benchmarks/float8_speedup.py [--gpus H100] [--width 4096] [--tokens 8192] [--linears MxKxN,...]

For each GPU and each of bf16 / float8 (``torchao.float8.convert_to_float8_training``): one steady
training step of a bf16 MLP block (Linear width -> 4 width, GELU, Linear back, no biases; a
mean-square loss; AdamW), eager and compiled; and the forward and backward of single compiled
linear layers of the shapes torchao's float8 README gives H100 speed-ups for (1024x2048x1024:
0.80, 4096x8192x16384: 1.39). Op by op (no replay), counted by a cost tap over the step:
the matrix products (launches, GPU ms) and the memory-bound kernels (launches, GPU ms, GB: for
float8, the amax reductions and casts), and the step's time by CUDA events. The clock is the
instant virtual clock (host time only as the cost model issues it): under the emulated
``torch.compile`` torchao's Python tensor subclass still runs every step, where Inductor compiles
it away, and on this shared machine its CPU time would be charged as the host's. Needs torchao
(not a dependency of gpemu: ``pip install torchao``). The figures in docs/compile.md come from
this script.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.costmodel import COMPUTE_CLASSES


@dataclass
class StepParts:
    """One step's kernels by kind."""

    launches: dict[str, int] = field(default_factory=lambda: {"gemm": 0, "memory": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"gemm": 0.0, "memory": 0.0})
    nbytes: float = 0.0
    step_ms: float = 0.0


@dataclass(frozen=True)
class Workload:
    """What one step runs: the MLP block's training step (forward, backward, AdamW), or one linear
    layer's forward and backward with the input's gradient (``shape``: its M, K, N), as torchao's
    float8 README benchmarks it."""

    width: int = 4096
    tokens: int = 8192
    shape: tuple[int, int, int] | None = None

    def build(self) -> tuple[torch.nn.Module, torch.Tensor]:
        if self.shape is not None:
            m, k, n = self.shape
            x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            return torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)), x
        w = self.width
        mlp = torch.nn.Sequential(
            torch.nn.Linear(w, 4 * w, bias=False), torch.nn.GELU(), torch.nn.Linear(4 * w, w, bias=False)
        )
        return mlp, torch.empty(self.tokens, w, device="cuda", dtype=torch.bfloat16)

    def step(self, run: torch.nn.Module, optimizer: torch.optim.Optimizer | None, x: torch.Tensor) -> None:
        if optimizer is None:  # (a linear layer alone: y.sum() backward, no gradient accumulation)
            x.grad = None
            run.zero_grad(set_to_none=True)
            run(x).sum().backward()
            return
        run(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure(gpu: str, work: Workload, float8: bool, compiled: bool) -> StepParts:
    from torchao.float8 import convert_to_float8_training

    rt = gpemu.patch(gpu=gpu, summary=False, replay=False, clock=VirtualClock())
    try:
        model, x = work.build()
        model = model.to("cuda", torch.bfloat16)
        if float8:
            convert_to_float8_training(model)
        run = torch.compile(model) if compiled else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if work.shape is None else None
        for _ in range(2):
            work.step(run, optimizer, x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with rt.tensors.cost_tap() as tap:
            tap.ops = []
            start.record()
            work.step(run, optimizer, x)
            end.record()
        torch.cuda.synchronize()
        parts = StepParts(step_ms=start.elapsed_time(end))
        for seconds, _host, op in tap.ops:
            if op is None:  # (an optimizer step: counted in the step's time only)
                continue
            kind = "gemm" if op.op_class in COMPUTE_CLASSES else "memory"
            parts.launches[kind] += 1
            parts.seconds[kind] += seconds
            if kind == "memory":
                parts.nbytes += op.nbytes
        return parts
    finally:
        gpemu.unpatch()


def _rows(gpu: str, label: str, work: Workload, modes: tuple[bool, ...]) -> None:
    for compiled in modes:
        rows = {f8: measure(gpu, work, f8, compiled) for f8 in (False, True)}
        run = f"{label}, {'compiled' if compiled else 'eager'}"
        for f8, p in rows.items():
            print(
                f"| {gpu} | {run}, {'float8' if f8 else 'bf16'} | {p.step_ms:.2f} ms | "
                f"{p.launches['gemm']}, {p.seconds['gemm'] * 1e3:.2f} | "
                f"{p.launches['memory']}, {p.seconds['memory'] * 1e3:.2f}, {p.nbytes / 1e9:.2f} |"
            )
        print(f"| {gpu} | {run}: bf16 / float8 | {rows[False].step_ms / rows[True].step_ms:.2f}x | | |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="H100")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument(
        "--linears",
        default="1024x2048x1024,4096x8192x16384",
        help="single linear layers (MxKxN, comma-separated; '' for none), compiled, forward + backward",
    )
    args = ap.parse_args(argv)
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        print("float8_speedup: torchao is not installed (pip install torchao)")
        return 2
    print("| GPU | run | step (CUDA events) | matrix products: launches, ms | memory-bound kernels: launches, ms, GB |")
    print("| --- | --- | --- | --- | --- |")
    for gpu in args.gpus.split(","):
        mlp = Workload(args.width, args.tokens)
        _rows(gpu, f"MLP {args.width} x {args.tokens} tokens, AdamW", mlp, (False, True))
        for spec in filter(None, args.linears.split(",")):
            m, k, n = (int(v) for v in spec.split("x"))
            _rows(gpu, f"linear {spec}", Workload(shape=(m, k, n)), (True,))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

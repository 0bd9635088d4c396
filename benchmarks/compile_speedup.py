"""Why a compiled training step is faster than eager on an emulated GPU: nanoGPT's GPT-2 (124M)
step, eager and ``torch.compile``'d, split into the kernels it launches.

    python benchmarks/compile_speedup.py --nanogpt PATH/TO/nanoGPT [--gpus A100,H100]

For each GPU, one training step of nanoGPT's ``bench.py`` configuration (batch 12 x 1024 tokens,
bf16 autocast, fused AdamW), eager and compiled, op by op (no replay), counted by a cost tap over
the step: launches, GPU seconds and bytes of the extern kernels (matrix products, attention) and
of the memory-bound kernels (eager ops, or Inductor's fused groups), the host issue gaps the cost
model charges between launches, and the step's time by CUDA events. The figures in docs/compile.md
come from this script and from ``bench.py`` itself under ``gpemu run``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import gpemu
from gpemu.costmodel import COMPUTE_CLASSES


@dataclass
class StepParts:
    """One step's kernels by kind."""

    launches: dict[str, int] = field(default_factory=lambda: {"extern": 0, "memory": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"extern": 0.0, "memory": 0.0})
    nbytes: dict[str, float] = field(default_factory=lambda: {"extern": 0.0, "memory": 0.0})
    step_ms: float = 0.0


def _gpt(nanogpt: Path) -> tuple[type, type]:
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's own model.py

    return GPT, GPTConfig


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _build(GPT: type, conf: object, manual_attention: bool) -> torch.nn.Module:
    """nanoGPT's GPT; ``manual_attention``: as nanoGPT was before PyTorch 2.0's fused attention
    (its model takes the flash path when ``F.scaled_dot_product_attention`` exists)."""
    if not manual_attention:
        return GPT(conf)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    del torch.nn.functional.scaled_dot_product_attention
    try:
        return GPT(conf)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


def measure(gpu: str, nanogpt: Path, compiled: bool, batch: int, block: int, manual_attention: bool) -> StepParts:
    rt = gpemu.patch(gpu=gpu, summary=False, replay=False, clock="virtual")
    try:
        GPT, GPTConfig = _gpt(nanogpt)
        torch.manual_seed(1337)
        conf = GPTConfig(block_size=block, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=False)
        model = _build(GPT, conf, manual_attention).to("cuda")
        optimizer = model.configure_optimizers(1e-2, 1e-4, (0.9, 0.95), "cuda")
        run = torch.compile(model) if compiled else model
        x = torch.randint(50304, (batch, block), device="cuda")
        y = torch.randint(50304, (batch, block), device="cuda")
        for _ in range(2):
            _step(run, optimizer, x, y)
        parts = StepParts()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with rt.tensors.cost_tap() as tap:
            tap.ops = []
            start.record()
            _step(run, optimizer, x, y)
            end.record()
        torch.cuda.synchronize()
        parts.step_ms = start.elapsed_time(end)
        for seconds, _host, op in tap.ops:
            if op is None:  # (an optimizer step or a span: counted in the step's time only)
                continue
            kind = "extern" if op.op_class in COMPUTE_CLASSES else "memory"
            parts.launches[kind] += 1
            parts.seconds[kind] += seconds
            parts.nbytes[kind] += op.nbytes
        return parts
    finally:
        gpemu.unpatch()
        sys.modules.pop("model", None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="a karpathy/nanoGPT checkout (its model.py)")
    ap.add_argument("--gpus", default="A100,H100")
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument(
        "--manual-attention",
        action="store_true",
        help="attention written out (matmul, mask, softmax, matmul), as nanoGPT was before flash attention",
    )
    args = ap.parse_args(argv)
    if not (args.nanogpt / "model.py").is_file():
        print(f"compile_speedup: no model.py in {args.nanogpt} (give a karpathy/nanoGPT checkout)")
        return 2
    print("| GPU | run | step (CUDA events) | extern kernels: launches, ms | memory-bound kernels: launches, ms, GB |")
    print("| --- | --- | --- | --- | --- |")
    for gpu in args.gpus.split(","):
        rows = {c: measure(gpu, args.nanogpt, c, args.batch, args.block, args.manual_attention) for c in (False, True)}
        for compiled, p in rows.items():
            print(
                f"| {gpu} | {'compiled' if compiled else 'eager'} | {p.step_ms:.1f} ms | "
                f"{p.launches['extern']}, {p.seconds['extern'] * 1e3:.1f} | "
                f"{p.launches['memory']}, {p.seconds['memory'] * 1e3:.1f}, {p.nbytes['memory'] / 1e9:.2f} |"
            )
        e, c = rows[False], rows[True]
        print(f"| {gpu} | eager / compiled | {e.step_ms / c.step_ms:.2f}x | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

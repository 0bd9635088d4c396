"""Issue 28's table, each reproduction as the issue wrote it, re-run: one line per row, ``ok`` with
what it showed (the figure the issue quoted beside it) or ``FAIL`` with why.

    python tests/compat/issue28_table.py          # about a minute on two cores

Unlike the scenario scripts this one imports gpemu (most rows patch in-process); the rows that need
ranks, spawned children or the printed summary run under ``gpemu run`` in a child process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gpemu
from gpemu.clock import VirtualClock

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from examples import tvmodels  # noqa: E402  (torchvision's models without torchvision)

Check = Callable[[object], str]
ROWS: list[tuple[str, str, Check]] = []


def row(what: str, gpu: str = "A100") -> Callable[[Check], Check]:
    def add(fn: Check) -> Check:
        ROWS.append((what, gpu, fn))
        return fn

    return add


def forward_ms(rt: object) -> list[float]:
    return [round(1e3 * (s.end - s.start), 2) for s in rt.recorder.spans if s.kind == "forward"]  # type: ignore[attr-defined]


@row("first no_grad call of a measured model at a new batch size")
def _no_grad(rt: object) -> str:
    m = tvmodels.resnet50().cuda().eval()
    with torch.no_grad():
        m(torch.randn(8, 3, 224, 224, device="cuda"))
        m(torch.randn(5, 3, 224, 224, device="cuda"))
    return "ran (issue: element 0 of tensors does not require grad)"


@row("views of a CUDA tensor in inference_mode")
def _views(rt: object) -> str:
    x = torch.randn(4, 6, device="cuda")
    with torch.inference_mode():
        y = torch.randn(4, 6, device="cuda")
        out = [x.view(24), x.expand(2, 4, 6), x[1], x.t(), y.view(24), y.t(), y[:, 2]]
    return f"{len(out)} views (issue: Cannot set version_counter for inference tensor)"


@row("an EMA copy in a wrapper that forward never calls")
def _ema(rt: object) -> str:
    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.ema = tvmodels.resnet50(), tvmodels.resnet50()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    w = Wrap().cuda()
    x = torch.randn(32, 3, 224, 224, device="cuda")
    w(x).sum().backward()
    alone = tvmodels.resnet50().cuda()
    alone(x).sum().backward()
    fw = forward_ms(rt)
    assert abs(fw[0] - fw[-1]) < 0.01 * fw[-1], fw
    return f"forward {fw[0]} ms, a ResNet-50 alone {fw[-1]} ms (issue: charged twice)"


@row("model.share_memory() on a CUDA model")
def _share(rt: object) -> str:
    m = nn.Linear(8, 8).cuda()
    m.share_memory()
    return f"weight on {m.weight.device} (issue: _share_fd_: only available on CPU)"


@row("clip_grad_norm_(params, max_norm, foreach=True)")
def _clip(rt: object) -> str:
    m = nn.Linear(8, 8).cuda()
    m(torch.randn(2, 8, device="cuda")).sum().backward()
    return f"norm on {nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True).device}"


@row("flex_attention forward and backward", "H100")
def _flex(rt: object) -> str:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 1024, 1024, device="cuda")
    flex_attention(q, k, v, block_mask=mask).sum().backward()
    assert q.grad is not None
    return f"q.grad {tuple(q.grad.shape)}"


@row("torch.cuda.CUDAGraph / torch.cuda.graph / replay", "H100")
def _graph(rt: object) -> str:
    m, x = nn.Linear(256, 256).cuda(), torch.randn(64, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = m(x)
    g.replay()
    torch.cuda.synchronize()
    return f"replayed, output {tuple(y.shape)} (issue: CUDA driver version is insufficient)"


@row("SDPA enable_gqa=True, 2x32x8192x128 bf16, 8 K/V heads", "H100")
def _gqa(rt: object) -> str:
    q = torch.randn(2, 32, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 8, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == q.shape
    gib = torch.cuda.memory_allocated() / 2**30
    assert gib < 0.6, gib
    return f"{gib:.2f} GiB after forward, inputs and output held (issue: 33.6 GiB; 0.50 with 32 K/V heads)"


@row("tensor factories under FakeTensorMode")
def _fake(rt: object) -> str:
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = torch.cuda.memory_allocated()
    with FakeTensorMode():
        t = torch.empty(4096, 4096 * 4, device="cuda")
    grew = torch.cuda.memory_allocated() - before
    assert grew == 0, grew
    return f"{type(t).__name__}, +{grew} bytes (issue: 224 MiB each)"


@row("ResNet-50 fp16 autocast: forward price vs the first call's mode")
def _amp(rt: object) -> str:
    prices = []
    for first in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        gpemu.unpatch()
        rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
        m, x = tvmodels.resnet50().cuda(), torch.randn(32, 3, 224, 224, device="cuda")
        with first(), torch.autocast("cuda", dtype=torch.float16):
            m(x)
        with torch.autocast("cuda", dtype=torch.float16):
            m(x)
        prices.append(forward_ms(rt)[-1])
    assert max(prices) - min(prices) < 0.01 * max(prices), prices
    return f"forward {prices} ms after a grad / no_grad / inference_mode first call"


FSDP2 = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
dist.init_process_group("nccl"); torch.cuda.set_device(dist.get_rank())
m = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(8)]).cuda()
for layer in m: fully_shard(layer)
fully_shard(m)
m(torch.randn(8, 4096, device="cuda")).sum().backward()
print(f"rank {dist.get_rank()}: {torch.cuda.memory_allocated() / 2**30:.2f} GiB")
dist.destroy_process_group()
"""

SPAWN = """
import torch, torch.multiprocessing as mp
def work(i):
    torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda"); torch.cuda.synchronize()
if __name__ == "__main__":
    mp.spawn(work, nprocs=2)
"""

MESSAGES = """
import torch
m = torch.nn.Sequential(torch.nn.Linear(20, 400), torch.nn.ReLU(), torch.nn.Linear(400, 20)).cuda()
opt = torch.optim.SGD(m.parameters(), lr=0.1)
with torch.autocast("cuda", dtype=torch.bfloat16):  # one whole-model call: the model is identified once
    m(torch.randn(64, 20, device="cuda")).float().pow(2).mean().backward()
for step in range(4):  # a loop of forward-forward's shape: each layer trained on its own, no model call
    for layer in (m[0], m[2]):
        x = torch.randn(64, layer.in_features, device="cuda")
        loss = layer(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
"""


def gpemu_run(tmp: Path, script: str, *options: str, launcher: tuple[str, ...] = ()) -> str:
    (tmp / "s.py").write_text(textwrap.dedent(script))
    cmd = [sys.executable, "-m", "gpemu.cli", "run", *options, "--", *(launcher or (sys.executable,)), "s.py"]
    out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"exit {out.returncode}: {out.stdout[-800:]}{out.stderr[-1500:]}")
    return out.stdout + out.stderr


def in_children(tmp: Path) -> list[tuple[str, str]]:
    """The rows that need ranks, spawned children or the printed summary."""
    results = []
    try:
        torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
        out = gpemu_run(tmp, FSDP2, "--gpu", "H100", "--gpus", "2", launcher=torchrun)
        gib = [float(g) for g in re.findall(r"rank \d: ([\d.]+) GiB", out)]
        assert len(gib) == 2 and all(abs(g - 0.5) < 0.02 for g in gib), out[-2000:]
        results.append(("ok", f"FSDP2 resize_(0): {gib} GiB per rank after fwd+bwd (issue: 0.75, 0.50 expected)"))
    except Exception as exc:
        results.append(("FAIL", f"FSDP2 resize_(0): {exc}"))
    try:
        gpemu_run(tmp, SPAWN, "--gpu", "A100", "--trace", "t.json", "--metrics", "m.json")
        metrics, traces = sorted(p.name for p in tmp.glob("m*.json")), sorted(p.name for p in tmp.glob("t*.json"))
        # one file per process that used the GPU (the parent never did: it writes none)
        assert len(metrics) == 2 and len(traces) == 2, (metrics, traces)
        results.append(("ok", f"mp.spawn children's outputs: {metrics} {traces} (issue: one file, overwritten)"))
    except Exception as exc:
        results.append(("FAIL", f"mp.spawn --trace/--metrics: {exc}"))
    try:
        out = gpemu_run(tmp, MESSAGES, "--gpu", "A100", "--metrics", "msg.json")
        iterations = json.loads((tmp / "msg.json").read_text()).get("iterations")
        identified = len(re.findall(r"model Linear .* identified", out))
        plus_minus = re.search(r"model time .*", out)
        assert iterations and identified <= 1, (iterations, identified)
        results.append(
            (
                "ok",
                f"summary: {iterations} iterations (issue: 0), {identified} 'identified' lines, "
                f"± origin: {plus_minus.group(0).strip() if plus_minus else '-'}",
            )
        )
    except Exception as exc:
        results.append(("FAIL", f"summary/messages: {exc}"))
    return results


def main() -> None:
    failed = 0
    for what, gpu, check in ROWS:
        rt = gpemu.patch(gpu=gpu, summary=False, clock=VirtualClock())
        try:
            status, said = "ok", check(rt)
        except Exception as exc:
            status, said = "FAIL", f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()
        finally:
            gpemu.unpatch()
        failed += status == "FAIL"
        print(f"{status:4} | {what} | {said}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for status, said in in_children(Path(tmp)):
            failed += status == "FAIL"
            print(f"{status:4} | {said}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

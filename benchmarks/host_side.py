"""The host side of a GPU step (issue 29): what the modelled host changes, host by host.

Prints, for each ``--hosts`` value (gpemu run --host) on a manual clock (the figures are the
emulated timeline's; the loop's own Python time does not count, only modelled host time):

* a 4-layer MLP (batch 128, hidden 1024) on an A100 and an H100: forward, backward and their ratio;
* 4,000 un-synced small kernels: the host's time issuing them and the final synchronize();
* AdamW steps over 300 tensors of 4,096 elements: per-tensor, foreach and fused.

    python benchmarks/host_side.py [--hosts none,this,h100-xeon]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from _common import machine  # (puts the repository on sys.path)

import gpemu
from gpemu.clock import VirtualClock


def _emulate(gpu: str, host: str):  # noqa: ANN202 - gpemu.emulate's context manager
    return gpemu.emulate(gpu=gpu, clock=VirtualClock(), summary=False, host=host)


def mlp(gpu: str, host: str) -> tuple[float, float]:
    """(forward s, backward s) of the third step of a 4-layer MLP at batch 128."""
    with _emulate(gpu, host) as rt:
        now = rt.engine.now
        layers: list[torch.nn.Module] = []
        for _ in range(4):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers).cuda()
        x = torch.empty(128, 1024, device="cuda")
        fwd = bwd = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = now()
            loss = model(x).sum()
            torch.cuda.synchronize()
            t1 = now()
            loss.backward()
            torch.cuda.synchronize()
            fwd, bwd = t1 - t0, now() - t1
            model.zero_grad()
    return fwd, bwd


def unsynced(host: str, n: int = 4000) -> tuple[float, float]:
    """(host s issuing ``n`` small kernels, s the synchronize() after them waited), A100."""
    with _emulate("A100", host) as rt:
        now = rt.engine.now
        x = torch.empty(1024, 1024, device="cuda")
        torch.cuda.synchronize()
        t0 = now()
        for _ in range(n):
            x = x * 2
        t1 = now()
        torch.cuda.synchronize()
        return t1 - t0, now() - t1


def optimizer_step(host: str, make: Callable[[list], torch.optim.Optimizer]) -> float:
    """Seconds of the third step of an optimizer over 300 tensors of 4,096 elements, A100."""
    with _emulate("A100", host) as rt:
        now = rt.engine.now
        params = [torch.nn.Parameter(torch.empty(4096, device="cuda")) for _ in range(300)]
        opt = make(params)
        took = 0.0
        for _ in range(3):
            for p in params:
                p.grad = torch.zeros_like(p)
            torch.cuda.synchronize()
            t0 = now()
            opt.step()
            torch.cuda.synchronize()
            took = now() - t0
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default="none,this,h100-xeon", help="gpemu run --host values, comma separated")
    a = p.parse_args()
    hosts = a.hosts.split(",")
    print(f"machine: {machine()}; torch {torch.__version__}")
    print(f"{'host':10} {'gpu':5} {'MLP fwd us':>10} {'bwd us':>8} {'bwd/fwd':>8}")
    for host in hosts:
        for gpu in ("A100", "H100"):
            fwd, bwd = mlp(gpu, host)
            print(f"{host:10} {gpu:5} {fwd * 1e6:10.1f} {bwd * 1e6:8.1f} {bwd / fwd:8.2f}", flush=True)
    print(f"\n{'host':10} {'4000 kernels: issue ms':>23} {'sync waits ms':>14}")
    for host in hosts:
        issue, wait = unsynced(host)
        print(f"{host:10} {issue * 1e3:23.2f} {wait * 1e3:14.2f}", flush=True)
    print(f"\n{'host':10} {'AdamW x300 per-tensor ms':>25} {'foreach':>8} {'fused':>8}")
    makers = (
        lambda ps: torch.optim.AdamW(ps, foreach=False),
        lambda ps: torch.optim.AdamW(ps),
        lambda ps: torch.optim.AdamW(ps, fused=True),
    )
    for host in hosts:
        per_tensor, foreach, fused = (optimizer_step(host, make) for make in makers)
        print(f"{host:10} {per_tensor * 1e3:25.3f} {foreach * 1e3:8.3f} {fused * 1e3:8.3f}", flush=True)


if __name__ == "__main__":
    main()

"""Weak scaling of DDP on emulated GPUs: ResNet-50 (batch 64 per GPU, 224 x 224) and BERT-base
(batch 32 x 128 tokens per GPU) on 1, 2, 4 and 8 V100s / A100s / H100s (one DGX-like node,
NVLink/NVSwitch; `gpemu topo`), each size one process standing for its identical ranks
(`gpemu run --world-size N`, virtual time). Prints the throughput per GPU beside the single-GPU
one and the scaling efficiency (throughput of N GPUs / N x one GPU's).

    python benchmarks/weak_scaling.py                 # about 3 minutes on 2 busy cores
    python benchmarks/weak_scaling.py --gpus H100 --models bert
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1, 2, 4, 8)
BATCH = {"resnet50": 64, "bert": 32}


def _bert() -> object:
    """BERT-base's encoder shapes: 12 layers, 768 wide, 12 heads, FFN 3072, 30,522-token vocabulary."""
    from torch import nn

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(30522, 768)
            layer = nn.TransformerEncoderLayer(768, 12, 3072, activation="gelu", batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
            self.head = nn.Linear(768, 30522)

        def forward(self, tokens):  # noqa: ANN001, ANN202
            return self.head(self.encoder(self.embed(tokens)))

    return Bert()


def worker(model_name: str, steps: int) -> None:
    """One rank of the DDP job (run by `gpemu run`): prints samples/s per GPU."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(ROOT))
    from examples.tvmodels import resnet50

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    batch = BATCH[model_name]
    model = DDP((resnet50() if model_name == "resnet50" else _bert()).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if model_name == "resnet50":
        x, y = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))
    else:
        x = torch.randint(0, 30522, (batch, 128))
        y = torch.randint(0, 30522, (batch, 128))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(x.cuda(non_blocking=True))
        F.cross_entropy(out.flatten(0, -2), y.cuda(non_blocking=True).flatten()).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = times[2:]
    print(f"RESULT {batch * len(steady) / sum(steady):.1f}", flush=True)
    dist.destroy_process_group()


def measure(gpu: str, model_name: str, world: int, steps: int) -> float:
    command = ["gpemu", "run", "--gpu", gpu, "--gpus", "8", "--world-size", str(world), "--clock", "virtual"]
    command += ["--no-summary", "--", sys.executable, __file__, "--worker", model_name, "--steps", str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not found:
        raise SystemExit(f"{gpu} {model_name} x{world} failed:\n{done.stderr[-2000:]}")
    return float(found[0].split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=sorted(BATCH))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gpus", nargs="+", default=["V100", "A100", "H100"])
    ap.add_argument("--models", nargs="+", choices=sorted(BATCH), default=["resnet50", "bert"])
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    unit = {"resnet50": "images/s", "bert": "sequences/s"}
    for model_name in args.models:
        for gpu in args.gpus:
            single = measure(gpu, model_name, 1, args.steps)
            cells = [f"1 GPU {single:8.1f} {unit[model_name]}/GPU"]
            for world in SIZES[1:]:
                per_gpu = measure(gpu, model_name, world, args.steps)
                cells.append(f"{world}: {per_gpu:8.1f} ({per_gpu / single:4.0%})")
            print(f"{model_name:9s} {gpu:5s} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()

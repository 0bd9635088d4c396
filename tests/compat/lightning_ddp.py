"""Lightning: Trainer(accelerator="gpu", devices=2, strategy="ddp") on a small model, or one GPU.

    python lightning_ddp.py --steps 4
    python lightning_ddp.py --devices 1 --steps 4      # strategy "auto": one GPU, one process

With two devices Lightning starts the second rank itself (it re-runs this script). Prints, on
rank 0, "lightning: trained <N> steps, <X> ms/step".
"""

from __future__ import annotations

import argparse
import sys
import time

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.t0 = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    data = TensorDataset(torch.randn(64 * 2 * args.steps, 128), torch.randint(0, 10, (64 * 2 * args.steps,)))
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), DataLoader(data, batch_size=64, shuffle=True))
    if trainer.global_rank == 0:
        steady = timer.times[1:] or timer.times
        line = f"lightning: trained {trainer.global_step} steps, {1000 * sum(steady) / len(steady):.2f} ms/step\n"
        sys.stdout.write(line)  # in one write: other ranks' output shares the stream
        sys.stdout.flush()


if __name__ == "__main__":
    main()

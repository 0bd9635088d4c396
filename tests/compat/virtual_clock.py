"""What libraries build on the clocks, on virtual time: tqdm's rate, Hugging Face Trainer's
``train_runtime`` and Lightning's ``Timer``, each around a loop whose steps take 20 s of the
program's time (a sleep after the step's GPU work). Run under ``gpemu run --clock virtual``;
prints one JSON line with what each library measured and the real time the whole took.

    gpemu run --gpu A100 --clock virtual -- python tests/compat/virtual_clock.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch

STEPS, STEP_S = 3, 20.0
REAL_START = time.process_time()  # (CPU seconds: a clock the run does not replace)


def with_tqdm() -> dict:
    from tqdm import tqdm

    bar = tqdm(range(STEPS), file=sys.stderr, mininterval=0)
    for _ in bar:
        torch.ones(8, device="cuda").sum().item()
        time.sleep(STEP_S)
    info = bar.format_dict
    bar.close()
    return {"elapsed": info["elapsed"], "rate": STEPS / info["elapsed"]}


def with_hf_trainer() -> float:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            time.sleep(STEP_S)

    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    data = [{"input_ids": torch.randint(0, 256, (32,)), "labels": torch.randint(0, 256, (32,))} for _ in range(16)]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    result = Trainer(model=model, args=args, train_dataset=data, callbacks=[Slow()]).train()
    return float(result.metrics["train_runtime"])


def with_lightning() -> float:
    import lightning as L
    from lightning.pytorch.callbacks import Timer

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            return self.layer(batch).sum()

        def on_train_batch_end(self, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            time.sleep(STEP_S)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.1)

    timer = Timer()
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="gpu",
        devices=1,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4))
    return float(timer.time_elapsed("train"))


def main() -> None:
    out = {"tqdm": with_tqdm(), "hf_train_runtime": with_hf_trainer(), "lightning_train": with_lightning()}
    out["cpu_s"] = time.process_time() - REAL_START
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""Hugging Face Trainer on a tiny model built from its config (no downloads), under torchrun.

    HF_HUB_OFFLINE=1 torchrun --nproc-per-node 2 hf_trainer.py --model gpt2 --steps 4
    HF_HUB_OFFLINE=1 torchrun --nproc-per-node 2 hf_trainer.py --model bert --steps 4
    HF_HUB_OFFLINE=1 python hf_trainer.py --model gpt2,bert --steps 4        # one GPU, both models
    HF_HUB_OFFLINE=1 python hf_trainer.py --model llama --lora --gradient-checkpointing --bf16

Models: gpt2, bert, and the decoder families fine-tuned most (llama, mistral, qwen2: grouped-query
attention, RMSNorm, rotary embeddings, SwiGLU), each a tiny config. ``--lora`` wraps the model in
PEFT's LoRA (adapters on the attention projections: only they train), ``--gradient-checkpointing``
is the Trainer's own switch. Prints, on rank 0, "hf-<model>: trained <N> steps, <X> ms/step" per
model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

MODELS = ("gpt2", "bert", "llama", "mistral", "qwen2")
# tiny decoder configs of each family: 8 query heads over 2 key/value heads (grouped-query attention)
DECODERS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


class Tokens(Dataset):
    """Random token ids with a padded tail (an attention mask of zeros at the end)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.mask = torch.ones(n, seq, dtype=torch.long)
        self.mask[:, seq - 8 :] = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.ids[i]}


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2", help=f"one or several (comma-separated) of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA adapters on the attention projections")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    models = args.model.split(",")
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--model must be one or several of {', '.join(MODELS)}; got {args.model!r}")
    for name in models:
        train(name, args)


def build(name: str) -> torch.nn.Module:
    """A tiny model of the family ``name``, built from its config (random weights)."""
    if name in DECODERS:
        config = DECODERS[name](
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        return AutoModelForCausalLM.from_config(config)
    if name == "gpt2":
        config = GPT2Config(vocab_size=1024, n_positions=128, n_embd=128, n_layer=2, n_head=4)
        return GPT2LMHeadModel(config)
    config = BertConfig(
        vocab_size=1024,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=128,
    )
    return BertForMaskedLM(config)


def train(name: str, args: argparse.Namespace) -> None:
    steps = args.steps
    model = build(name)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            max_steps=steps,
            learning_rate=1e-4,
            logging_steps=2,
            save_strategy="no",
            report_to=[],
            fp16=args.fp16,
            bf16=args.bf16,
            gradient_checkpointing=args.gradient_checkpointing,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training, train_dataset=Tokens(8 * 2 * steps, 64, 1024), callbacks=[timer])
        result = trainer.train()
    if trainer.is_world_process_zero():
        steady = timer.times[1:] or timer.times
        line = f"hf-{name}: trained {result.global_step} steps, {1000 * sum(steady) / len(steady):.2f} ms/step\n"
        sys.stdout.write(line)  # in one write: other ranks' output shares the stream
        sys.stdout.flush()


if __name__ == "__main__":
    main()

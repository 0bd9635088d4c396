"""Single-GPU training patterns that real scripts use, each an ordinary loop on one GPU.

    python single_gpu.py --cases all --steps 4
    python single_gpu.py --cases amp-fp16,checkpoint --steps 10

Cases (each its own small model and optimizer):

- ``optimizer-first``: the optimizer is built over the CPU model, then ``model.to("cuda")``
  (accelerate's ``prepare``, minGPT, the DDP tutorials); a LambdaLR schedule and an EMA copy
  of the weights hold the same parameters.
- ``amp-fp16``: ``torch.autocast("cuda", torch.float16)`` + ``torch.amp.GradScaler``.
- ``amp-bf16``: ``torch.autocast("cuda", torch.bfloat16)``, TF32 matmuls allowed.
- ``checkpoint``: ``torch.utils.checkpoint`` with ``use_reentrant=False`` around each block.
- ``checkpoint-reentrant``: the same with ``use_reentrant=True``.
- ``sliced-inputs``: an LSTM language model fed ``source[i:i + bptt]`` slices of one token
  tensor on the GPU (pytorch/examples word_language_model).
- ``transformer-mask``: ``nn.TransformerEncoder`` with a causal mask cached on first use and
  a padding mask, and a forward that branches on a device-made value.
- ``sdpa``: a GPT-style block calling ``F.scaled_dot_product_attention(is_causal=True)`` at a
  sequence of 1024.
- ``amp-resnet18``: a ResNet-18 (examples/tvmodels/, torchvision's architecture) trained with
  bf16 autocast and channels-last inputs.

Prints "<case>: trained <N> steps, <X> ms/step" per case (wall time after the first step,
ending with ``torch.cuda.synchronize()``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEVICE = "cuda"


class Block(nn.Module):
    """A pre-norm transformer block with SDPA attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(
        self,
        vocab: int = 512,
        width: int = 128,
        layers: int = 2,
        heads: int = 4,
        seq: int = 128,
        wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.wrap = wrap

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = self.wrap(block, x) if self.wrap is not None else block(x)
        return self.head(self.ln(x))


def gpt_steps(
    model: nn.Module,
    batch: int,
    seq: int,
    vocab: int,
    steps: int,
    *,
    dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> Iterator[None]:
    """Next-token training steps, optionally under autocast(dtype) with a GradScaler."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, vocab, (batch, seq + 1))
    for _ in range(steps):
        idx, target = data[:, :-1].to(DEVICE), data[:, 1:].to(DEVICE)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(idx).flatten(0, 1), target.flatten())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        yield


def optimizer_first(steps: int) -> Iterator[None]:
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    ema = copy.deepcopy(model)
    model.to(DEVICE)
    ema.to(DEVICE)
    first = next(model.parameters())
    if first is not opt.param_groups[0]["params"][0] or first.device.type != "cuda":
        raise SystemExit("optimizer-first: the optimizer does not hold the model's parameters after .to('cuda')")
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for _ in range(steps):
        loss = F.cross_entropy(model(x.to(DEVICE)), y.to(DEVICE))
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=False):
                e.lerp_(p, 0.01)
        yield


def amp_fp16(steps: int) -> Iterator[None]:
    model = TinyGPT().to(DEVICE)
    return gpt_steps(model, 8, 128, 512, steps, dtype=torch.float16, scaler=torch.amp.GradScaler("cuda"))


def amp_bf16(steps: int) -> Iterator[None]:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = TinyGPT().to(DEVICE)
    return gpt_steps(model, 8, 128, 512, steps, dtype=torch.bfloat16)


def checkpointed(reentrant: bool) -> Callable[[int], Iterator[None]]:
    def run(steps: int) -> Iterator[None]:
        def wrap(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(block, x, use_reentrant=reentrant)

        model = TinyGPT(wrap=wrap).to(DEVICE)
        return gpt_steps(model, 8, 128, 512, steps)

    return run


class WordLM(nn.Module):
    def __init__(self, vocab: int = 1000, width: int = 128) -> None:
        super().__init__()
        self.embed, self.rnn = nn.Embedding(vocab, width), nn.LSTM(width, width, num_layers=2)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        out, hidden = self.rnn(self.embed(x), hidden)
        return self.decoder(out), hidden


def sliced_inputs(steps: int, bptt: int = 35, batch: int = 20) -> Iterator[None]:
    model = WordLM().to(DEVICE)
    source = torch.randint(0, 1000, (bptt * (steps + 1) + 1, batch)).to(DEVICE)  # batchify's layout
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    hidden = tuple(torch.zeros(2, batch, 128, device=DEVICE) for _ in range(2))
    for i in range(0, bptt * steps, bptt):
        data, target = source[i : i + bptt], source[i + 1 : i + 1 + bptt].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        out, hidden = model(data, hidden)
        loss = F.cross_entropy(out.view(-1, 1000), target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        yield


class MaskedEncoder(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.causal: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        if self.causal is None or self.causal.shape[0] != idx.shape[1]:  # cached on first use
            t = idx.shape[1]
            self.causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)
        x = self.embed(idx)
        if bool((padding.new_ones(3) == 1).all()):  # data-dependent Python on a device-made value
            x = x * 2.0
        return self.head(self.encoder(x, mask=self.causal, src_key_padding_mask=padding, is_causal=True))


def transformer_mask(steps: int) -> Iterator[None]:
    model = MaskedEncoder().to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 512, (8, 64))
    padding = torch.zeros(8, 64, dtype=torch.bool)
    padding[:, 56:] = True
    for _ in range(steps):
        logits = model(idx.to(DEVICE), padding.to(DEVICE))
        loss = F.cross_entropy(logits.flatten(0, 1), idx.to(DEVICE).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        yield


def sdpa(steps: int) -> Iterator[None]:
    model = TinyGPT(vocab=1024, width=256, layers=2, heads=4, seq=1024).to(DEVICE)
    return gpt_steps(model, 4, 1024, 1024, steps)


def amp_resnet18(steps: int) -> Iterator[None]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import tvmodels

    model = tvmodels.resnet18().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 3, 224, 224), torch.randint(0, 1000, (32,))
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x.to(DEVICE, memory_format=torch.channels_last)), y.to(DEVICE))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield


CASES: dict[str, Callable[[int], Iterator[None]]] = {
    "optimizer-first": optimizer_first,
    "amp-fp16": amp_fp16,
    "amp-bf16": amp_bf16,
    "checkpoint": checkpointed(False),
    "checkpoint-reentrant": checkpointed(True),
    "sliced-inputs": sliced_inputs,
    "transformer-mask": transformer_mask,
    "sdpa": sdpa,
    "amp-resnet18": amp_resnet18,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="all", help=f"comma-separated: all or {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown or args.steps < 2:
        parser.error(
            f"unknown case(s) {unknown}; valid: all, {', '.join(CASES)}" if unknown else "--steps must be >= 2"
        )
    torch.manual_seed(0)
    for name in names:
        times, steps = [], 0
        t0 = time.perf_counter()
        for _ in CASES[name](args.steps):
            torch.cuda.synchronize()
            steps += 1
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
        steady = times[1:]
        sys.stdout.write(f"{name}: trained {steps} steps, {1000 * sum(steady) / len(steady):.2f} ms/step\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""A GPT-2-small training step on an emulated GPU: step time and peak memory with and without
mixed precision and activation checkpointing.

    python benchmarks/transformer_step.py                      # A100, batch 8 x 1024 tokens
    python benchmarks/transformer_step.py --gpu H100 --precisions bf16 --checkpointing off
    python benchmarks/transformer_step.py --batch 4 --seq 512 --steps 6

transformers' own ``GPT2LMHeadModel`` (default config: 12 layers, 768 wide, 12 heads, 50,257-token
vocabulary; no download: the weights are made on the meta device and materialised on the emulated
GPU), AdamW, one configuration per process under ``gpemu.patch``. Each row is the last of
``--steps`` steps. The first records the model op by op; an HF model's output and its layers'
arguments hold a cache object, so replay settles level by level (model, blocks, attention:
about one level per step) and its submodules are replayed as units from about the fifth step
(the GPU time of every step is the same; the host time of the early ones is larger):

* **step ms**: emulated time of the whole step, from the synchronize before it to the one after
  it (what the script's own clock reads);
* **GPU busy ms**: the emulated GPU's busy time in that step (forward, backward, optimizer);
* **peak GiB**: ``torch.cuda.max_memory_allocated()`` in that step;
* **time from**: the model time's provenance as the run's summary gives it (``estimated``:
  priced op by op by the cost model, with its cross-validated uncertainty).

``--real`` runs the same steps on this machine's real CUDA GPU, unpatched (step ms and peak GiB
only), so the emulated rows can be compared with a real run of the same script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _common import machine

PRECISIONS = {"fp32": None, "tf32": None, "bf16": "bfloat16", "fp16": "float16"}


def _one(args: argparse.Namespace) -> None:
    """Run one configuration in this process and print its row as JSON."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import gpemu
    from gpemu.observe import model_source

    if not args.real:
        gpemu.patch(gpu=args.gpu)
    from transformers import GPT2Config, GPT2LMHeadModel

    if args.precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    cfg = GPT2Config(n_positions=max(1024, args.seq))
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    model = model.to_empty(device="cuda")
    if args.checkpointing == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    dtype = PRECISIONS[args.precision]
    rt = None if args.real else gpemu.current()
    row: dict = {}
    for _ in range(args.steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        n0 = len(rt.recorder.spans) if rt else 0
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=getattr(torch, dtype) if dtype else torch.float32, enabled=dtype is not None):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step = time.perf_counter() - t0
        busy = sum(s.end - s.start for s in rt.recorder.spans[n0:]) if rt else float("nan")
        row = {"step_ms": 1e3 * step, "busy_ms": 1e3 * busy, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    if rt:
        models = gpemu.summary().get("models", [])
        row["time_from"] = "; ".join(dict.fromkeys(model_source(m) for m in models)) or "-"
    else:
        row["time_from"] = f"real {torch.cuda.get_device_name()}"
    print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="A100", help="emulated GPU (default A100)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--steps", type=int, default=8, help="steps per configuration; the last is reported (default 8)")
    p.add_argument(
        "--precisions", default="fp32,tf32,bf16,fp16", help=f"comma-separated, of {', '.join(PRECISIONS)} (default all)"
    )
    p.add_argument("--checkpointing", default="off,on", help="off, on or off,on (default both)")
    p.add_argument(
        "--real",
        action="store_true",
        help="run unpatched on this machine's real CUDA GPU (to compare with the emulated rows)",
    )
    p.add_argument("--precision", help=argparse.SUPPRESS)  # one configuration (internal)
    args = p.parse_args()
    if args.precision:
        _one(args)
        return
    precisions = [x for x in args.precisions.split(",") if x]
    bad = [x for x in precisions if x not in PRECISIONS]
    ckpts = [x for x in args.checkpointing.split(",") if x]
    if bad or not precisions or any(c not in ("off", "on") for c in ckpts) or not ckpts:
        p.error(f"--precisions takes {', '.join(PRECISIONS)}; --checkpointing takes off, on")
    if args.real:
        import torch

        if not torch.cuda.is_available():
            p.error("--real runs the steps on this machine's CUDA GPU, and torch sees none here")
    where = "this machine's real GPU" if args.real else f"an emulated {args.gpu}"
    print(f"# GPT-2 small ({args.batch} x {args.seq} tokens, AdamW) on {where}; machine: {machine()}")
    print("| precision | checkpointing | step ms | GPU busy ms | peak GiB | time from |")
    print("|---|---|---|---|---|---|")
    for prec in precisions:
        for ck in ckpts:
            cmd = [
                sys.executable,
                __file__,
                *(["--real"] if args.real else []),
                "--gpu",
                args.gpu,
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--steps",
                str(args.steps),
                "--precision",
                prec,
                "--checkpointing",
                ck,
            ]
            out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            rows = [ln[4:] for ln in out.stdout.splitlines() if ln.startswith("ROW ")]
            if out.returncode or not rows:
                print(
                    f"| {prec} | {ck} | failed (exit {out.returncode}) | | | {out.stdout.strip().splitlines()[-1:]} |"
                )
                continue
            r = json.loads(rows[-1])
            print(
                f"| {prec} | {ck} | {r['step_ms']:.1f} | {r['busy_ms']:.1f} | {r['peak_gib']:.2f} | {r['time_from']} |",
                flush=True,
            )
    print(f"# machine after: {machine()}")


if __name__ == "__main__":
    main()

"""Third-party training scripts run unmodified under ``gpemu run`` (issue 28's first paragraph):
the rows of ``benchmarks/compat_matrix.py --repos DIR`` (README.md here, "Third-party rows").

Their code is never part of this repository: each row names the public repository it comes from,
and the matrix runs it from a copy of that repository's snapshot (a git directory as the search
tool's ``fetch`` leaves it, ``owner+name/repo``, or a plain checkout ``name``), recording the commit
and the command line. Data is small and synthetic (``synthetic.py``), written where each script's
loader looks, so nothing is downloaded.

This file imports neither gpemu nor torch (the scripts run in their own processes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SYNTHETIC = HERE / "synthetic.py"

NANOGPT = "karpathy/nanoGPT"
TIMM = "huggingface/pytorch-image-models"
NANOCHAT = "karpathy/nanochat"
TITAN = "pytorch/torchtitan"
EXAMPLES = "pytorch/examples"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Data:
    """Synthetic data one row needs: ``synthetic.py KIND <repo>/DEST --count COUNT``."""

    kind: str
    dest: str = "."  # folder inside the repository copy
    count: int = 0


@dataclass(frozen=True)
class Row:
    """One script of a third-party repository, one command."""

    name: str
    what: str  # what the row shows, in the matrix
    repo: str  # owner/name on GitHub
    command: tuple[str, ...]  # after the interpreter (or torchrun): script and arguments, or -m module
    cwd: str = "."  # folder inside the repository the script runs in
    launcher: str = "python"  # "python" | "torchrun" (world processes, --standalone)
    world: int = 1
    gpu: str = "A100"
    gpus: int = 1
    data: tuple[Data, ...] = ()
    setup: tuple[tuple[str, ...], ...] = ()  # the repository's own preparation steps, without gpemu
    env: dict[str, str] = field(default_factory=dict)  # "{repo}" stands for the copy's folder
    done: str = ""  # a line the script prints only when it ran to the end (a regex)
    needs: tuple[str, ...] = ()  # modules the interpreter must have
    min_torch: str = ""  # the torch the repository's commit needs ("2.14": a newer interpreter)
    values: str = ""  # "real": the script branches on values (gpemu run --values real)
    after: str = ""  # the row whose output this one reads (its checkpoint): run first
    timeout: int = 600

    def resolved_env(self, repo_dir: Path) -> dict[str, str]:
        return {k: v.replace("{repo}", str(repo_dir)) for k, v in self.env.items()}


_EX_MNIST = Data("mnist", "data")
ROWS: tuple[Row, ...] = (
    Row(
        "nanogpt-train",
        "nanoGPT train.py, shakespeare_char config (compile, bf16 autocast, fused AdamW, checkpoint)",
        NANOGPT,
        (
            "train.py",
            "config/train_shakespeare_char.py",
            "--max_iters=20",
            "--eval_interval=10",
            "--eval_iters=5",
            "--log_interval=1",
            "--always_save_checkpoint=True",
        ),
        data=(Data("char-text"),),
        setup=(("data/shakespeare_char/prepare.py",),),
        done=r"^iter 20: loss",
        needs=("numpy",),
    ),
    Row(
        "nanogpt-sample",
        "nanoGPT sample.py from the checkpoint nanogpt-train wrote",
        NANOGPT,
        ("sample.py", "--out_dir=out-shakespeare-char", "--num_samples=3", "--max_new_tokens=100"),
        done=r"(?s)(^-{15}$.*){3}",
        after="nanogpt-train",
    ),
    Row(
        "nanogpt-bench",
        "nanoGPT bench.py, defaults (GPT-2 124M, batch 12 x 1024, real data, compile)",
        NANOGPT,
        ("bench.py",),
        data=(Data("token-files"),),
        done=r"time per iteration: [\d.]+ms",
    ),
    Row(
        "nanogpt-ddp",
        "nanoGPT train.py under torchrun, 2 GPUs (DDP, no_sync by require_backward_grad_sync, GPT-2 124M)",
        NANOGPT,
        (
            "train.py",
            "--batch_size=4",
            "--block_size=512",
            "--gradient_accumulation_steps=4",
            "--max_iters=10",
            "--eval_interval=5",
            "--eval_iters=2",
            "--log_interval=1",
        ),
        launcher="torchrun",
        world=2,
        gpus=2,
        data=(Data("token-files"),),
        done=r"^iter 10: loss",
    ),
    Row(
        "timm-train",
        "timm train.py resnet50 --amp --model-ema (short last validation batch)",
        TIMM,
        (
            "train.py",
            "--data-dir=imgs",
            "--model=resnet50",
            "-b=32",
            "--epochs=2",
            "--amp",
            "--model-ema",
            "--img-size=160",
            "--workers=2",
            "--log-interval=1",
            "--output=out",
            "--experiment=resnet50",
        ),
        data=(Data("image-folder", "imgs", 48),),
        done=r"\*\*\* Best metric",
        needs=("torchvision", "timm"),
    ),
    Row(
        "timm-validate",
        "timm validate.py resnet50 on timm-train's checkpoint, --amp (first no_grad call at a batch size)",
        TIMM,
        (
            "validate.py",
            "--data-dir=imgs/validation",
            "--model=resnet50",
            "-b=32",
            "--amp",
            "--workers=2",
            "--checkpoint=out/resnet50/model_best.pth.tar",
        ),
        after="timm-train",
        done=r"\* Acc@1",
        needs=("torchvision", "timm"),
    ),
    Row(
        "timm-train-vit",
        "timm train.py vit_small_patch16_224 --amp, 1 epoch",
        TIMM,
        (
            "train.py",
            "--data-dir=imgs",
            "--model=vit_small_patch16_224",
            "-b=16",
            "--epochs=1",
            "--amp",
            "--workers=2",
            "--output=out",
            "--experiment=vit",
        ),
        data=(Data("image-folder", "imgs", 48),),
        done=r"\*\*\* Best metric",
        needs=("torchvision", "timm"),
    ),
    Row(
        "timm-validate-vit",
        "timm validate.py ViT (inference_mode views) on timm-train-vit's checkpoint",
        TIMM,
        (
            "validate.py",
            "--data-dir=imgs/validation",
            "--model=vit_small_patch16_224",
            "-b=16",
            "--amp",
            "--workers=2",
            "--checkpoint=out/vit/model_best.pth.tar",
        ),
        after="timm-train-vit",
        done=r"\* Acc@1",
        needs=("torchvision", "timm"),
    ),
    Row(
        "timm-benchmark",
        "timm benchmark.py resnet50 --bench both --amp (inference_mode, then training)",
        TIMM,
        ("benchmark.py", "--model=resnet50", "--bench=both", "-b=32", "--amp", "--num-warm-iter=2"),
        done=r"Train benchmark of resnet50 done",
        needs=("torchvision", "timm"),
    ),
    Row(
        "nanochat-base-train",
        "nanochat scripts.base_train, depth 4 (Muon + AdamW, sliding-window GQA attention, compile)",
        NANOCHAT,
        (
            "-m",
            "scripts.base_train",
            "--depth=4",
            "--num-iterations=10",
            "--device-batch-size=4",
            "--max-seq-len=512",
            "--total-batch-size=16384",
            "--eval-every=5",
            "--eval-tokens=8192",
            "--core-metric-every=-1",
            "--sample-every=-1",
        ),
        gpu="H100",
        data=(Data("nanochat", "nanochat-base"),),
        setup=(("-m", "scripts.tok_train", "--max-chars=2000000", "--vocab-size=2048"),),
        env={"NANOCHAT_BASE_DIR": "{repo}/nanochat-base", **OFFLINE},
        done=r"step 00009/00010",
        needs=("pyarrow", "rustbpe", "tiktoken", "wandb"),
    ),
    Row(
        "torchtitan-llama3-1gpu",
        "torchtitan llama3_debugmodel, defaults (FlexAttention, CUDA graphs, FSDP2 on 1 rank), 10 steps",
        TITAN,
        ("-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel"),
        launcher="torchrun",
        gpu="H100",
        data=(Data("c4-test"),),
        env=OFFLINE,
        done=r"step: 10 ",
        needs=("tyro", "grain", "datasets", "tokenizers", "torch_checkpointing", "spmd_types"),
        min_torch="2.14",
    ),
    Row(
        "torchtitan-llama3-fsdp2",
        "torchtitan llama3_debugmodel on 2 ranks (FSDP2 dp_shard=2), defaults, 10 steps",
        TITAN,
        ("-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel"),
        launcher="torchrun",
        world=2,
        gpu="H100",
        gpus=2,
        data=(Data("c4-test"),),
        env=OFFLINE,
        done=r"step: 10 ",
        needs=("tyro", "grain", "datasets", "tokenizers", "torch_checkpointing", "spmd_types"),
        min_torch="2.14",
    ),
    Row(
        "examples-vae",
        "pytorch/examples vae",
        EXAMPLES,
        ("main.py", "--epochs=1"),
        cwd="vae",
        data=(_EX_MNIST,),
        done=r"====> Test set loss",
        needs=("torchvision",),
    ),
    Row(
        "examples-siamese",
        "pytorch/examples siamese_network",
        EXAMPLES,
        ("main.py", "--epochs=1"),
        cwd="siamese_network",
        data=(_EX_MNIST,),
        done=r"Test set: Average loss",
        needs=("torchvision",),
    ),
    Row(
        "examples-super-resolution",
        "pytorch/examples super_resolution (PSNR from the loss: needs values)",
        EXAMPLES,
        ("main.py", "--upscale_factor=3", "--batchSize=4", "--testBatchSize=4", "--nEpochs=1", "--accel"),
        cwd="super_resolution",
        data=(Data("bsds300", "super_resolution/dataset"),),
        done=r"Checkpoint saved to",
        needs=("torchvision", "six"),
        values="real",
    ),
    Row(
        "examples-mnist-hogwild",
        "pytorch/examples mnist_hogwild --cuda (a shared CUDA model, 2 spawned processes)",
        EXAMPLES,
        ("main.py", "--cuda", "--epochs=1", "--num-processes=2"),
        cwd="mnist_hogwild",
        data=(_EX_MNIST,),
        done=r"Test set: Average loss",
        needs=("torchvision",),
    ),
    Row(
        "examples-fast-neural-style",
        "pytorch/examples fast_neural_style train (VGG-16 loss network)",
        EXAMPLES,
        (
            "neural_style/neural_style.py",
            "train",
            "--dataset=fns-data/train",
            "--save-model-dir=fns-models",
            "--epochs=1",
            "--accel",
            "--log-interval=4",
        ),
        cwd="fast_neural_style",
        data=(Data("image-folder", "fast_neural_style/fns-data", 16), Data("vgg16", "torch-home")),
        env={"TORCH_HOME": "{repo}/torch-home"},
        done=r"Done, trained model saved",
        needs=("torchvision",),
    ),
    Row(
        "examples-mnist-forward-forward",
        "pytorch/examples mnist_forward_forward",
        EXAMPLES,
        ("main.py", "--epochs=20", "--train_size=2048", "--test_size=512"),
        cwd="mnist_forward_forward",
        data=(Data("mnist", "mnist_forward_forward/data"),),
        done=r"test error:",
        needs=("torchvision",),
    ),
    Row(
        "examples-rpc-pipeline",
        "pytorch/examples distributed/rpc/pipeline (ResNet-50 in two RPC shards on cuda:0 and cuda:1)",
        EXAMPLES,
        ("main.py",),
        cwd="distributed/rpc/pipeline",
        gpus=2,
        done=r"number of splits = 8, execution time",
        needs=("torchvision",),
    ),
)


def by_name(name: str) -> Row:
    for r in ROWS:
        if r.name == name:
            return r
    raise KeyError(f"no third-party row {name!r}; rows: {', '.join(r.name for r in ROWS)}")


# -- the repositories ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """Where a repository's snapshot is: a git directory (no work tree) or a checkout."""

    repo: str
    path: Path
    bare: bool  # a git directory: files come from its HEAD

    def commit(self) -> str:
        args = ["git", f"--git-dir={self.path}"] if self.bare else ["git", "-C", str(self.path)]
        out = subprocess.run([*args, "rev-parse", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else "unknown (not a git checkout)"


def find_source(repo: str, folders: list[Path]) -> Source | None:
    """``repo``'s snapshot in one of ``folders``: ``owner+name/repo`` (fetch's git directory),
    ``owner+name`` or ``name`` (a checkout)."""
    owner, name = repo.split("/")
    for folder in folders:
        for candidate in (folder / f"{owner}+{name}" / "repo", folder / f"{owner}+{name}", folder / name):
            if (candidate / "HEAD").is_file() and (candidate / "objects").is_dir():
                return Source(repo, candidate, bare=True)
            if candidate.is_dir() and any(candidate.iterdir()):
                return Source(repo, candidate, bare=False)
    return None


def copy_out(source: Source, dest: Path) -> list[str]:
    """The snapshot's files in ``dest`` (HEAD of a git directory; blobs a partial snapshot lacks are
    skipped and returned: large data files, never code the rows run)."""
    if not source.bare:
        shutil.copytree(source.path, dest, ignore=shutil.ignore_patterns(".git"))
        return []
    git = ["git", f"--git-dir={source.path}"]
    listing = subprocess.run([*git, "ls-tree", "-r", "-z", "HEAD"], capture_output=True, check=True).stdout
    missing = []
    for entry in listing.split(b"\0"):
        if not entry:
            continue
        meta, path = entry.decode().split("\t", 1)
        mode, kind, sha = meta.split()
        if kind != "blob" or mode == "120000":
            continue
        blob = subprocess.run([*git, "cat-file", "blob", sha], capture_output=True)
        if blob.returncode != 0:
            missing.append(path)
            continue
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob.stdout)
        if mode == "100755":
            target.chmod(0o755)
    return missing


# -- one row -------------------------------------------------------------------------------------
@dataclass
class RowResult:
    """What one run of a row showed."""

    row: Row
    returncode: int
    output: str
    wall_s: float
    metrics: list[dict[str, Any]]  # the main process's first, then other ranks' and children's

    @property
    def works(self) -> bool:
        return self.returncode == 0 and bool(re.search(self.row.done, self.output, re.M))


def interpreter_facts(python: str, modules: tuple[str, ...]) -> dict[str, Any]:
    """The interpreter's torch version, which of ``modules`` it lacks, and whether its gpemu has
    the value mode."""
    code = (
        "import importlib.util, json, sys; mods = sys.argv[1:]; "
        "import torch; print(json.dumps({'torch': torch.__version__, "
        "'missing': [m for m in mods if importlib.util.find_spec(m) is None]}))"
    )
    # run where no gpemu checkout is (``-m`` puts the working folder first on sys.path): the rows
    # run in the repositories' copies, with the gpemu the interpreter itself imports
    elsewhere = tempfile.gettempdir()
    out = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, cwd=elsewhere)
    facts: dict[str, Any] = json.loads(out.stdout) if out.returncode == 0 else {"torch": "?", "missing": list(modules)}
    helptext = subprocess.run(
        [python, "-m", "gpemu.cli", "run", "--help"], capture_output=True, text=True, cwd=elsewhere
    ).stdout
    facts["values"] = "--values" in helptext
    return facts


def why_not(row: Row, facts: dict[str, Any]) -> str | None:
    """Why ``row`` cannot run with this interpreter (None: it can)."""
    if facts["missing"]:
        return f"the interpreter lacks {', '.join(facts['missing'])} (pip install them)"
    if row.min_torch and _version(facts["torch"]) < _version(row.min_torch):
        return f"this commit of {row.repo} needs torch >= {row.min_torch}, the interpreter has {facts['torch']}"
    if row.values and not facts["values"]:
        return f"the script branches on values: it needs gpemu run --values {row.values}, which this gpemu lacks"
    return None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:2])


def command(row: Row, metrics: Path, python: str, facts: dict[str, Any]) -> list[str]:
    """``gpemu run ... -- <launcher> <script> <args>`` (through ``python``, so PATH does not matter)."""
    if row.launcher == "torchrun":
        launch = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={row.world}"]
    else:
        launch = [python]
    values = ["--values", row.values] if row.values and facts.get("values") else []
    gpemu = [python, "-m", "gpemu.cli", "run", "--gpu", row.gpu, "--gpus", str(row.gpus), *values]
    return [*gpemu, "--metrics", str(metrics), "--no-summary", "--", *launch, *row.command]


def prepare(row: Row, repo_dir: Path, python: str) -> None:
    """Write the row's synthetic data and run the repository's own preparation steps."""
    env = dict(os.environ, **row.resolved_env(repo_dir))
    for d in row.data:
        subprocess.run(
            [python, str(SYNTHETIC), d.kind, str(repo_dir / d.dest), "--count", str(d.count)],
            check=True,
            env=env,
        )
    for step in row.setup:
        subprocess.run([python, *step], cwd=repo_dir / row.cwd, check=True, env=env, capture_output=True)


def run(row: Row, repo_dir: Path, outdir: Path, python: str, facts: dict[str, Any]) -> RowResult:
    """Prepare and run ``row`` in its repository copy; its metrics files land in ``outdir``."""
    outdir.mkdir(parents=True, exist_ok=True)
    prepare(row, repo_dir, python)
    metrics = outdir / "metrics.json"
    env = dict(os.environ, **row.resolved_env(repo_dir))
    env.pop("GPEMU_METRICS", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            command(row, metrics, python, facts),
            cwd=repo_dir / row.cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=row.timeout,
        )
        code, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        code, output = -1, f"{exc.output or ''}\n(timed out after {row.timeout} s)"
    wall = time.perf_counter() - t0
    files = [metrics] + sorted(p for p in outdir.glob("metrics.*.json"))
    found = [json.loads(p.read_text()) for p in files if p.exists()]
    return RowResult(row, code, output if isinstance(output, str) else output.decode(), wall, found)


def provenance_line(row: Row, source: Source) -> str:
    """Repository, commit and command line of a row (what reproduces it)."""
    launch = "python" if row.launcher == "python" else f"torchrun --standalone --nproc-per-node={row.world}"
    where = f"cd {row.cwd} && " if row.cwd != "." else ""
    prepared = [f"synthetic.py {d.kind} {d.dest}" for d in row.data] + [
        f"{'cd ' + row.cwd + ' && ' if row.cwd != '.' else ''}python {' '.join(step)}" for step in row.setup
    ]
    return (
        f"{row.repo}@{source.commit()[:12]}: "
        + (f"[{'; '.join(prepared)}] " if prepared else "")
        + f"{where}gpemu run --gpu {row.gpu} --gpus {row.gpus}"
        + (f" --values {row.values}" if row.values else "")
        + f" -- {launch} {' '.join(row.command)}"
        + (f" (env {' '.join(f'{k}={v}' for k, v in row.env.items())})" if row.env else "")
    )


if __name__ == "__main__":  # (a listing, for a reader)
    for r in ROWS:
        sys.stdout.write(f"{r.name}: {r.repo} {' '.join(r.command)}\n")

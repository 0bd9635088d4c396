"""The compatibility scenarios: ordinary training scripts run under ``gpemu run`` (README.md here).

Both ``tests/test_compat_*.py`` and ``benchmarks/compat_matrix.py`` read :data:`SCENARIOS`; a
scenario is one command (one script, one launcher); it reports one or more *cases* (matrix
rows), each with the line ``<case>: trained <N> steps, <X> ms/step`` on rank 0.

This file imports neither gpemu nor torch (the scripts are run in their own processes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpemu.ports import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# "<case>: trained <N> steps, <X> ms/step" (X: the script's own wall time per step after the first)
# (not anchored at the end: other ranks' stderr shares the pipe and may continue the line)
RESULT_LINE = re.compile(r"^(?P<case>[\w.-]+): trained (?P<steps>\d+) steps, (?P<ms>\d+(?:\.\d+)?) ms/step", re.M)
# What the notes say about where the model's time comes from (docs/time.md, "What work costs").
MEASURED_NOTE = re.compile(
    r"(forward|backward) time from the profile database \((measured|interpolated|extrapolated)\)"
)
SCALED_NOTE = re.compile(r"(forward|backward) time scaled from the profile database")
ESTIMATED_NOTE = re.compile(
    r"time estimated by the cost model"
)  # model time only (an optimizer note says "estimated" too)


@dataclass(frozen=True)
class Case:
    """One matrix row a scenario reports."""

    name: str  # the case name the script prints
    client: str  # what the row is called in the matrix
    steps: int  # optimizer steps the script reports (and each rank's optimizer takes)


@dataclass(frozen=True)
class Scenario:
    """One command: ``gpemu run --gpu <gpu> --gpus <gpus> -- <launcher> <script> <args>``."""

    name: str
    script: str  # file in tests/compat/
    cases: tuple[Case, ...]
    args: tuple[str, ...] = ()  # the script's arguments
    launcher: str = "python"  # "python" | "torchrun" | "accelerate" (world processes)
    launch_args: tuple[str, ...] = ()  # the launcher's own options (before the script)
    world: int = 1  # processes (ranks); each writes its own metrics file
    gpu: str = "A100"
    gpus: int = 1  # emulated GPUs per process
    # where the models' forward/backward time comes from: "estimated" | "measured" | "scaled", or
    # several joined by "+" when the command trains several models (in provenance order)
    provenance: str = "estimated"
    comm: bool = False  # GPU communication expected (comm busy time > 0 on every rank)
    env: dict[str, str] = field(default_factory=dict)
    suite: bool = True  # run by the test suite (False: the matrix only)
    matrix: bool = True  # a row group of benchmarks/compat_matrix.py (False: the suite only)
    timeout: int = 300

    @property
    def steps(self) -> int:
        """Optimizer steps of each rank over the whole command."""
        return sum(c.steps for c in self.cases)


_OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "torch-parallel",
        "torch_parallel.py",
        (
            Case("ddp", "DistributedDataParallel(model, device_ids)(cpu_input), static graph, join", 4),
            Case("fsdp2", "FSDP2 fully_shard + MixedPrecisionPolicy (pytorch/examples FSDP2)", 4),
            Case("tp", "DTensor tensor parallelism (ColwiseParallel/RowwiseParallel, 2-rank mesh)", 4),
        ),
        args=("--cases", "ddp,fsdp2,tp", "--steps", "4"),
        launcher="torchrun",
        world=2,
        gpus=2,
        comm=True,
        matrix=False,
    ),
    # (the same cases one command each, so each matrix row has its own GPU time)
    Scenario(
        "ddp",
        "torch_parallel.py",
        (Case("ddp", "DistributedDataParallel(model, device_ids)(cpu_input), static graph, join", 5),),
        args=("--cases", "ddp", "--steps", "5"),
        launcher="torchrun",
        world=2,
        gpus=2,
        comm=True,
        suite=False,
    ),
    Scenario(
        "ddp-resnet50",
        "torch_parallel.py",
        (Case("ddp", "DistributedDataParallel, ResNet-50 batch 64 per GPU", 5),),
        args=("--cases", "ddp", "--steps", "5", "--ddp-arch", "resnet50", "--ddp-batch", "64"),
        launcher="torchrun",
        world=2,
        gpu="V100",
        gpus=2,
        comm=True,
        provenance="measured",
        suite=False,
    ),
    Scenario(
        "fsdp2",
        "torch_parallel.py",
        (Case("fsdp2", "FSDP2 fully_shard + MixedPrecisionPolicy", 5),),
        args=("--cases", "fsdp2", "--steps", "5"),
        launcher="torchrun",
        world=2,
        gpus=2,
        comm=True,
        suite=False,
    ),
    Scenario(
        "tp",
        "torch_parallel.py",
        (Case("tp", "DTensor tensor parallelism (Colwise/RowwiseParallel)", 5),),
        args=("--cases", "tp", "--steps", "5"),
        launcher="torchrun",
        world=2,
        gpus=2,
        comm=True,
        suite=False,
    ),
    Scenario(
        "lightning-ddp",
        "lightning_ddp.py",
        (Case("lightning", "Lightning strategy='ddp', 2 devices", 4),),
        args=("--steps", "4"),
        world=2,
        gpus=2,
        comm=True,
    ),
    Scenario(
        "accelerate-fp16",
        "accelerate_fp16.py",
        (Case("accelerate", "accelerate, 2 processes, fp16, shuffled DataLoader", 4),),
        args=("--steps", "4"),
        launcher="accelerate",
        launch_args=("--mixed_precision", "fp16"),
        world=2,
        gpus=2,
        comm=True,
    ),
    Scenario(
        "hf-trainer-gpt2",
        "hf_trainer.py",
        (Case("hf-gpt2", "HF Trainer, GPT-2 tiny config, torchrun x2", 4),),
        args=("--model", "gpt2", "--steps", "4"),
        launcher="torchrun",
        world=2,
        gpus=2,
        comm=True,
        env=_OFFLINE,
    ),
    Scenario(
        "hf-trainer-bert",
        "hf_trainer.py",
        (Case("hf-bert", "HF Trainer, BERT tiny config, torchrun x2", 4),),
        args=("--model", "bert", "--steps", "4"),
        launcher="torchrun",
        world=2,
        gpus=2,
        comm=True,
        env=_OFFLINE,
        suite=False,
    ),
    Scenario(
        "data-parallel",
        "data_parallel.py",
        (Case("data-parallel", "nn.DataParallel, 4 GPUs, ResNet-50-shaped, batch 256", 5),),
        args=("--arch", "resnet50", "--batch-size", "256", "--steps", "5"),
        gpu="V100",
        gpus=4,
        provenance="measured",
        suite=False,
    ),
    Scenario(
        "data-parallel-small",
        "data_parallel.py",
        (Case("data-parallel", "nn.DataParallel, 4 GPUs, ResNet-18, batch 32, 112 px", 3),),
        args=("--arch", "resnet18", "--batch-size", "32", "--image-size", "112", "--steps", "3"),
        gpu="V100",
        gpus=4,
        provenance="measured",
    ),
)


_DECODERS = ("llama", "mistral", "qwen2")
_SINGLE = (
    ("optimizer-first", "optimizer built before model.to('cuda'), LambdaLR, EMA copy"),
    ("amp-fp16", "autocast fp16 + GradScaler (GPT-style, SDPA)"),
    ("amp-bf16", "autocast bf16, TF32 allowed"),
    ("checkpoint", "activation checkpointing, use_reentrant=False"),
    ("checkpoint-reentrant", "activation checkpointing, use_reentrant=True"),
    ("sliced-inputs", "LSTM LM on source[i:i+35] slices (word_language_model)"),
    ("transformer-mask", "nn.TransformerEncoder, cached causal + padding masks, device-value branch"),
    ("sdpa", "scaled_dot_product_attention, sequence 1024"),
)
SCENARIOS += (
    # every single-GPU pattern in one process for the suite; one command each for the matrix rows
    Scenario(
        "single-gpu",
        "single_gpu.py",
        tuple(Case(n, c, 3) for n, c in _SINGLE)
        + (Case("amp-resnet18", "ResNet-18 (measured) under autocast bf16", 3),),
        args=("--cases", ",".join([n for n, _ in _SINGLE] + ["amp-resnet18"]), "--steps", "3"),
        provenance="scaled+estimated",
        matrix=False,
    ),
    *(
        Scenario(n, "single_gpu.py", (Case(n, c, 5),), args=("--cases", n, "--steps", "5"), suite=False)
        for n, c in _SINGLE
    ),
    Scenario(
        "amp-resnet18",
        "single_gpu.py",
        (Case("amp-resnet18", "ResNet-18 (measured) under autocast bf16", 5),),
        args=("--cases", "amp-resnet18", "--steps", "5"),
        provenance="scaled",
        suite=False,
    ),
    Scenario(
        "hf-trainer-1gpu",
        "hf_trainer.py",
        (
            Case("hf-gpt2", "HF Trainer, GPT-2 tiny config, 1 GPU", 4),
            Case("hf-bert", "HF Trainer, BERT tiny config, 1 GPU", 4),
        ),
        args=("--model", "gpt2,bert", "--steps", "4"),
        env=_OFFLINE,
        matrix=False,
    ),
    Scenario(
        "hf-gpt2-1gpu",
        "hf_trainer.py",
        (Case("hf-gpt2", "HF Trainer, GPT-2 tiny config, 1 GPU", 5),),
        args=("--model", "gpt2", "--steps", "5"),
        env=_OFFLINE,
        suite=False,
    ),
    Scenario(
        "hf-bert-1gpu",
        "hf_trainer.py",
        (Case("hf-bert", "HF Trainer, BERT tiny config, 1 GPU", 5),),
        args=("--model", "bert", "--steps", "5"),
        env=_OFFLINE,
        suite=False,
    ),
    # the decoder families fine-tuned most, with PEFT LoRA and gradient checkpointing in bf16:
    # the three in one process for the suite, one command each for the matrix
    Scenario(
        "hf-decoders-lora",
        "hf_trainer.py",
        tuple(Case(f"hf-{m}", f"HF Trainer, {m} config, LoRA + gradient checkpointing, bf16", 2) for m in _DECODERS),
        args=("--model", ",".join(_DECODERS), "--lora", "--gradient-checkpointing", "--bf16", "--steps", "2"),
        env=_OFFLINE,
        matrix=False,
    ),
    *(
        Scenario(
            f"hf-{m}-lora",
            "hf_trainer.py",
            (Case(f"hf-{m}", f"HF Trainer, {m} config (GQA), PEFT LoRA + gradient checkpointing, bf16", 5),),
            args=("--model", m, "--lora", "--gradient-checkpointing", "--bf16", "--steps", "5"),
            env=_OFFLINE,
            suite=False,
        )
        for m in _DECODERS
    ),
    Scenario(
        "hf-llama-lora-ddp",
        "hf_trainer.py",
        (Case("hf-llama", "HF Trainer, llama config, PEFT LoRA + gradient checkpointing, bf16, torchrun x2", 4),),
        args=("--model", "llama", "--lora", "--gradient-checkpointing", "--bf16", "--steps", "4"),
        launcher="torchrun",
        world=2,
        gpus=2,
        comm=True,
        env=_OFFLINE,
        suite=False,
    ),
    Scenario(
        "accelerate-1proc",
        "accelerate_fp16.py",
        (Case("accelerate", "accelerate, 1 process, fp16, shuffled DataLoader", 4),),
        args=("--processes", "1", "--steps", "4"),
        env={"ACCELERATE_MIXED_PRECISION": "fp16"},
        suite=False,
    ),
    Scenario(
        "lightning-1gpu",
        "lightning_ddp.py",
        (Case("lightning", "Lightning, 1 GPU (strategy auto)", 4),),
        args=("--devices", "1", "--steps", "4"),
        suite=False,
    ),
)


def by_name(name: str) -> Scenario:
    for s in SCENARIOS:
        if s.name == name:
            return s
    raise KeyError(f"no scenario {name!r}; scenarios: {', '.join(s.name for s in SCENARIOS)}")


def command(s: Scenario, metrics: Path, python: str = sys.executable) -> list[str]:
    """The whole command line: gpemu run (through this interpreter), the launcher, the script."""
    script = str(HERE / s.script)
    if s.launcher == "python":
        launch = [python, script]
    elif s.launcher == "torchrun":
        launch = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={s.world}", script]
    elif s.launcher == "accelerate":
        launch = [
            python,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(s.world),
            "--num_machines",
            "1",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            script,
        ]
    else:
        raise ValueError(f"unknown launcher {s.launcher!r}")
    launch[-1:-1] = s.launch_args
    return [
        python,
        "-m",
        "gpemu.cli",
        "run",
        "--gpu",
        s.gpu,
        "--gpus",
        str(s.gpus),
        "--metrics",
        str(metrics),
        "--no-summary",
        "--",
        *launch,
        *s.args,
    ]


@dataclass
class Result:
    """What one run of a scenario showed."""

    scenario: Scenario
    returncode: int
    wall_s: float
    output: str
    cases: dict[str, tuple[int, float]]  # case -> (steps, the script's ms/step)
    metrics: list[dict[str, Any]]  # one per rank, rank order

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and all(self.cases.get(c.name, (None,))[0] == c.steps for c in self.scenario.cases)

    def iterations(self) -> list[int]:
        return [int(m.get("iterations") or 0) for m in self.metrics]

    def busy_by_kind(self, rank: int, window: str = "whole") -> dict[str, float]:
        """GPU busy time per kind over the rank's devices (seconds)."""
        out: dict[str, float] = {}
        for dev in self.metrics[rank].get("devices", []):
            for kind, seconds in ((dev.get(window) or {}).get("busy_by_kind_s") or {}).items():
                out[kind] = out.get(kind, 0.0) + seconds
        return out

    def gpu_ms_per_step(self) -> float | None:
        return gpu_ms_per_step(self.metrics)

    def provenance(self) -> str:
        return time_provenance(self.metrics)


def gpu_ms_per_step(metrics: list[dict[str, Any]]) -> float | None:
    """Emulated GPU busy time per step in the steady state (after the first step), the busiest
    device of any rank (``metrics``: each process's metrics file), not counting the time its
    collectives waited for a slower rank: a rank that waits while rank 0 evaluates and saves a
    checkpoint is busy on a real GPU too (NCCL's kernel spins), but that is the script's host
    work, not the step's price."""
    best = None
    for m in metrics:
        waited = float((m.get("communication") or {}).get("wait_s") or 0.0)
        for dev in m.get("devices", []):
            steady, its = dev.get("steady"), dev.get("iterations") or 0
            if steady and its > 1:
                comm = float(steady.get("busy_by_kind_s", {}).get("comm", 0.0))
                value = 1000 * (steady["busy_s"] - min(waited, comm)) / (its - 1)
                best = value if best is None else max(best, value)
    # Devices without iteration marks (DataParallel's replicas) share the step count of the
    # device that has them: compare their whole-run busy time per step.
    its = max((int(m.get("iterations") or 0) for m in metrics), default=0)
    if its:
        for m in metrics:
            for dev in m.get("devices", []):
                if not dev.get("iterations") and dev.get("whole"):
                    value = 1000 * dev["whole"]["busy_s"] / its
                    best = value if best is None else max(best, value)
    return best


def time_provenance(metrics: list[dict[str, Any]]) -> str:
    """Where the models' time came from, as the run's notes say ("+"-joined when several)."""
    notes = [n for m in metrics for n in m.get("notes", [])]
    found = [
        name
        for name, pattern in (("measured", MEASURED_NOTE), ("scaled", SCALED_NOTE), ("estimated", ESTIMATED_NOTE))
        if any(pattern.search(n) for n in notes)
    ]
    return "+".join(found) or "unknown"


# A race in torch's c10d/gloo teardown, outside gpemu: a rank that has finished (its result
# printed, its metrics written, the process group destroyed) aborts in the interpreter's
# finalization with this C++ message and SIGABRT. Plain accelerate on the CPU under torchrun,
# without gpemu, does it about once in ten runs on a loaded 2-core machine (2 of 20 measured;
# compare pytorch/pytorch#179291). Such a run is made once more; a second one fails the scenario.
EXIT_RACE = "terminate called without an active exception"


def run(s: Scenario, workdir: Path, python: str = sys.executable) -> Result:
    """Run a scenario in ``workdir`` (its metrics files land there); once more if the first run
    finished its work and then hit :data:`EXIT_RACE` at exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.json"
    env = dict(os.environ, **s.env)
    env.pop("GPEMU_METRICS", None)
    for attempt in (1, 2):
        t0 = time.perf_counter()
        proc = subprocess.run(
            command(s, metrics, python),
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=s.timeout,
        )
        wall = time.perf_counter() - t0
        cases = {m["case"]: (int(m["steps"]), float(m["ms"])) for m in RESULT_LINE.finditer(proc.stdout)}
        finished = all(cases.get(c.name, (None,))[0] == c.steps for c in s.cases)
        if proc.returncode == 0 or not finished or EXIT_RACE not in proc.stdout or attempt == 2:
            break
    ranks = []
    for rank in range(s.world):
        path = metrics if rank == 0 else workdir / f"metrics.rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {})
    return Result(s, proc.returncode, wall, proc.stdout, cases, ranks)

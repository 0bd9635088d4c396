"""DDP iteration time for 2..N GPUs, stored as kind ``ddp_iteration`` with the world size.

One process per GPU (``torch.multiprocessing.spawn``), NCCL between GPUs (gloo with
``--device cpu``, which makes this path testable without GPUs). Each recorded iteration is
forward + backward (with DDP's gradient all-reduce) + optimizer step on a per-GPU batch, timed
on every rank after a barrier; the iteration's time is the slowest rank's (what the next
iteration waits for). Rank 0 writes each (model, world size, batch size) in one transaction.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpemu.db import Measurement
from gpemu.ports import free_port

from .measure import summarize
from .models import load_model, model_name_of
from .runner import Interrupted, ProfileOptions, ProfileReport
from .store import ProfileStore, now_iso

__all__ = ["profile_ddp"]


def profile_ddp(
    store: ProfileStore,
    opts: ProfileOptions,
    world_sizes: Sequence[int],
    batch_sizes: Sequence[int],
    log: Callable[[str], None] = lambda msg: None,
) -> int:
    """Measure DDP iteration times; returns how many units were written."""
    import torch.multiprocessing as mp

    from .device import device_memory, device_name, run_metadata

    gpu = opts.gpu_name or device_name(opts.device)
    spec = store.gpu(gpu)
    if spec is None:
        raise ValueError(f"GPU {gpu!r} is not in the database; profile single-GPU times first")
    gpu = spec.name
    meta = run_metadata(opts.device, gpu, device_memory(opts.device, opts.memory_limit))
    written = 0
    try:
        for spec_text in opts.models:
            name = model_name_of(spec_text)
            limit = store.limit(gpu, name)
            for ws in world_sizes:
                todo = sorted(b for b in set(batch_sizes) if limit is None or b < limit.oom_batch_size)
                if not opts.force:
                    done = store.done_batch_sizes(gpu, name, "ddp_iteration", world_size=ws)
                    todo = [b for b in todo if b not in done]
                if not todo:
                    continue
                log(f"{name}: DDP on {ws} devices, batch sizes {', '.join(map(str, todo))}")
                job = {
                    "spec": spec_text,
                    "input_shape": opts.input_shape,
                    "input_dtype": str(opts.input_dtype),
                    "num_classes": opts.num_classes,
                    "warmup": opts.warmup,
                    "iterations": opts.iterations,
                    "optimizer": opts.optimizer,
                    "device_type": opts.device.type,
                    "batch_sizes": todo,
                    "world_size": ws,
                    "port": free_port(),
                    "db_url": store.db.url,
                    "gpu": gpu,
                    "model": name,
                    "meta": meta,
                }
                mp.spawn(_worker, args=(job,), nprocs=ws, join=True)
                written += len(todo)
    except KeyboardInterrupt:
        raise Interrupted(ProfileReport(gpu=gpu)) from None
    return written


def _worker(rank: int, job: dict[str, Any]) -> None:
    import torch.distributed as dist

    ws = job["world_size"]
    is_cuda = job["device_type"] == "cuda"
    if is_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # ranks share the host's cores
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if is_cuda else "gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=ws
    )
    try:
        _measure(rank, job, device, is_cuda)
        # DDP sits in reference cycles, so its reducer (and through it gloo's process group) would
        # otherwise die during interpreter shutdown, where gloo's threads were seen to abort the
        # rank ("terminate called without an active exception"). Collect it while all is alive,
        # then leave together; not in the error path, where a peer may be gone and a barrier hangs.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure(rank: int, job: dict[str, Any], device: torch.device, is_cuda: bool) -> None:
    """Time DDP iterations for each batch size; rank 0 writes them. Returns with nothing of DDP
    referenced from here (the caller collects it)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .models import parse_dtype

    ws = job["world_size"]
    lm = load_model(
        job["spec"], job["input_shape"], parse_dtype(job["input_dtype"].removeprefix("torch.")), job["num_classes"]
    )
    module = lm.module.to(device).train()
    model = DDP(module, device_ids=[rank] if is_cuda else None)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.01, momentum=0.9),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3),
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
    }[job["optimizer"]]()
    store = ProfileStore.open(job["db_url"]) if rank == 0 else None
    for bs in job["batch_sizes"]:
        inputs, targets = lm.make_batch(bs)
        x = inputs.to(device)
        y = targets.to(device) if targets is not None else None
        per_iter: list[float] = []
        for i in range(job["warmup"] + job["iterations"]):
            dist.barrier()
            if is_cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = lm.loss(model(x), y)
            loss.backward()
            opt.step()
            if is_cuda:
                torch.cuda.synchronize(device)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device if is_cuda else "cpu")
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            if i >= job["warmup"]:
                per_iter.append(float(elapsed.item()))
        if store is not None:
            s = summarize(per_iter)
            store.write_unit(
                [
                    Measurement(
                        gpu=job["gpu"],
                        model=job["model"],
                        kind="ddp_iteration",
                        batch_size=bs,
                        world_size=ws,
                        value=s.mean,
                        samples=s.count,
                        std=s.std,
                        p50=s.p50,
                        p90=s.p90,
                        p99=s.p99,
                        source="gpemu profile",
                        measured_at=now_iso(),
                        metadata={
                            **job["meta"],
                            "world_size": ws,
                            "per_gpu_batch_size": bs,
                            "backend": "nccl" if is_cuda else "gloo",
                            "min": s.min,
                            "max": s.max,
                            "what": "forward + backward (with all-reduce) + optimizer step, slowest rank",
                        },
                    )
                ]
            )
    if store is not None:
        store.close()

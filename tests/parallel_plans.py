"""A torchrun worker that runs tiny models under each parallelism plan, on torch's own APIs:
DDP, FSDP2, HSDP, tensor + sequence parallel, pipeline schedules (GPipe, 1F1B, interleaved
1F1B), context parallel, expert-parallel all-to-all, and asks for symmetric memory (async TP).

    gpemu run --gpu H100 --gpus 4 --clock virtual -- torchrun --nproc-per-node 4 tests/parallel_plans.py OUT [PLAN ...]

Each rank writes ``OUT.<rank>.json``: per plan, what it saw (shapes, devices, the charged
communication per collective kind, time waiting at pipeline receives) or the one-line error.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DIM = 64


def _counters() -> dict[str, float]:
    import gpemu

    rt = gpemu.current()
    return dict(rt.recorder.counters) if rt is not None else {}


def _comm_since(before: dict[str, float]) -> dict[str, float]:
    """Charged communication seconds per collective kind (all links) since ``before``."""
    out: dict[str, float] = {}
    for key, value in _counters().items():
        if key.startswith("comm_seconds/"):
            kind = key.split("/")[1]
            out[kind] = out.get(kind, 0.0) + value - before.get(key, 0.0)
    return {k: v for k, v in out.items() if v > 0}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)).cuda()


def _train(model: nn.Module, steps: int = 2, batch: int = 8) -> None:
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(steps):
        model(torch.randn(batch, 16, DIM, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()


def plan_ddp(world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _train(DDP(_mlp()))
    return {}


def plan_fsdp2(world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    _train(model)
    return {"local_shard": list(model[0].weight.to_local().shape)}


def plan_hsdp(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = _mlp()
    fully_shard(model, mesh=mesh)
    _train(model)
    return {"local_shard": list(model[0].weight.to_local().shape), "placements": str(model[0].weight.placements)}


def plan_tp_sp(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cuda", (world,))
    model = nn.Sequential(nn.LayerNorm(DIM), *_mlp()).cuda()
    parallelize_module(
        model,
        mesh,
        {
            "0": SequenceParallel(),
            "1": ColwiseParallel(input_layouts=torch.distributed.tensor.Shard(1)),
            "3": RowwiseParallel(output_layouts=torch.distributed.tensor.Shard(1)),
        },
    )
    _train(model)
    return {"local_shard": list(model[1].weight.to_local().shape)}


def _pipeline(world: int, schedule_name: str, stages_per_rank: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as sched

    rank = dist.get_rank()
    total = world * stages_per_rank
    # interleaved: rank r holds stages r, r + world, ... (the loop's order)
    indices = [rank + k * world for k in range(stages_per_rank)]
    stages = [
        PipelineStage(nn.Linear(DIM, DIM).cuda(), index, total, torch.device("cuda", torch.cuda.current_device()))
        for index in indices
    ]
    microbatches = 2 * world
    loss_fn = lambda out, target: F.mse_loss(out, target)  # noqa: E731
    cls = getattr(sched, schedule_name)
    schedule = cls(stages if stages_per_rank > 1 else stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    x = torch.randn(microbatches * 2, DIM, device="cuda")
    for _ in range(2):
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=torch.randn(microbatches * 2, DIM, device="cuda"))
        else:
            schedule.step()
    torch.cuda.synchronize()
    return {"stages": indices}


def plan_pp_gpipe(world: int) -> dict[str, Any]:
    return _pipeline(world, "ScheduleGPipe", 1)


def plan_pp_1f1b(world: int) -> dict[str, Any]:
    return _pipeline(world, "Schedule1F1B", 1)


def plan_pp_interleaved(world: int) -> dict[str, Any]:
    return _pipeline(world, "ScheduleInterleaved1F1B", 2)


def plan_cp(world: int) -> dict[str, Any]:
    """Context parallel: the sequence sharded over the ranks, ring attention inside SDPA."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world,))
    embed, qkv = nn.Embedding(100, DIM).cuda().bfloat16(), nn.Linear(DIM, 3 * DIM).cuda().bfloat16()
    # (torch shards the buffers in place: resize_ to the rank's shard)
    tokens = torch.randint(0, 100, (2, 32 * world), device="cuda")
    with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]):
        x = embed(tokens)
        q, k, v = (t.view(2, -1, 4, DIM // 4).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # (what an H100 runs for bf16)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        local = tokens.shape[1]
    torch.cuda.synchronize()
    return {"local_seq": local}


def plan_ep_all_to_all(world: int) -> dict[str, Any]:
    """Expert parallel: each rank's tokens to the ranks holding their experts and back."""
    tokens = torch.randn(16 * world, DIM, device="cuda")
    splits = [16] * world
    routed = torch.empty_like(tokens)
    dist.all_to_all_single(routed, tokens, splits, splits)
    expert = nn.Linear(DIM, DIM).cuda()
    back = torch.empty_like(tokens)
    dist.all_to_all_single(back, expert(routed), splits, splits)
    torch.cuda.synchronize()
    return {"tokens": list(back.shape)}


def plan_symmetric_memory(world: int) -> dict[str, Any]:
    from torch.distributed import _symmetric_memory as symm_mem

    symm_mem.empty(16, device="cuda")
    return {}


PLANS: dict[str, Callable[[int], dict[str, Any]]] = {
    name[len("plan_") :]: fn for name, fn in globals().items() if name.startswith("plan_")
}


def main() -> None:
    out, wanted = sys.argv[1], sys.argv[2:] or list(PLANS)
    faulthandler.dump_traceback_later(float(os.environ.get("PLANS_TIMEOUT_S", "240")), exit=True)  # a hang fails
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    world, results = dist.get_world_size(), {}
    for name in wanted:
        before, started = _counters(), time.perf_counter()
        try:
            seen = PLANS[name](world)
            seen["comm"] = _comm_since(before)
            seen["p2p_wait_s"] = _counters().get("comm_p2p_wait_seconds", 0.0) - before.get(
                "comm_p2p_wait_seconds", 0.0
            )
            seen["seconds"] = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - each plan's outcome is reported, the next runs
            if os.environ.get("PLANS_DEBUG"):
                raise
            seen = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        results[name] = seen
        dist.barrier()
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

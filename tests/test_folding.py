"""More GPUs than processes: one process stands for its identical peers (gpemu.distributed.folding).

In-process tests run a folded world on torch's fake process group; the end-to-end test runs two
real processes through `gpemu run --world-size 8 --processes 2`, each standing for four ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from gpemu.config import ConfigError, EmuConfig


def _folded(world: int, **settings: object):  # noqa: ANN202
    import torch.distributed as dist

    import gpemu
    from gpemu.clock import VirtualClock

    rt = gpemu.patch(gpu="H100", world_size=world, summary=False, clock=VirtualClock(), **settings)
    dist.init_process_group("nccl")
    return rt


def test_a_folded_world_gives_values_as_if_the_peers_existed() -> None:
    import torch.distributed as dist

    _folded(16)
    try:
        assert (dist.get_world_size(), dist.get_rank(), torch.cuda.device_count()) == (16, 0, 8)
        known = torch.tensor([1.0, 2.0], device="cuda")
        dist.all_reduce(known)
        assert known.tolist() == [16.0, 32.0]  # sixteen identical ranks' sum
        dist.all_reduce(known, op=dist.ReduceOp.AVG)
        assert known.tolist() == [16.0, 32.0]
        gathered = torch.empty(32, device="cuda")
        dist.all_gather_into_tensor(gathered, known)
        assert gathered.tolist() == [16.0, 32.0] * 16
        share = torch.empty(2, device="cuda")
        dist.reduce_scatter_tensor(share, torch.arange(32.0, device="cuda"))
        assert share.tolist() == [0.0, 16.0]  # rank 0's share of sixteen identical inputs' sum
        host = torch.tensor([3.0])  # a host tensor (a logged loss) too
        dist.all_reduce(host)
        assert host.tolist() == [48.0]
        work = dist.all_reduce(torch.ones(1), async_op=True)
        work.wait()
    finally:
        dist.destroy_process_group()


def test_a_folded_collective_is_priced_for_the_ranks_it_spans() -> None:
    """The world's all-reduce crosses the two nodes' NICs; a node's subgroup only NVLink; each
    costs what the cost model says for its ranks (not one process's)."""
    import torch.distributed as dist

    from gpemu.costmodel.comm import Collective, CommPath, collective_cost

    rt = _folded(16, cluster="dgx-h100", nodes=2)
    try:
        cluster = rt.placement.cluster
        node = dist.new_group(list(range(8)))
        nbytes = 64 * 2**20
        for group, nodes in ((None, [0] * 8 + [1] * 8), (node, [0] * 8)):
            before = dict(rt.recorder.counters)
            dist.all_reduce(torch.empty(nbytes // 4, device="cuda"), group=group)
            cost = collective_cost(Collective.ALL_REDUCE, nbytes, CommPath.of(cluster, nodes))
            key = f"comm_seconds/all_reduce/{cost.links}"
            assert rt.recorder.counters[key] - before.get(key, 0.0) == pytest.approx(cost.seconds)
        assert "ib" in collective_cost(Collective.ALL_REDUCE, 1, CommPath.of(cluster, [0, 1])).links
    finally:
        dist.destroy_process_group()


def test_fsdp2_memory_per_rank_is_what_one_rank_of_the_world_holds() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    held = {}
    for world in (4, 64):
        _folded(world)
        try:
            with torch.device("meta"):
                model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)))
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            model.to_empty(device="cuda")
            held[world] = torch.cuda.memory_allocated()
            model(torch.ones(8, 1024, device="cuda")).sum().backward()
        finally:
            dist.destroy_process_group()
            import gpemu

            gpemu.unpatch()
    assert held[4] == 4 * 1024 * 1024 * 4 // 4  # fp32 parameters, a quarter each
    assert held[64] == held[4] // 16


def test_ddp_in_a_folded_world_prices_its_all_reduce_for_every_rank() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    seconds = {}
    for world in (2, 16):
        rt = _folded(world)
        try:
            model = DDP(torch.nn.Linear(1024, 1024).cuda())
            model(torch.ones(8, 1024, device="cuda")).sum().backward()
            torch.cuda.synchronize()
            counters = rt.recorder.counters
            seconds[world] = sum(v for k, v in counters.items() if k.startswith("comm_seconds/all_reduce/"))
        finally:
            dist.destroy_process_group()
            import gpemu

            gpemu.unpatch()
    # the same 4 MB of gradients: a ring over 16 ranks (two nodes, their NICs) takes longer than over 2
    assert 0 < seconds[2] < seconds[16]


def test_fold_settings_are_checked_in_one_line() -> None:
    with pytest.raises(ConfigError, match="multiple of processes"):
        EmuConfig(world_size=10, processes=3)
    with pytest.raises(ConfigError, match="needs world_size"):
        EmuConfig(processes=2)
    with pytest.raises(ConfigError, match="give --nodes 16"):
        EmuConfig.from_env({}, cluster="dgx-h100", world_size=128)
    assert EmuConfig.from_env({"GPEMU_WORLD_SIZE": "128"}).num_gpus == 8  # nodes of 8 without a cluster


_TWO_STAGES = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    x = torch.full((4,), float(rank + 1), device="cuda")
    if rank == 0:
        dist.send(x, dst=4)  # stage 0 -> stage 1, another process
        got = None
    else:
        got = torch.empty(4, device="cuda")
        dist.recv(got, src=0)
        got = got.tolist()
    total = x.clone()
    dist.all_reduce(total)  # four copies of each process's value
    stage = dist.new_group(list(range(rank, rank + 4)))
    mine = x.clone()
    dist.all_reduce(mine, group=stage)  # inside one process's ranks: no message
    backends = [dist.get_backend(), dist.get_backend(stage)]  # (torch's pipeline schedules read them)
    json.dump({"rank": rank, "world": world, "got": got, "total": total.tolist(), "stage": mine.tolist(),
               "backends": backends}, open(sys.argv[1] + f".{rank}", "w"))
    dist.destroy_process_group()
    """
)


@pytest.mark.subprocess
def test_two_processes_stand_for_eight_ranks(tmp_path: Path) -> None:
    script = tmp_path / "two_stages.py"
    script.write_text(_TWO_STAGES)
    out = tmp_path / "result"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPEMU_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["GPEMU_DATA_DIR"] = os.environ["GPEMU_DATA_DIR"]
    done = subprocess.run(
        ["gpemu", "run", "--gpu", "A100", "--gpus", "4", "--world-size", "8"]
        + ["--processes", "2", "--no-summary", "--", "python", str(script), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "process 1 runs rank 4 and stands for ranks 4-7" in done.stderr
    first, second = (json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 4))
    assert first["world"] == second["world"] == 8
    assert second["got"] == [1.0] * 4  # stage 0's values reached stage 1
    assert first["total"] == second["total"] == [4 * 1.0 + 4 * 5.0] * 4  # ranks 0-3 hold 1, ranks 4-7 hold 5
    assert first["stage"] == [4.0] * 4 and second["stage"] == [20.0] * 4
    # the world's messages cross processes over gloo; a group inside one process's ranks sends none
    assert first["backends"] == second["backends"] == ["gloo", "fake"]

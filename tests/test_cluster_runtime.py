"""Collectives of a real multi-process run priced over the links their ranks cross.

Four spawned ranks rendezvous over real gloo as two "nodes" of two GPUs (a cluster described in
YAML, ranks filling nodes in order): a group inside a node crosses NVLink, a group across nodes
the NICs, the whole world both; a collective beside busy work on another stream is slowed by the
overlap form. Each rank's counters are compared with the cost model's own figures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from gpemu.ports import free_port

CLUSTER = """\
name: two-by-two
gpu: A100
nodes: 2
gpus_per_node: 2
inter_node: {nic: ib, nic_speed: 200Gb/s, nics_per_node: 2}
overlap_k: 4
"""
SIZE = 64 << 20  # bytes of every collective here


def _rank(rank: int, port: int, out_dir: str, data_dir: str, cluster: str) -> None:
    import torch.distributed as dist

    import gpemu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GPEMU_DATA_DIR=data_dir)
    rt = gpemu.patch(cluster=cluster, summary=False)
    torch.cuda.set_device(rank % 2)
    dist.init_process_group("nccl", rank=rank, world_size=4)
    same_node = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    x = torch.empty(SIZE // 4, device="cuda")
    dist.all_reduce(x)
    dist.all_reduce(x, group=same_node)
    dist.all_reduce(x, group=across)
    torch.cuda.synchronize()  # (the collectives above must not run beside the one below)
    before = dict(rt.recorder.counters)
    # Busy work on the default stream, then the all-reduce on a side stream beside it.
    rt.engine.default_stream(torch.cuda.current_device()).enqueue(5.0, "forward", "busy")
    with torch.cuda.stream(torch.cuda.Stream()):
        dist.all_reduce(x, group=same_node)
    beside = {k: v - before.get(k, 0.0) for k, v in rt.recorder.counters.items()}
    spans = [s.name for s in rt.recorder.spans if s.kind == "comm"]
    assert rt.placement is not None
    out = {"counters": dict(before), "beside": beside, "spans": spans, "nodes": rt.placement.rank_nodes}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    gpemu.unpatch()


@pytest.mark.torchrun
def test_collectives_are_priced_over_the_links_their_ranks_cross(tmp_path: Path, _gpemu_data_dir: Path) -> None:
    import torch.multiprocessing as mp

    from gpemu.config import load_cluster
    from gpemu.costmodel.comm import Collective, CommPath, collective_cost, overlapped_seconds

    described = tmp_path / "two-by-two.yaml"
    described.write_text(CLUSTER)
    args = (free_port(), str(tmp_path), str(_gpemu_data_dir), str(described))
    mp.spawn(_rank, args=args, nprocs=4, join=True)
    cluster = load_cluster(str(described))

    def cost(nodes: list[int]) -> float:
        return collective_cost(Collective.ALL_REDUCE, SIZE, CommPath.of(cluster, nodes)).seconds

    world, inside, between = cost([0, 0, 1, 1]), cost([0, 0]), cost([0, 1])
    assert inside < world and inside < between  # NVLink beats 2 x 200 Gb/s IB
    for rank in range(4):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["nodes"] == [0, 0, 1, 1]
        c = r["counters"]
        assert c["comm_seconds/all_reduce/nvlink+ib"] == pytest.approx(world, rel=1e-6)
        assert c["comm_seconds/all_reduce/nvlink"] == pytest.approx(inside, rel=1e-6)
        assert c["comm_seconds/all_reduce/ib"] == pytest.approx(between, rel=1e-6)
        assert c["comm_bytes/all_reduce/ib"] == SIZE and c["comm_count/all_reduce/nvlink"] == 1
        assert any("(nvlink+ib, " in name for name in r["spans"])  # the trace names the links
        # beside 5 s of other work, the all-reduce takes Morphling's (T^4 + T^4)^(1/4)
        assert r["beside"]["comm_seconds/all_reduce/nvlink"] == pytest.approx(
            overlapped_seconds(inside, inside, 4.0), rel=1e-6
        )


def test_without_a_cluster_ranks_spread_evenly_over_the_nodes_asked_for() -> None:
    from gpemu.distributed.placement import spread

    assert [spread(r, 8, 2) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [spread(r, 3, 2) for r in range(3)] == [0, 0, 1]
    assert [spread(r, 4, 1) for r in range(4)] == [0, 0, 0, 0]

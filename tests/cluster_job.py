"""A comm-heavy DDP job for the multi-node tests (run by torchrun under `gpemu run`).

Writes one JSON file per rank into ``--results DIR`` (``rank<R>.json``): its node, its steps'
times, and the emulator's counters. (A file, not a printed line: the ranks of a node share one
unbuffered stdout, where two long lines can interleave.)
``--sleep-rank R --sleep S``: rank R's host is slow by S seconds a step (a straggler).
:func:`run_two_nodes` runs it across two network namespaces and reads those files back (the
multi-node test and ``benchmarks/multinode_netns.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# Two nodes of two A100s joined by InfiniBand (the description `gpemu run --cluster` reads).
TWO_NODES = """\
name: two-nodes
gpu: A100
gpus_per_node: 2
nodes: 2
inter_node: {nic: ib, nic_speed: 200Gb/s, nics_per_node: 2}
"""


def run_two_nodes(
    folder: Path, name: str, description: str, steps: int, *args: str, timeout: float = 600
) -> list[dict]:
    """This job on 2 nodes x 2 ranks (examples/netns_cluster.py) under the cluster ``description``,
    in ``folder``; each rank's result, by rank. A node that fails raises RuntimeError with its output."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import netns_cluster

    described, out = folder / f"{name}.yaml", folder / name
    described.write_text(description)
    out.mkdir()
    script = [__file__, "--steps", str(steps), "--results", str(out), *args]
    for r in netns_cluster.run_nodes(script, 2, 2, ["--cluster", str(described)], timeout=timeout):
        if r.returncode != 0:
            raise RuntimeError(f"{name}: node {r.node} failed:\n{r.output[-4000:]}")
    return sorted((json.loads(f.read_text()) for f in out.glob("rank*.json")), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--sleep-rank", type=int, default=-1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--results", required=True, help="directory for rank<R>.json")
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(4)]
    model = DDP(torch.nn.Sequential(*layers).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        if rank == args.sleep_rank:
            time.sleep(args.sleep)
        model(torch.randn(8, args.width, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
    import gpemu.runtime

    rt = gpemu.runtime.current()
    assert rt is not None and rt.placement is not None
    out = {"rank": rank, "nodes": rt.placement.rank_nodes, "steps": steps, "counters": rt.recorder.counters}
    Path(args.results, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

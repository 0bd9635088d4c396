"""``gpemu topo`` (the cluster a run assumes) and ``gpemu comm-bench`` (its collectives, as nccl-tests
prints them)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from . import UserError

__all__ = ["topo", "comm_bench", "parse_size", "OPS"]

# nccl-tests' program names (without ``_perf``) -> gpemu's Collective values.
OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "alltoall": "all_to_all",
    "scatter": "scatter",
    "gather": "gather",
    "sendrecv": "send",
}
# nccl-tests' ``count`` is per rank for these (its size column is every rank's share together).
_PER_RANK_COUNT = frozenset({"all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"})
_TYPES = {"float": 4, "half": 2, "bfloat16": 2, "double": 8, "int8": 1, "int32": 4, "int64": 8}
_SIZE = re.compile(r"^\s*([0-9]+)\s*([kKmMgG]?)\s*[bB]?\s*$")


def parse_size(text: str, what: str) -> int:
    """nccl-tests' sizes: ``8``, ``64K``, ``1M``, ``8G`` (powers of 1024)."""
    match = _SIZE.match(str(text))
    if match is None:
        raise UserError(f"{what} must be a byte count like 8, 64K, 1M or 8G, got {text!r}")
    number, unit = match.groups()
    return int(number) << {"": 0, "k": 10, "m": 20, "g": 30}[unit.lower()]


_F = TypeVar("_F", bound=Callable[..., Any])


def _cluster_options(command: _F) -> _F:
    """The options that name a cluster, shared by both commands."""
    for option in reversed(
        [
            click.option("--cluster", metavar="PRESET|FILE", help="A preset (see below) or a YAML file."),
            click.option("--nodes", type=int, metavar="N", help="How many nodes (default: the description's)."),
            click.option("--gpu", metavar="NAME", help="Without --cluster: one node of these GPUs (default V100)."),
            click.option("--gpus-per-node", type=int, metavar="N", help="Without --cluster: GPUs per node (8)."),
        ]
    ):
        command = option(command)
    return command


def _load(cluster: str | None, nodes: int | None, gpu: str | None, gpus_per_node: int | None) -> object:
    from gpemu.config import ConfigError, EmuConfig, load_cluster
    from gpemu.costmodel.topology import TopologyError, default_cluster

    try:
        if cluster:
            if gpu or gpus_per_node:
                raise UserError("--gpu and --gpus-per-node describe a cluster of their own: give them or --cluster")
            return load_cluster(cluster, nodes)
        if nodes is not None and nodes < 1:
            raise UserError(f"--nodes must be an integer >= 1, got {nodes}")
        per_node = 8 if gpus_per_node is None else gpus_per_node
        if not 1 <= per_node <= 72:
            raise UserError(f"--gpus-per-node must be an integer from 1 to 72, got {per_node}")
        return default_cluster(gpu or EmuConfig().gpu, per_node, nodes or 1)
    except (ConfigError, TopologyError) as exc:
        raise UserError(str(exc)) from None


@click.command("topo")
@_cluster_options
def topo(cluster: str | None, nodes: int | None, gpu: str | None, gpus_per_node: int | None) -> None:
    """Show the cluster a run assumes: its nodes, the fabric inside a node, the network between
    nodes, and what an all-reduce costs over them.

    \b
      gpemu topo --cluster dgx-h100 --nodes 4
      gpemu topo --cluster my-cluster.yaml
      gpemu topo --gpu A100 --gpus-per-node 4
    """
    from gpemu.costmodel.comm import Collective, CommPath, collective_cost
    from gpemu.costmodel.topology import PRESETS, Cluster, describe

    described = _load(cluster, nodes, gpu, gpus_per_node)
    assert isinstance(described, Cluster)
    click.echo(describe(described))
    groups = [("one GPU pair", 2), ("one node", described.gpus_per_node)]
    if described.nodes > 1:
        groups.append(("every GPU", described.world_size))
    click.echo("  all-reduce      " + "size".rjust(10) + "".join(f"{name:>34}" for name, _ in groups))
    for size in (1 << 20, 64 << 20, 1 << 30):
        cells = []
        for _, ranks in groups:
            path = CommPath.of(described, [described.node_of(r) for r in range(ranks)])
            cost = collective_cost(Collective.ALL_REDUCE, size, path)
            how = f"{cost.algorithm.value}/{cost.protocol.value}"
            cells.append(f"{cost.seconds * 1e6:9.1f} us {cost.busbw / 1e9:6.1f} GB/s {how:>11}")
        click.echo("                  " + f"{_size(size):>8}" + "".join(f"{c:>34}" for c in cells))
    if not cluster:
        presets = ", ".join(sorted(PRESETS))
        click.echo(f"  (no --cluster: the node a run assumes for these GPUs; presets: {presets})")


@click.command("comm-bench")
@_cluster_options
@click.option("--op", "ops", default="all_reduce", metavar="OPS", help=f"Comma-separated: {', '.join(OPS)}.")
@click.option("-b", "--minbytes", default="1M", metavar="SIZE", help="Smallest size (nccl-tests' -b), e.g. 8, 1M.")
@click.option("-e", "--maxbytes", default="8G", metavar="SIZE", help="Largest size (nccl-tests' -e).")
@click.option("-f", "--stepfactor", default=2, type=int, metavar="F", help="Multiply the size by F each row (-f).")
@click.option("-d", "--datatype", default="float", type=click.Choice(sorted(_TYPES)), help="Element type (-d).")
@click.option("--ranks", type=int, metavar="N", help="Run among the first N ranks only (default: every GPU).")
def comm_bench(
    cluster: str | None,
    nodes: int | None,
    gpu: str | None,
    gpus_per_node: int | None,
    ops: str,
    minbytes: str,
    maxbytes: str,
    stepfactor: int,
    datatype: str,
    ranks: int | None,
) -> None:
    """Print what gpemu charges for collectives, in nccl-tests' columns, so a lab compares it with
    its own ``all_reduce_perf -b 1M -e 8G -f 2`` output (busbw: the bus bandwidth).

    \b
      gpemu comm-bench --cluster dgx-h100 --nodes 2
      gpemu comm-bench --cluster dgx-a100 --op all_gather,reduce_scatter -b 8 -e 1G
    """
    from gpemu.costmodel.topology import Cluster

    described = _load(cluster, nodes, gpu, gpus_per_node)
    assert isinstance(described, Cluster)
    names = [op.strip().lower().removesuffix("_perf") for op in ops.split(",") if op.strip()]
    unknown = [op for op in names if op not in OPS]
    if unknown or not names:
        raise UserError(f"--op must name nccl-tests operations ({', '.join(OPS)}), got {ops!r}")
    low, high = parse_size(minbytes, "-b/--minbytes"), parse_size(maxbytes, "-e/--maxbytes")
    if low > high or high > 1 << 40 or stepfactor < 2:
        raise UserError("sizes must grow: -b <= -e <= 1024G and -f >= 2")
    world = described.world_size if ranks is None else ranks
    if not 1 <= world <= described.world_size:
        raise UserError(f"--ranks must be from 1 to the cluster's {described.world_size} GPUs, got {ranks}")
    for name in names:
        _bench(described, name, world, _sizes(low, high, stepfactor), datatype)


def _sizes(low: int, high: int, factor: int) -> list[int]:
    sizes, size = [], max(low, 1)
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


def _bench(cluster: object, name: str, ranks: int, sizes: Sequence[int], datatype: str) -> None:
    from gpemu.costmodel.comm import Collective, CommPath, collective_cost
    from gpemu.costmodel.topology import Cluster

    assert isinstance(cluster, Cluster)
    kind = Collective(OPS[name])
    path = CommPath.of(cluster, [cluster.node_of(r) for r in range(ranks)])
    width = _TYPES[datatype]
    click.echo(f"# gpemu comm-bench: {name}_perf on {cluster.name}, {ranks} ranks on {path.nodes} node(s)")
    click.echo("#")
    click.echo(
        f"#{'size':>11} {'count':>13} {'type':>9} {'redop':>7} {'root':>7} {'time':>8} {'algbw':>7} {'busbw':>7}"
        f" {'#wrong':>7}  algorithm"
    )
    click.echo(f"#{'(B)':>11} {'(elements)':>13} {'':>9} {'':>7} {'':>7} {'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7}")
    total, rows = 0.0, 0
    reduces = kind in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.REDUCE)
    rooted = kind in (Collective.BROADCAST, Collective.REDUCE, Collective.SCATTER, Collective.GATHER)
    for size in sizes:
        per_rank = kind.value in _PER_RANK_COUNT
        count = size // width // (ranks if per_rank else 1)
        size = count * width * (ranks if per_rank else 1)
        if size <= 0:
            continue
        cost = collective_cost(kind, size, path)
        time_us = cost.seconds * 1e6
        algbw = size / cost.seconds / 1e9 if cost.seconds else 0.0
        busbw = cost.busbw / 1e9
        total, rows = total + busbw, rows + 1
        click.echo(
            f" {size:>11} {count:>13} {datatype:>9} {'sum' if reduces else 'none':>7} {0 if rooted else -1:>7}"
            f" {_time(time_us):>8} {algbw:7.2f} {busbw:7.2f} {'N/A':>7}  {cost.algorithm.value}/{cost.protocol.value}"
        )
    click.echo(f"# Avg bus bandwidth    : {total / rows if rows else 0.0:g}")
    click.echo("#")


def _time(us: float) -> str:
    return f"{us:.2f}" if us < 10_000 else f"{us:.0f}"


def _size(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)

"""``gpemu run``: the click command (implementation in :mod:`gpemu.launcher`)."""

from __future__ import annotations

import sys

import click

__all__ = ["run"]


@click.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    short_help="Run a PyTorch script on emulated GPUs (no edits to the script).",
)
@click.option(
    "--gpu",
    metavar="NAME",
    help="GPU model of every emulated device (e.g. V100, A100; see `gpemu gpus`; docs/adding.md adds one).",
)
@click.option("--gpus", metavar="N|LIST", help="How many emulated GPUs (e.g. 2), or one model per device (V100,A100).")
@click.option(
    "--model",
    metavar="NAME",
    help="Take GPU times from this database model (see `gpemu models`) instead of identifying the script's model.",
)
@click.option(
    "--db", "db_url", metavar="URL", help="SQLAlchemy URL of the profile database (default: per-user SQLite)."
)
@click.option(
    "--memory",
    type=click.Choice(["tracked", "profiled"]),
    help="Count every allocation (default), or use the database's measured peak memory.",
)
@click.option(
    "--share", "sharing", metavar="URL", help="amqp:// URL of a sharing manager to time-slice emuGPUs through."
)
@click.option(
    "--cluster",
    metavar="PRESET|FILE",
    help="The cluster the GPUs are in: a preset (dgx-h100, ...) or a YAML file; `gpemu topo` shows it.",
)
@click.option("--nodes", type=int, metavar="N", help="How many nodes the cluster has (default: its description's).")
@click.option(
    "--node-rank",
    type=int,
    metavar="N",
    help="The node these processes run on (default: torchrun's GROUP_RANK, else ranks fill nodes in order).",
)
@click.option(
    "--world-size",
    type=int,
    metavar="N",
    help="More GPUs than processes: the job has N ranks, run by --processes processes, each standing for its "
    "identical peers (a symmetric job: DDP, FSDP, TP); torchrun's variables are set for the ranks that run.",
)
@click.option(
    "--processes",
    type=int,
    metavar="P",
    help="How many processes run the --world-size ranks (default 1; one per pipeline stage): process p runs "
    "rank p*N/P and stands for ranks p*N/P to (p+1)*N/P-1.",
)
@click.option("--fold", is_flag=True, help="--world-size is every GPU of the cluster (--cluster, --nodes).")
@click.option(
    "--clock",
    type=click.Choice(["real", "virtual"]),
    help="real (default): emulated time is wall-clock time. virtual: each process's host time is its CPU time "
    "and GPU waits jump to their deadline, so results do not depend on how busy this host is and a GPU-bound "
    "hour runs in seconds (docs/time.md, 'Virtual time').",
)
@click.option(
    "--host",
    metavar="this|SPEEDx|PRESET|db:NAME|none",
    help="The host that issues the GPU work: this machine (this; its eager dispatch time is measured once, plus "
    "what the CUDA build adds per op, measured on a real GPU host), "
    "a speed relative to it (0.7x), a measured host's preset (h100-xeon), a host recorded in the database by "
    "`gpemu profile --host-side` (db:NAME; `gpemu hosts` lists presets and recorded hosts), or none (default: "
    "GPU time only). Each op costs the host that issue time and a full launch queue blocks it "
    "(docs/host-side.md).",
)
@click.option(
    "--values",
    type=click.Choice(["placeholders", "real"]),
    help="placeholders (default): tensors on emulated GPUs hold no values (a loss prints 0.000). real: they also "
    "hold their real values, computed on the CPU, so losses, early stopping and checkpoints on the best loss "
    "behave as on a GPU; the run goes at CPU speed, emulated times and memory are unchanged; implies "
    "--clock virtual (docs/device.md, 'Value mode').",
)
@click.option("--summary/--no-summary", default=None, help="Print a per-GPU summary at exit (default: on).")
@click.option("--metrics", "metrics_path", metavar="FILE", help="Write the summary as JSON to FILE at exit.")
@click.option("--trace", "trace_path", metavar="FILE", help="Write a Chrome trace (Perfetto) to FILE at exit.")
@click.option("-m", "module", metavar="MODULE", help="Run a Python module, like `python -m MODULE`.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(
    gpu,
    gpus,
    model,
    db_url,
    memory,
    sharing,
    cluster,
    nodes,
    node_rank,
    world_size,
    processes,
    fold,
    clock,
    host,
    values,
    summary,
    metrics_path,
    trace_path,
    module,
    command,
) -> None:
    """Run COMMAND with every Python process in it on emulated GPUs.

    The script runs unchanged: torch.cuda sees the emulated GPUs, and GPU work takes the time
    measured on the real GPU, or an estimate where nothing was measured (said at run time).
    Tensor values are placeholders (a loss prints 0.000) unless --values real. At exit, also
    after Ctrl-C, SIGTERM or SIGHUP, a per-GPU summary is printed (busy time, data stall, memory);
    --metrics and --trace also write it as JSON and as a Chrome trace (`gpemu report TRACE`).

    \b
      gpemu run --gpu V100 -- python train.py --epochs 1
      gpemu run --gpu A100 --gpus 2 -- torchrun --nproc-per-node 2 train_ddp.py
      gpemu run --cluster dgx-h100 --nodes 2 -- torchrun --nnodes 2 --nproc-per-node 8 ... train.py
      gpemu run --gpu V100 -m mypackage.train
      gpemu run --gpu V100 --trace t.json -- python train.py && gpemu report t.json --plot t.png
      gpemu run --gpu V100 --clock virtual -- python train.py   # an emulated hour in about a minute
      gpemu run --gpu A100 --values real -- python train.py     # real losses, at CPU speed
    """
    from gpemu import launcher

    world_size = _folded_world(world_size, fold, cluster, nodes)
    config = launcher.build_config(
        gpu=gpu,
        gpus=gpus,
        model=model,
        db_url=db_url,
        memory=memory,
        sharing=sharing,
        cluster=cluster,
        nodes=nodes,
        node_rank=node_rank,
        world_size=world_size,
        processes=processes,
        clock=clock,
        host=host,
        values=values,
        summary=summary,
        metrics_path=metrics_path,
        trace_path=trace_path,
    )
    argv = launcher.command_argv(command, module)
    env = launcher.child_env(config)
    if config.real_values:  # the run's first line: what its values cost and what its times mean
        print(f"[gpemu] {launcher.values_note(config)}", file=sys.stderr, flush=True)
    elif config.virtual_time:  # the run's first line: what its times mean
        print(f"[gpemu] {launcher.VIRTUAL_TIME_NOTE}", file=sys.stderr, flush=True)
    if config.world_size:  # what stands for what
        print(f"[gpemu] {launcher.fold_line(config)}", file=sys.stderr, flush=True)
    print(f"[gpemu] {config.describe()}: {' '.join(argv)}", file=sys.stderr, flush=True)
    if config.world_size:
        sys.exit(launcher.run_folded(argv, launcher.fold_envs(config, env)))
    launcher.run_command(argv, env)


def _folded_world(world_size: int | None, fold: bool, cluster: str | None, nodes: int | None) -> int | None:
    """--world-size, or with --fold every GPU of the described cluster."""
    if not fold:
        return world_size
    from gpemu.config import ConfigError, load_cluster

    if not cluster:
        raise ConfigError("--fold needs --cluster (a preset or YAML file) to count its GPUs; or give --world-size N")
    described = load_cluster(cluster, nodes)
    total = described.nodes * described.gpus_per_node
    if world_size is not None and world_size != total:
        raise ConfigError(f"--fold means --world-size {total} (the cluster's GPUs), not {world_size}")
    return total

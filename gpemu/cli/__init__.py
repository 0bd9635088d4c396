"""The ``gpemu`` command: one entry point, one subcommand per area.

Subcommands are imported only when used (``gpemu gpus`` should not pay for importing torch
or grpc). Each area owns its module; this file only lists them.

Errors: a :class:`UserError` (or any ``ValueError`` subclass gpemu raises for bad input) is
printed as one red line and exits with status 2; ``--debug`` shows the traceback instead. Ctrl-C
is one line ("interrupted", status 130). Output that is not a terminal (a log file, a pipe, a
Kubernetes log) is never hard-wrapped: messages stay one line each and tables take the width
they need.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

__all__ = ["main", "cli", "UserError", "console", "err_console", "make_console"]

# name -> (module, attribute, one-line help). The module defines a click.Command.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("gpemu.cli.run_cmd", "run", "Run a PyTorch script on emulated GPUs (no edits to the script)."),
    "gpus": (
        "gpemu.cli.db_cmds",
        "gpus",
        "List the GPUs you can emulate, measured or datasheet-only (`gpus add`: add one).",
    ),
    "models": ("gpemu.cli.db_cmds", "models", "List the models the profile database knows."),
    "hosts": (
        "gpemu.cli.hosts_cmd",
        "hosts",
        "List the hosts `run --host` can model: presets and hosts recorded by `profile --host-side`.",
    ),
    "show": ("gpemu.cli.db_cmds", "show", "Show every measurement for a model on a GPU at a batch size."),
    "db": ("gpemu.cli.db_cmds", "db", "Manage the profile database (path, init, export, import)."),
    "profile": ("gpemu.profiler.cli", "profile", "Measure models on a real GPU into the profile database."),
    "share-manager": (
        "gpemu.integrations.sharing.cli",
        "share_manager",
        "Run the RabbitMQ sharing manager that time-slices emuGPUs among jobs.",
    ),
    "share-status": (
        "gpemu.integrations.sharing.cli",
        "share_status",
        "Live view of a sharing manager's emuGPUs and jobs.",
    ),
    "k8s": ("gpemu.k8s.cli", "k8s", "Kubernetes: emuGPU device files and the device plugin."),
    "report": ("gpemu.cli.report_cmd", "report", "Summarise, compare or plot traces written by `gpemu run --trace`."),
    "topo": ("gpemu.cli.cluster_cmds", "topo", "Show the cluster a run assumes: nodes, NVLink/PCIe, network, costs."),
    "comm-bench": (
        "gpemu.cli.cluster_cmds",
        "comm_bench",
        "Print collective times and bus bandwidth in nccl-tests' columns for a cluster.",
    ),
}


class UserError(click.ClickException):
    """Bad input from the user: printed as one clear line, no traceback."""

    exit_code = 2


# Width of rich output that goes to a file or pipe (rich's default there is 80 columns, which
# hard-wraps every longer message in logs). $COLUMNS still wins.
LOG_WIDTH = 200


def make_console(stderr: bool = False) -> Any:
    """A rich Console that does not hard-wrap when its output is not a terminal."""
    from rich.console import Console

    console = Console(stderr=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(stderr=stderr, width=LOG_WIDTH, soft_wrap=True)
    return console


class _LazyConsole:
    """rich Console created on first use (keeps `gpemu --help` fast)."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            self._console = make_console(self._stderr)
        return getattr(self._console, name)


console: Any = _LazyConsole(stderr=False)
err_console: Any = _LazyConsole(stderr=True)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module, attr, _ = SUBCOMMANDS[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            raise UserError(f"the '{name}' command is not available: {exc}") from exc

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help text from the table above, without importing every subcommand.
        rows = [(name, SUBCOMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, envvar="GPEMU_DEBUG", help="Show full tracebacks on errors.")
@click.version_option(package_name="gpemu")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """gpemu: run unmodified PyTorch training scripts on CPU-only machines as if on real
    NVIDIA GPUs, with GPU time and memory taken from measurements of real GPUs.

    \b
    Start here:
      gpemu gpus                                  the GPUs you can emulate
      gpemu models                                the models with measured GPU times
      gpemu show resnet50 --gpu V100 --batch-size 128
      gpemu run --gpu V100 -- python train.py     run a script on an emulated V100
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Bad input: one line on stderr, exit 2 (traceback with --debug)."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        return cli.main(args=args, prog_name="gpemu", standalone_mode=False) or 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        err_console.print("[red]aborted[/red]")
        return 130
    except click.ClickException as exc:
        if debug:
            raise
        msg = exc.format_message()
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            msg = f"{msg}\n(see `{exc.ctx.command_path} --help`)"
        err_console.print(f"[bold red]error:[/bold red] {msg}", highlight=False, markup=True, soft_wrap=True)
        return exc.exit_code
    except ValueError as exc:  # gpemu raises ValueError subclasses for bad input
        if debug:
            raise
        err_console.print(f"[bold red]error:[/bold red] {exc}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/red]")
        return 130

"""``gpemu hosts``: the hosts ``--host`` can model: this machine, presets, and recorded hosts."""

from __future__ import annotations

import json

import click

from gpemu.cli import console

__all__ = ["hosts"]


@click.command("hosts", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    "db_url",
    metavar="URL",
    default=None,
    help="SQLAlchemy URL of the profile database (default: $GPEMU_DB, else the per-user SQLite file).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def hosts(db_url: str | None, as_json: bool) -> None:
    """List the hosts `gpemu run --host` can model: presets of measured hosts and the hosts
    recorded in the profile database by `gpemu profile --host-side` (as db:NAME), besides
    this (this machine), a speed relative to it (0.7x) and none (no modelled host, the default).

    \b
      gpemu profile --host-side --host-name lab-h100     # on the lab's GPU host: record it
      gpemu run --gpu H100 --host db:lab-h100 -- python train.py
    """
    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db
    from gpemu.time.launch import DRIVER_LAUNCH_S, HOST_PRESETS, RECORDED_PREFIX, recorded_hosts

    db = open_profile_db(EmuConfig.from_env(db_url=db_url))  # (bad settings: one line, from gpemu.cli.main)
    try:
        recorded = recorded_hosts(db.engine)
    finally:
        db.close()
    rows = [(name, "preset", p) for name, p in HOST_PRESETS.items()]
    rows += [(RECORDED_PREFIX + name, "recorded", p) for name, p in recorded.items()]
    if as_json:
        out = [
            {
                "host": name,
                "kind": kind,
                "forward_op_us": p.op_s * 1e6,
                "backward_op_us": (p.backward_op_s or p.op_s) * 1e6,
                "launch_us": (DRIVER_LAUNCH_S if p.launch_s is None else p.launch_s) * 1e6,
                "reference_ms": p.reference_ms,
                "about": p.note,
            }
            for name, kind, p in rows
        ]
        click.echo(json.dumps(out, indent=1))
        return
    from rich.table import Table

    table = Table(title="hosts --host can model (besides this, a speed such as 0.7x, and none)", title_justify="left")
    for col in ("--host", "forward us/op", "backward us/op", "launch us", "about"):
        table.add_column(col, justify="left" if col in ("--host", "about") else "right")
    for name, _, p in rows:
        launch = f"{(DRIVER_LAUNCH_S if p.launch_s is None else p.launch_s) * 1e6:.1f}"
        table.add_row(name, f"{p.op_s * 1e6:.1f}", f"{(p.backward_op_s or p.op_s) * 1e6:.1f}", launch, p.note)
    console.print(table)
    if not recorded:
        console.print("no recorded hosts yet: `gpemu profile --host-side` on a GPU host records one", highlight=False)

"""``gpemu share-manager`` and ``gpemu share-status``."""

from __future__ import annotations

import json
import logging
import signal
from typing import Any

import click

__all__ = ["share_manager", "share_status"]


def _gpu_memory_lookup() -> Any:
    """GPU name -> memory bytes from the profile database, or None when it is unavailable."""
    try:
        from gpemu.config import EmuConfig
        from gpemu.db import open_profile_db

        db = open_profile_db(EmuConfig.from_env())
    except Exception:
        return None
    return lambda name: db.gpu(name).memory_bytes


@click.command("share-manager")
@click.option("--amqp", "url", required=True, metavar="URL", help="RabbitMQ URL, e.g. amqp://guest:guest@localhost/")
@click.option("--device", "devices", multiple=True, required=True, metavar="ID=GPU[:SIZE]",
              help="An emuGPU to share, e.g. 0=V100 (memory from the profile database) or 1=P100:16GiB. Repeatable.")
@click.option("--policy", default="fifo", show_default=True, metavar="NAME",
              help="fifo, round-robin, weighted, or package.module:ClassName for your own policy.")
@click.option("--lease", "lease_s", default=10.0, show_default=True, type=float,
              help="Seconds without a heartbeat after which a job is dropped and its GPU time/memory freed.")
@click.option("--status-interval", default=1.0, show_default=True, type=float,
              help="Seconds between status snapshots published for `gpemu share-status`.")
@click.option("--lookahead", "lookahead_s", default=None, type=float, metavar="SECONDS",
              help="Choose and grant the next request this long before the emuGPU frees up, so the grant "
                   "reaches the job before its slot starts [default: 0.01].")
@click.option("--backdate", "backdate_s", default=None, type=float, metavar="SECONDS",
              help="A job on this host whose request finds the emuGPU idle starts when it sent the request, "
                   "up to this long before it arrived (0: when it arrives) [default: 0.05].")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def share_manager(url: str, devices: tuple[str, ...], policy: str, lease_s: float, status_interval: float,
                  lookahead_s: float | None, backdate_s: float | None, log_level: str) -> None:
    """Run the sharing manager: time-slices emuGPUs among registered jobs, one request at a time,
    refusing work whose memory would not fit."""
    from gpemu.cli import UserError

    from .manager import DEFAULT_BACKDATE_S, DEFAULT_LOOKAHEAD_S, SharingManager, parse_device
    from .policies import load_policy

    if not url.startswith(("amqp://", "amqps://")):
        raise UserError("--amqp must be an amqp:// or amqps:// URL")
    if lease_s <= 0 or status_interval <= 0:
        raise UserError("--lease and --status-interval must be positive seconds")
    lookahead_s = DEFAULT_LOOKAHEAD_S if lookahead_s is None else lookahead_s
    backdate_s = DEFAULT_BACKDATE_S if backdate_s is None else backdate_s
    if not 0 <= lookahead_s <= 1 or not 0 <= backdate_s <= 1:
        raise UserError("--lookahead and --backdate must be from 0 to 1 second")
    lookup = None
    if any(":" not in d.partition("=")[2] for d in devices):
        lookup = _gpu_memory_lookup()
    try:
        specs = [parse_device(d, lookup) for d in devices]
        policy_cls = load_policy(policy)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise UserError(f"each --device needs its own ID; got {', '.join(names)}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    manager = SharingManager(url, specs, policy_cls, lease_s=lease_s, status_interval_s=status_interval,
                             lookahead_s=lookahead_s, backdate_s=backdate_s)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: manager.stop())
    manager.serve_forever()


@click.command("share-status")
@click.option("--amqp", "url", required=True, metavar="URL", help="RabbitMQ URL of the sharing manager.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit (for scripts).")
@click.option("--json", "as_json", is_flag=True, help="With --once: print the snapshot as JSON.")
@click.option("--timeout", default=5.0, show_default=True, type=float, help="Seconds to wait for the manager.")
def share_status(url: str, once: bool, as_json: bool, timeout: float) -> None:
    """Show the sharing manager's emuGPUs, jobs, queue lengths and GPU shares (live; --once for scripts)."""
    from gpemu.cli import UserError, console

    from .status import StatusTimeout, fetch_status, live, render_status

    if not url.startswith(("amqp://", "amqps://")):
        raise UserError("--amqp must be an amqp:// or amqps:// URL")
    if once:
        try:
            snap = fetch_status(url, timeout)
        except StatusTimeout as exc:
            raise UserError(str(exc)) from None
        if as_json:
            click.echo(json.dumps(snap, indent=2))
        else:
            console.print(render_status(snap))
        return
    try:
        live(url)
    except KeyboardInterrupt:
        pass

"""``gpemu share-manager`` and ``gpemu share-status``."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Any

import click

__all__ = ["share_manager", "share_status", "resolve_amqp_url", "read_secret_file", "password_options"]


def _gpu_memory_lookup() -> Any:
    """GPU name -> memory bytes from the profile database, or None when it is unavailable."""
    try:
        from gpemu.config import EmuConfig
        from gpemu.db import open_profile_db

        db = open_profile_db(EmuConfig.from_env())
    except Exception:
        return None
    return lambda name: db.gpu(name).memory_bytes


def read_secret_file(path: str | Path, what: str) -> bytes:
    """The contents of a secret file (a Kubernetes Secret mount), without a trailing newline."""
    from gpemu.cli import UserError

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    data = data.rstrip(b"\r\n")
    if not data:
        raise UserError(f"the {what} file {path} is empty")
    return data


def resolve_amqp_url(url: str, password: str | None, password_file: str | None, option: str) -> str:
    """``url`` with the broker password from ``password_file`` or ``password`` (the environment)
    filled in when the URL itself has none; checked so a bad URL is one clear line."""
    from gpemu.cli import UserError
    from gpemu.units import redact_url

    from .client import with_password

    if not url.startswith(("amqp://", "amqps://")):
        raise UserError(f"{option} must be an amqp:// or amqps:// URL, got {redact_url(url)!r}")
    if password_file:
        try:
            password = read_secret_file(password_file, "broker password").decode()
        except UnicodeDecodeError:
            raise UserError(f"the broker password file {password_file} is not UTF-8 text") from None
    from gpemu.config import amqp_url_problem

    problem = amqp_url_problem(url, password)
    if problem is not None:
        hint = f"; give it with {option}-password-file or $GPEMU_AMQP_PASSWORD" if "no password" in problem else ""
        raise UserError(f"{option} {redact_url(url)!r} is not a usable AMQP URL: {problem}{hint}")
    return with_password(url, password)


def password_options(f: Any) -> Any:
    """``--amqp-password-file`` and ``$GPEMU_AMQP_PASSWORD``: the broker password off the command line."""
    f = click.option(
        "--amqp-password",
        "amqp_password",
        envvar="GPEMU_AMQP_PASSWORD",
        hidden=True,
        default=None,
        help="Broker password (better: $GPEMU_AMQP_PASSWORD or --amqp-password-file).",
    )(f)
    return click.option(
        "--amqp-password-file",
        "amqp_password_file",
        type=click.Path(dir_okay=False),
        default=None,
        metavar="FILE",
        help="Read the broker password from FILE (e.g. a Kubernetes Secret) when the URL has "
        "none; $GPEMU_AMQP_PASSWORD works too. Keeps it out of the process list.",
    )(f)


def _debug() -> bool:
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and isinstance(root.obj, dict) and root.obj.get("debug"))


@click.command("share-manager")
@click.option(
    "--amqp",
    "url",
    required=True,
    metavar="URL",
    help="RabbitMQ URL, e.g. amqp://gpemu-manager@localhost/ (password: see --amqp-password-file).",
)
@password_options
@click.option(
    "--device",
    "devices",
    multiple=True,
    required=True,
    metavar="ID=GPU[:SIZE]",
    help="An emuGPU to share, e.g. 0=V100 (memory from the profile database) or 1=P100:16GiB. Repeatable.",
)
@click.option(
    "--policy",
    default="fifo",
    show_default=True,
    metavar="NAME",
    help="fifo, round-robin, weighted, or package.module:ClassName for your own policy.",
)
@click.option(
    "--lease",
    "lease_s",
    default=10.0,
    show_default=True,
    type=float,
    help="Seconds without a heartbeat after which a job is dropped and its GPU time/memory freed "
    "(a job whose broker connection closes is dropped at once).",
)
@click.option(
    "--quantum",
    "quantum_s",
    default=None,
    type=float,
    metavar="SECONDS",
    help="Longest time one job holds the emuGPU while others wait: longer requests are served in "
    "slices of this length (0: no slicing) [default: 0.5].",
)
@click.option(
    "--job-secret-file",
    default=None,
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Derive every job's key from this secret (the device plugin's --job-secret-file); without "
    "it each job brings its own key.",
)
@click.option(
    "--status-interval",
    default=1.0,
    show_default=True,
    type=float,
    help="Seconds between status snapshots published for `gpemu share-status`.",
)
@click.option(
    "--lookahead",
    "lookahead_s",
    default=None,
    type=float,
    metavar="SECONDS",
    help="Choose and grant the next request this long before the emuGPU frees up, so the grant "
    "reaches the job before its slot starts [default: 0.01].",
)
@click.option(
    "--backdate",
    "backdate_s",
    default=None,
    type=float,
    metavar="SECONDS",
    help="A job on this host whose request finds the emuGPU idle starts when it sent the request, "
    "up to this long before it arrived (0: when it arrives) [default: 0.05].",
)
@click.option(
    "--clock",
    "time_mode",
    default="real",
    show_default=True,
    type=click.Choice(["real", "virtual"]),
    help="virtual: serve jobs on virtual time (`gpemu run --clock virtual`): slots are decided on the jobs' "
    "virtual clocks, so a study runs as fast as the jobs' hosts allow with the schedule real time would give.",
)
@click.option(
    "--jobs",
    "expected_jobs",
    default=0,
    type=click.IntRange(0, 1024),
    metavar="N",
    help="With --clock virtual: grant nothing before N jobs registered (a study's closed set of jobs; a job "
    "that registers later starts no earlier than the slots already granted).",
)
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
def share_manager(
    url: str,
    amqp_password: str | None,
    amqp_password_file: str | None,
    devices: tuple[str, ...],
    policy: str,
    lease_s: float,
    quantum_s: float | None,
    job_secret_file: str | None,
    status_interval: float,
    lookahead_s: float | None,
    backdate_s: float | None,
    time_mode: str,
    expected_jobs: int,
    log_level: str,
) -> None:
    """Run the sharing manager: time-slices emuGPUs among registered jobs, one slot at a time,
    refusing work whose memory would not fit."""
    from gpemu.cli import UserError

    from .manager import ManagerConflict, SharingManager, parse_device
    from .policies import load_policy

    url = resolve_amqp_url(url, amqp_password, amqp_password_file, "--amqp")
    if lease_s <= 0 or status_interval <= 0:
        raise UserError("--lease and --status-interval must be positive seconds")
    lookahead_s, backdate_s, quantum_s = _slot_timing(lookahead_s, backdate_s, quantum_s)
    secret = read_secret_file(job_secret_file, "job secret") if job_secret_file else None
    if secret is not None and len(secret) < 16:
        raise UserError(
            f"the job secret in {job_secret_file} is too short: use at least 16 random bytes "
            "(e.g. `head -c 32 /dev/urandom | base64`)"
        )
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
    debug = _debug() or log_level == "debug"
    logging.basicConfig(
        level="DEBUG" if debug else log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    # pika logs every connection attempt and failure with its parameters at INFO/ERROR; the
    # manager reports losing and regaining the broker itself, once, with the password redacted.
    logging.getLogger("pika").setLevel(logging.DEBUG if debug else logging.CRITICAL)
    manager = SharingManager(
        url,
        specs,
        policy_cls,
        lease_s=lease_s,
        status_interval_s=status_interval,
        lookahead_s=lookahead_s,
        backdate_s=backdate_s,
        quantum_s=quantum_s or None,
        job_secret=secret,
        time_mode=time_mode,
        expected_jobs=expected_jobs,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: manager.stop())
    try:
        manager.serve_forever()
    except ManagerConflict as exc:
        raise UserError(str(exc)) from None


def _slot_timing(
    lookahead_s: float | None, backdate_s: float | None, quantum_s: float | None
) -> tuple[float, float, float]:
    """--lookahead, --backdate and --quantum with their defaults, checked (one line each)."""
    from gpemu.cli import UserError

    from .manager import DEFAULT_BACKDATE_S, DEFAULT_LOOKAHEAD_S, DEFAULT_QUANTUM_S

    lookahead_s = DEFAULT_LOOKAHEAD_S if lookahead_s is None else lookahead_s
    backdate_s = DEFAULT_BACKDATE_S if backdate_s is None else backdate_s
    if not 0 <= lookahead_s <= 1 or not 0 <= backdate_s <= 1:
        raise UserError("--lookahead and --backdate must be from 0 to 1 second")
    quantum_s = DEFAULT_QUANTUM_S if quantum_s is None else quantum_s
    if quantum_s != 0 and not 0.001 <= quantum_s <= 3600:
        raise UserError(f"--quantum must be from 0.001 to 3600 seconds, or 0 for no slicing; got {quantum_s:g}")
    return lookahead_s, backdate_s, quantum_s


@click.command("share-status")
@click.option("--amqp", "url", required=True, metavar="URL", help="RabbitMQ URL of the sharing manager.")
@password_options
@click.option("--once", is_flag=True, help="Print one snapshot and exit (for scripts).")
@click.option("--json", "as_json", is_flag=True, help="With --once: print the snapshot as JSON.")
@click.option("--timeout", default=5.0, show_default=True, type=float, help="Seconds to wait for the manager.")
def share_status(
    url: str, amqp_password: str | None, amqp_password_file: str | None, once: bool, as_json: bool, timeout: float
) -> None:
    """Show the sharing manager's emuGPUs, jobs, queue lengths and GPU shares (live; --once for scripts)."""
    from gpemu.cli import UserError, console

    from .status import StatusTimeout, StatusUnavailable, fetch_status, live, render_status

    url = resolve_amqp_url(url, amqp_password, amqp_password_file, "--amqp")
    if not _debug():
        logging.getLogger("pika").setLevel(logging.CRITICAL)
    try:
        if once:
            snap = fetch_status(url, timeout)
            if as_json:
                click.echo(json.dumps(snap, indent=2))
            else:
                console.print(render_status(snap))
            return
        live(url)
    except (StatusTimeout, StatusUnavailable) as exc:
        raise UserError(str(exc)) from None
    except KeyboardInterrupt:
        pass

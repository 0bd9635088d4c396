"""``gpemu k8s``: emuGPU device files and the Kubernetes device plugin."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import click

from gpemu.cli import UserError, console

from .devices import DEFAULT_DEVICE_DIR, DeviceFileError, EmuGpu, create_devices, remove_devices, scan_devices

__all__ = ["k8s"]

_DIR_OPTION = click.option(
    "--dir",
    "directory",
    default=DEFAULT_DEVICE_DIR,
    show_default=True,
    type=click.Path(file_okay=False),
    help="The node's emuGPU directory.",
)


def _one_line_errors(command: Callable[..., None]) -> Callable[..., None]:
    """A directory or socket the command cannot use is one line, not a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except OSError as exc:
            if exc.filename is None:
                raise
            raise UserError(f"{exc.filename}: {exc.strerror}") from None

    return run


@click.group()
def k8s() -> None:
    """Kubernetes: emuGPU device files and the device plugin.

    \b
      gpemu k8s devices create --gpu V100 --count 8     make 8 emuGPUs on this node
      gpemu k8s plugin                                   advertise them as gpemu.io/emugpu
    """


@k8s.group()
def devices() -> None:
    """Create, list and remove emuGPU files (one file per emulated GPU)."""


@devices.command("create")
@click.option("--gpu", required=True, help="GPU model, e.g. V100 (see `gpemu gpus`).")
@click.option("--count", default=1, show_default=True, type=int, help="How many emuGPUs to create.")
@click.option(
    "--replace",
    is_flag=True,
    help="Make the directory hold exactly these emuGPUs (indices 0..count-1); unchanged files are not rewritten.",
)
@_DIR_OPTION
@_one_line_errors
def create_cmd(gpu: str, count: int, replace: bool, directory: str) -> None:
    """Create emuGPU files of one GPU model (added after existing ones unless --replace)."""
    try:
        made = create_devices(directory, gpu, count, replace=replace)
    except DeviceFileError as exc:
        raise UserError(str(exc)) from None
    ids = ", ".join(d.id for d in made)
    console.print(f"created {len(made)} emuGPU(s) [bold]{made[0].gpu}[/bold] in {directory}: {ids}", highlight=False)


@devices.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--share-manager-args",
    "share_args",
    is_flag=True,
    help="Print `--device emugpu-0=V100 ...` for `gpemu share-manager` (healthy emuGPUs only).",
)
@_DIR_OPTION
@_one_line_errors
def list_cmd(as_json: bool, share_args: bool, directory: str) -> None:
    """List the emuGPUs in the directory, with the health the plugin would advertise."""
    found = scan_devices(directory)
    if share_args:
        # The sharing client names devices by GPEMU_VISIBLE_DEVICES ids, i.e. these file ids.
        good = [d for d in found.values() if isinstance(d, EmuGpu) and d.healthy]
        if not good:
            raise UserError(f"no healthy emuGPUs in {directory}")
        click.echo(" ".join(f"--device {d.id}={d.gpu}" for d in good))
        return
    if as_json:
        rows = [
            d.to_json() if isinstance(d, EmuGpu) else {"id": dev_id, "error": str(d)} for dev_id, d in found.items()
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    if not found:
        console.print(
            f"no emuGPUs in {directory} (create some: gpemu k8s devices create --gpu V100 --count 8 --dir {directory})",
            highlight=False,
        )
        return
    from rich.table import Table

    table = Table(title=f"emuGPUs in {directory}")
    for col in ("id", "GPU", "memory", "health", "uuid"):
        table.add_column(col)
    for dev_id, d in found.items():
        if isinstance(d, EmuGpu):
            health = "Healthy" if d.healthy else "Unhealthy (file says healthy: false)"
            table.add_row(d.id, d.gpu, f"{d.memory_bytes / 2**30:.0f} GiB", health, d.uuid)
        else:
            table.add_row(dev_id, "?", "?", f"Unhealthy ({d})", "")
    console.print(table)


@devices.command("remove")
@click.argument("ids", nargs=-1)
@click.option("--all", "remove_all", is_flag=True, help="Remove every emuGPU in the directory.")
@_DIR_OPTION
@_one_line_errors
def remove_cmd(ids: tuple[str, ...], remove_all: bool, directory: str) -> None:
    """Remove emuGPUs by id (e.g. emugpu-3), or --all. The plugin advertises them Unhealthy, then drops them."""
    if bool(ids) == remove_all:
        raise UserError("name the emuGPU ids to remove (e.g. emugpu-3) or pass --all, not both")
    try:
        removed = remove_devices(directory, None if remove_all else ids)
    except DeviceFileError as exc:
        raise UserError(str(exc)) from None
    console.print(f"removed {len(removed)} emuGPU(s): {', '.join(removed) or 'none'}", highlight=False)


@k8s.command("plugin")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="YAML config (flags, sharing.timeSlicing replicas, sharing.manager); see k8s/README.md.",
)
@click.option("--device-dir", help=f"emuGPU directory as the plugin sees it [default: {DEFAULT_DEVICE_DIR}].")
@click.option("--host-device-dir", help="The same directory as the node sees it (when the plugin runs in a container).")
@click.option(
    "--container-device-dir", help="Where emuGPU files appear in workload containers [default: /var/run/gpemu/devices]."
)
@click.option(
    "--device-plugin-dir", help="The kubelet's device-plugin directory [default: /var/lib/kubelet/device-plugins]."
)
@click.option("--resource-name", help="Extended resource to advertise [default: gpemu.io/emugpu].")
@click.option("--replicas", type=int, help="Time-slicing: advertise each emuGPU this many times.")
@click.option(
    "--sharing",
    help="amqp://USER@HOST:PORT/VHOST of the node's sharing manager, given to containers as "
    "GPEMU_SHARING (the password goes to each container's credentials file).",
)
@click.option(
    "--sharing-password-file",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="The broker password of the jobs' user, read from FILE (or $GPEMU_SHARING_PASSWORD).",
)
@click.option("--sharing-password", envvar="GPEMU_SHARING_PASSWORD", hidden=True, default=None)
@click.option(
    "--job-secret-file",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="The sharing manager's job secret: each container gets its own key derived from it.",
)
@click.option(
    "--credentials-dir",
    help="Where per-container sharing credentials are written [default: /var/lib/gpemu/credentials].",
)
@click.option("--host-credentials-dir", help="The same directory as the node sees it (mount source).")
@click.option("--state-dir", help="Where the allocation record is kept [default: the device-plugin directory].")
@click.option("--poll-interval", type=float, help="Seconds between scans of the emuGPU directory [default: 1].")
@click.option("--removed-grace", type=float, help="Seconds a removed emuGPU stays advertised Unhealthy [default: 30].")
@_one_line_errors
def plugin_cmd(
    config_path: str | None,
    sharing_password_file: str | None,
    sharing_password: str | None,
    job_secret_file: str | None,
    **flags: object,
) -> None:
    """Run the emuGPU device plugin (registers with the kubelet; serves until SIGTERM)."""
    from .plugin import EmuGpuPlugin, PluginOptions, load_plugin_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = {"poll_interval": "poll_interval_s", "removed_grace": "removed_grace_s"}
    options = load_plugin_config(config_path) if config_path else PluginOptions()
    changes: dict[str, Any] = {names.get(k, k): v for k, v in flags.items() if v is not None}
    if sharing_password_file:
        changes["sharing_password"] = read_secret_file(sharing_password_file, "broker password").decode()
    elif sharing_password:
        changes["sharing_password"] = sharing_password
    if job_secret_file:
        changes["job_secret"] = read_secret_file(job_secret_file, "job secret")
    if changes:
        from dataclasses import replace

        options = replace(options, **changes)
    if options.sharing:
        _check_amqp_url(options.sharing, options.sharing_password)
    EmuGpuPlugin(options).run_forever()


def read_secret_file(path: str, what: str) -> bytes:
    """A secret file's contents (a hostPath or Secret mount) without the trailing newline."""
    from pathlib import Path

    try:
        data = Path(path).read_bytes().rstrip(b"\r\n")
    except OSError as exc:
        raise UserError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    if not data:
        raise UserError(f"the {what} file {path} is empty")
    return data


def _check_amqp_url(url: str, password: str | None) -> None:
    """A --sharing URL the containers could not use is one line at start (password redacted), not
    a failure per Allocate. Checked as the containers will use it: with the password from
    --sharing-password-file filled in (the URL the DaemonSet passes names the user only)."""
    from gpemu.config import amqp_url_problem
    from gpemu.units import redact_url

    problem = amqp_url_problem(url, password)
    if problem is not None:
        hint = "; give the password with --sharing-password-file" if "no password" in problem else ""
        raise UserError(f"--sharing {redact_url(url)!r} is not a usable AMQP URL: {problem}{hint}")


@k8s.command("secrets")
@click.option(
    "--dir",
    "directory",
    default="/var/lib/gpemu/secrets",
    show_default=True,
    type=click.Path(file_okay=False),
    help="The node's root-only secrets directory.",
)
@click.option(
    "--broker-config-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Also write RabbitMQ's gpemu.conf and definitions.json (the two users) here.",
)
@_one_line_errors
def secrets_cmd(directory: str, broker_config_dir: str | None) -> None:
    """Make the node's sharing secrets once (broker passwords, job secret); never prints them."""
    from .secrets import ensure_secrets, write_broker_config

    made = ensure_secrets(directory)
    new = [name for name, created in made.items() if created]
    click.echo(f"secrets in {directory}: " + (f"created {', '.join(new)}" if new else "all present, kept"))
    if broker_config_dir:
        conf, defs = write_broker_config(directory, broker_config_dir)
        click.echo(f"broker config: {conf}, {defs}")


@k8s.command("probe")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="The plugin's YAML config (the socket's name follows its resource name).",
)
@click.option(
    "--device-plugin-dir",
    default=None,
    help="The kubelet's device-plugin directory [default: /var/lib/kubelet/device-plugins].",
)
@click.option("--timeout", default=3.0, show_default=True, type=float, help="Seconds to wait for an answer.")
def probe_cmd(config_path: str | None, device_plugin_dir: str | None, timeout: float) -> None:
    """Liveness check: ask the plugin on its socket for its options (exit 0 when it answers)."""
    from dataclasses import replace
    from pathlib import Path

    import grpc

    from . import api_pb2, api_pb2_grpc
    from .plugin import PluginOptions, load_plugin_config

    options = load_plugin_config(config_path) if config_path else PluginOptions()
    if device_plugin_dir:
        options = replace(options, device_plugin_dir=device_plugin_dir)
    socket = Path(options.device_plugin_dir) / options.endpoint
    if not socket.exists():
        raise UserError(f"no plugin socket at {socket}")
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            api_pb2_grpc.DevicePluginStub(channel).GetDevicePluginOptions(api_pb2.Empty(), timeout=timeout)
    except grpc.RpcError as exc:
        raise UserError(f"the plugin on {socket} did not answer: {exc.code().name}") from None
    click.echo(f"ok: {socket}")

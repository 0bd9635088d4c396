"""A multi-node torchrun job on one machine: one network namespace per "node", each with its own
address on a private bridge; one torchrun agent per node, rendezvousing over c10d.

    sudo python examples/netns_cluster.py --nodes 2 --nproc-per-node 2 --cluster dgx-h100 -- \\
        examples/ddp_train.py --steps 4

Each node is a network namespace ``gpemu-<tag>-<i>`` whose ``eth0`` has address ``10.77.<k>.<i+1>``
on a Linux bridge; the ranks' gloo traffic (and the rendezvous) travels only over those addresses
(``GLOO_SOCKET_IFNAME=eth0``), so a job's messages really cross between "nodes". Every node runs

    gpemu run --cluster C --nodes N -- torchrun --nnodes N --nproc-per-node P \\
        --rdzv-backend c10d --rdzv-endpoint 10.77.<k>.1:PORT --rdzv-id TAG SCRIPT ARGS

and torchrun tells each worker its node (``GROUP_RANK``), which gpemu prices collectives by.
Across real machines the same command runs on each machine with the first machine's address as
``--rdzv-endpoint`` (docs/clusters.md). Needs root (``ip netns``); :func:`unavailable` says why
namespaces cannot be made here. The namespaces and the bridge are removed at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Namespaces", "unavailable", "run_nodes", "NodeResult"]

SUBNET = "10.77"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"gpemu-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"`ip netns add` failed: {exc.stderr.strip() or exc}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Namespaces:
    """``nodes`` network namespaces on one bridge (``up()`` / ``down()``, or ``with``)."""

    nodes: int
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    made: list[str] = field(default_factory=list)

    @property
    def octet(self) -> int:
        return int(self.tag[:4], 16) % 250 + 1  # one /24 per job, so jobs may run side by side

    @property
    def bridge(self) -> str:
        return f"gpbr{self.tag}"  # interface names: at most 15 characters

    def name(self, node: int) -> str:
        return f"gpemu-{self.tag}-{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{self.octet}.{node + 1}"

    def up(self) -> Namespaces:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append("bridge")
        _ip("link", "set", self.bridge, "up")
        for node in range(self.nodes):
            ns, outer = self.name(node), f"gp{self.tag}{node}"
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", f"{outer}x")
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("link", "set", f"{outer}x", "netns", ns)
            inside = ["netns", "exec", ns, "ip"]
            _ip(*inside, "link", "set", f"{outer}x", "name", "eth0")
            _ip(*inside, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "link", "set", "lo", "up")
        return self

    def down(self) -> None:
        for made in reversed(self.made):
            try:
                _ip("link", "del", self.bridge) if made == "bridge" else _ip("netns", "del", made)
            except subprocess.CalledProcessError:
                pass  # already gone
        self.made.clear()

    def __enter__(self) -> Namespaces:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def argv(self, node: int, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name(node), *command]


@dataclass(frozen=True)
class NodeResult:
    node: int
    returncode: int
    output: str


def run_nodes(
    script: Sequence[str],
    nodes: int = 2,
    nproc_per_node: int = 2,
    gpemu_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 600,
    port: int = 29400,
) -> list[NodeResult]:
    """Run ``script`` (a Python file and its arguments) as a ``nodes``-node torchrun job, one
    network namespace per node, under ``gpemu run`` with ``gpemu_args`` (say, ``--cluster F``).
    A node that fails takes the others down after a short grace (they would wait for it)."""
    base = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"}
    with Namespaces(nodes) as spaces, tempfile.TemporaryDirectory() as logs:
        procs = []
        for node in range(nodes):
            command = [
                *(sys.executable, "-m", "gpemu.cli", "run", *gpemu_args, "--nodes", str(nodes), "--"),
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes)),
                *("--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-id", spaces.tag),
                *("--rdzv-endpoint", f"{spaces.address(0)}:{port}", "--rdzv-conf", f"is_host={node == 0}"),
                *("--local-addr", spaces.address(node)),  # (the namespaces share one hostname)
                "--max-restarts=0",
                *script,
            ]
            log = open(Path(logs, f"node{node}.log"), "w")  # noqa: SIM115 (closed below)
            # Its own session: the whole node (agent and workers) is stopped as one group.
            procs.append(
                subprocess.Popen(spaces.argv(node, command), env=base, stdout=log, stderr=log, start_new_session=True)
            )
            log.close()
        codes = _wait(procs, timeout)
        return [NodeResult(n, code, Path(logs, f"node{n}.log").read_text()) for n, code in enumerate(codes)]


def _wait(procs: Sequence[subprocess.Popen[bytes]], timeout: float, grace: float = 20.0) -> list[int]:
    """Every node's exit status; a node that failed (or the deadline) stops the rest."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + grace):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # (orphaned workers of a finished node)
        p.wait()
    return [p.returncode for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--cluster", help="gpemu's --cluster (a preset or a YAML file)")
    parser.add_argument("--port", type=int, default=29400)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT.py ARGS")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the script to run after --")
    reason = unavailable()
    if reason:
        sys.exit(f"cannot make network namespaces here: {reason}")
    gpemu_args = ["--cluster", args.cluster] if args.cluster else []
    script = [str(Path(script[0]).resolve()), *script[1:]]
    results = run_nodes(script, args.nodes, args.nproc_per_node, gpemu_args, port=args.port)
    for r in results:
        print(f"===== node {r.node} (exit {r.returncode}) =====\n{r.output}")
    sys.exit(max(r.returncode for r in results))


if __name__ == "__main__":
    main()

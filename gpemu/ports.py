"""Free loopback ports for listeners a program starts later (a broker, a process group's store).

A port picked now and listened on later can be taken in between: the kernel hands ephemeral
ports (``/proc/sys/net/ipv4/ip_local_port_range``) to every outgoing connection as its local
port, and a listener cannot bind a port an open connection uses (EADDRINUSE). A broker restarted
on its port while its clients keep reconnecting hit exactly that. Ports below the ephemeral
range are only ever taken by an explicit bind, so they are picked from there.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_LINUX_DEFAULT = (32768, 60999)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return _LINUX_DEFAULT


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on ``host`` now, below the ephemeral range when one is free."""
    low = _ephemeral_range()[0]
    top = max(1025, low - 1)
    bottom = max(1024, top - 12000)
    for _ in range(200):
        port = random.randint(bottom, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is crowded: any free port
        s.bind((host, 0))
        return int(s.getsockname()[1])

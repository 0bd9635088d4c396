"""Start and stop a real, private RabbitMQ broker (tests, benchmarks, examples, quick trials).

Every broker gets its own node name, AMQP port, Erlang distribution port, epmd port and
data/log/home directories, so several engineers (or CI jobs) can run brokers side by side
without clashing. Every port it opens (AMQP, Erlang distribution, epmd) listens on 127.0.0.1
only. ``stop()`` stops the node and the ``epmd`` it started.

    broker = RabbitBroker.start()       # seconds
    broker.url                          # amqp://guest:guest@127.0.0.1:<port>/%2F
    broker.add_user("jobs", "pw", **JOB_PERMISSIONS)   # a restricted user; broker.url_for("jobs", "pw")
    broker.restart()                    # durable queues and their persistent messages survive
    broker.stop()
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from gpemu.ports import free_port

__all__ = ["RabbitBroker", "BrokerUnavailable", "free_port", "ensure_installed"]


class BrokerUnavailable(RuntimeError):
    """rabbitmq-server is not installed or did not start."""


def ensure_installed() -> None:
    """Install Debian's rabbitmq-server when it is missing and we may (root with apt-get).

    The sharing tests need a real broker; a fresh Debian machine gets one with one package.
    Anyone else gets one clear error saying what to install.
    """
    if _find("rabbitmq-server") and _find("rabbitmqctl"):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "rabbitmq-server"]):
            subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        # The package may start a system broker (where an init system exists); ours uses its own node.
        subprocess.run(
            [_find("rabbitmqctl") or "rabbitmqctl", "-q", "stop"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    if not (_find("rabbitmq-server") and _find("rabbitmqctl")):
        raise BrokerUnavailable(
            "rabbitmq-server is not installed; the sharing manager needs a real broker: "
            "`apt-get install rabbitmq-server` (as root), or point --amqp at an existing broker"
        )


def _find(name: str) -> str | None:
    # Prefer the real scripts over Debian's /usr/sbin wrappers, which switch to the `rabbitmq`
    # user when run as root and then cannot write our private temp directories.
    real = f"/usr/lib/rabbitmq/bin/{name}"
    return real if os.path.exists(real) else shutil.which(name)


class RabbitBroker:
    def __init__(self, base: Path, extra_config: str = "") -> None:
        server = _find("rabbitmq-server")
        ctl = _find("rabbitmqctl")
        if server is None or ctl is None:
            raise BrokerUnavailable(
                "rabbitmq-server is not installed; the sharing tests need a real broker: "
                "`apt-get install rabbitmq-server` (CI installs it)"
            )
        self.server, self.ctl = server, ctl
        self.base = base
        self.port = free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.node = f"gpemu{os.getpid()}x{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"
        self.ready_url = self.url
        self.proc: subprocess.Popen | None = None
        for sub in ("mnesia", "log", "home"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        (base / "enabled_plugins").write_text("[].\n")
        # Loopback-only listener; guest may log in from loopback by default.
        (base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "loopback_users.guest = true\n"
            "disk_free_limit.absolute = 50MB\n" + extra_config
        )

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "RABBITMQ_NODENAME": self.node,
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "ERL_EPMD_PORT": str(self.epmd_port),
                # epmd and the node's distribution listener bind to loopback, like the AMQP listener.
                "ERL_EPMD_ADDRESS": "127.0.0.1",
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
                "RABBITMQ_CTL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
                "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
                "RABBITMQ_LOG_BASE": str(self.base / "log"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
                "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq"),
                "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
                "RABBITMQ_PID_FILE": str(self.base / "rabbit.pid"),
                "ERL_CRASH_DUMP": str(self.base / "erl_crash.dump"),
                "HOME": str(self.base / "home"),  # the Erlang cookie lives here
            }
        )
        return env

    @classmethod
    def start(
        cls, base: Path | None = None, timeout: float = 90.0, extra_config: str = "", ready_url: str | None = None
    ) -> RabbitBroker:
        """Start a node; ``extra_config`` lines go into its rabbitmq.conf, and ``ready_url`` (with
        ``{port}``) is what to log in as to see it is up when the config removes ``guest``."""
        ensure_installed()
        broker = cls(Path(base) if base else Path(tempfile.mkdtemp(prefix="gpemu-rabbit-")), extra_config)
        if ready_url:
            broker.ready_url = ready_url.format(port=broker.port)
        broker._launch(timeout)
        return broker

    def _launch(self, timeout: float) -> None:
        log = open(self.base / "server.out", "ab")
        self.proc = subprocess.Popen(
            [self.server], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        import pika

        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = (self.base / "server.out").read_text(errors="replace")[-2000:]
                raise BrokerUnavailable(f"rabbitmq-server exited with {self.proc.returncode}:\n{tail}")
            try:
                conn = pika.BlockingConnection(
                    pika.URLParameters(self.ready_url + "?connection_attempts=1&socket_timeout=1")
                )
                conn.close()
                return
            except Exception as exc:  # not listening yet
                last = exc
                time.sleep(0.25)
        self.stop()
        raise BrokerUnavailable(f"rabbitmq-server did not accept connections within {timeout:.0f} s: {last!r}")

    def _ctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run([self.ctl, "-n", self.node, *args], env=self.env, capture_output=True, timeout=timeout)

    def url_for(self, user: str, password: str) -> str:
        from urllib.parse import quote

        return f"amqp://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{self.port}/%2F"

    def add_user(self, user: str, password: str, configure: str = ".*", write: str = ".*", read: str = ".*") -> str:
        """Create a broker user with these permission patterns on vhost /; returns its URL.

        The password goes to rabbitmqctl on stdin, never on a command line."""
        for args, stdin in (
            (["add_user", user], password.encode() + b"\n"),
            (["set_permissions", "-p", "/", user, configure, write, read], None),
        ):
            done = subprocess.run(
                [self.ctl, "-n", self.node, *args], env=self.env, capture_output=True, input=stdin, timeout=60
            )
            if done.returncode != 0:
                raise BrokerUnavailable(
                    f"rabbitmqctl {args[0]} {user} failed: {done.stderr.decode(errors='replace')[-500:]}"
                )
        return self.url_for(user, password)

    def stop_node(self) -> None:
        """Stop the broker node (not epmd)."""
        if self.proc is None:
            return
        try:
            self._ctl("stop", timeout=60)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, down_s: float = 0.0, timeout: float = 90.0) -> None:
        """Stop and start the node again on the same port and data directory."""
        self.stop_node()
        time.sleep(down_s)
        self._launch(timeout)

    def stop(self) -> None:
        self.stop_node()
        epmd = shutil.which("epmd")
        if epmd:
            subprocess.run([epmd, "-port", str(self.epmd_port), "-kill"], capture_output=True, timeout=10, env=self.env)
        shutil.rmtree(self.base, ignore_errors=True)

"""Per-node sharing secrets, made on the node itself: nothing secret is committed or typed.

``ensure_secrets(dir)`` creates, once, three random secrets as root-only files:

* ``manager-password``: the broker password of ``gpemu-manager`` (the sharing manager; full rights),
* ``jobs-password``: the broker password of ``gpemu-jobs``, the user every job connects as
  (:data:`JOB_PERMISSIONS`, the sharing protocol's: publish requests, own reply queues, read the
  status; nothing else),
* ``job-secret``: the manager's job secret; the device plugin derives each container's key
  from it.

Both node DaemonSets run it in an initContainer on the same host directory; whichever comes
first creates a file (written aside, then linked into place, so a file is never seen half
written) and the other reads it. ``write_broker_config(secrets, dir)`` turns them into a
RabbitMQ config and definitions file (salted SHA-256 password hashes, the users' permissions),
so the broker starts with exactly these two users and no default ``guest``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import secrets
import tempfile
from pathlib import Path

__all__ = ["ensure_secrets", "write_broker_config", "SECRET_FILES", "MANAGER_USER", "JOBS_USER", "password_hash"]

MANAGER_USER = "gpemu-manager"
JOBS_USER = "gpemu-jobs"
SECRET_FILES = ("manager-password", "jobs-password", "job-secret")
# The sharing protocol's JOB_PERMISSIONS, restated (gpemu.k8s does not import the sharing
# package; tests/test_k8s_secrets.py checks the two equal).
JOB_PERMISSIONS: dict[str, str] = {
    "configure": r"^gpemu\.sharing\.reply\.[A-Za-z0-9_-]+$",
    "write": r"^(gpemu\.sharing\.in|gpemu\.sharing\.reply\.[A-Za-z0-9_-]+)$",
    "read": r"^(gpemu\.sharing\.status|gpemu\.sharing\.reply\.[A-Za-z0-9_-]+)$",
}


def ensure_secrets(directory: str | os.PathLike[str]) -> dict[str, bool]:
    """Create the missing secret files in ``directory``; returns {file: created now?}."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    made = {}
    for name in SECRET_FILES:
        path = root / name
        if path.exists():
            made[name] = False
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=root)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)  # fails if another process got there first: keep theirs
                made[name] = True
            except FileExistsError:
                made[name] = False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return made


def _read(root: Path, name: str) -> str:
    text = (root / name).read_text().strip()
    if not text:
        raise ValueError(f"the secret file {root / name} is empty; delete it to have a new one made")
    return text


def password_hash(password: str, salt: bytes | None = None) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + password))."""
    salt = salt if salt is not None else secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def write_broker_config(
    secrets_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], port: int = 5672
) -> tuple[Path, Path]:
    """``gpemu.conf`` (listener, definitions to load) and ``definitions.json`` (the two users, vhost
    ``/``, their permissions) for RabbitMQ, from the node's secrets. Returns both paths."""
    root, out = Path(secrets_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    users = {MANAGER_USER: _read(root, "manager-password"), JOBS_USER: _read(root, "jobs-password")}
    definitions = {
        "users": [
            {
                "name": name,
                "password_hash": password_hash(pw),
                "hashing_algorithm": "rabbit_password_hashing_sha256",
                "tags": ["administrator"] if name == MANAGER_USER else [],
            }
            for name, pw in users.items()
        ],
        "vhosts": [{"name": "/"}],
        "permissions": [
            {"user": MANAGER_USER, "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
            {"user": JOBS_USER, "vhost": "/", **JOB_PERMISSIONS},
        ],
    }
    defs = out / "definitions.json"
    defs.write_text(json.dumps(definitions, indent=1))
    conf = out / "gpemu.conf"
    conf.write_text(
        "# Written by `gpemu k8s secrets`: the node's two sharing users, no default guest user.\n"
        f"listeners.tcp.default = {port}\n"
        f"load_definitions = {defs}\n"
        "log.console = true\n"
        "log.console.level = warning\n"
    )
    # The broker runs as its own user inside its container; the hashes are salted.
    os.chmod(defs, 0o644)
    os.chmod(conf, 0o644)
    return conf, defs

"""emuGPU files: one small JSON file per emulated GPU on a Kubernetes node.

An emuGPU is what the device plugin advertises to the kubelet in place of a real GPU. It exists
as a file named ``emugpu-<index>.json`` in the node's emuGPU directory, holding the GPU model,
its memory and its index::

    {"kind": "emuGPU", "version": 1, "id": "emugpu-0", "index": 0, "gpu": "V100",
     "memory_bytes": 34359738368, "uuid": "EMU-...", "healthy": true,
     "product": "Tesla V100-PCIE-32GB"}

Creating or deleting files is how an operator adds or removes emuGPUs (the plugin notices), and
``"healthy": false`` marks one as failed without removing it (like a GPU that raised an XID
error), which is handy when studying how schedulers react to GPU failures.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "EmuGpu",
    "DeviceFileError",
    "DEFAULT_DEVICE_DIR",
    "FILE_KIND",
    "create_devices",
    "read_device",
    "scan_devices",
    "list_devices",
    "remove_devices",
    "resolve_gpu",
    "device_file",
]

DEFAULT_DEVICE_DIR = "/var/lib/gpemu/devices"
FILE_KIND = "emuGPU"
FILE_VERSION = 1
_NAME_RE = re.compile(r"^emugpu-(\d+)\.json$")
_MAX_DEVICES = 256


class DeviceFileError(ValueError):
    """An emuGPU file or request is invalid; the message says what is valid."""


@dataclass(frozen=True)
class EmuGpu:
    """One emulated GPU as written in its file."""

    id: str
    index: int
    gpu: str
    memory_bytes: int
    uuid: str
    healthy: bool = True
    # Full product name from the profile database, e.g. "Tesla V100-PCIE-32GB".
    product: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": FILE_KIND, "version": FILE_VERSION, **asdict(self)}


def device_file(directory: str | os.PathLike[str], index: int) -> Path:
    return Path(directory) / f"emugpu-{index}.json"


def resolve_gpu(name: str, db: Any = None) -> tuple[str, int, str]:
    """Short GPU model name (e.g. "V100"), memory (bytes) and full product name from the
    profile database.

    ``db`` is a :class:`gpemu.db.ProfileDB` (opened from the environment's settings when None).
    Unknown names raise the database's error, which lists the valid GPUs.
    """
    if db is None:
        from gpemu.config import EmuConfig
        from gpemu.db import open_profile_db

        db = open_profile_db(EmuConfig.from_env())
    spec = db.gpu(name)
    return getattr(spec, "short_name", spec.name), int(spec.memory_bytes), spec.name


def _atomic_write(path: Path, text: str) -> bool:
    """Write only when the content differs (running pods mount these files), atomically."""
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def create_devices(
    directory: str | os.PathLike[str],
    gpu: str,
    count: int,
    *,
    replace: bool = False,
    db: Any = None,
) -> list[EmuGpu]:
    """Create ``count`` emuGPU files of model ``gpu`` in ``directory``.

    New devices get the indices after the highest existing one, so calling it twice with
    different GPUs builds a mixed node. With ``replace=True`` the directory ends up holding
    exactly indices ``0..count-1``; files whose content would not change are left untouched,
    so re-running it (e.g. from an initContainer after a restart) does not disturb pods that
    mount them.
    """
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= _MAX_DEVICES:
        raise DeviceFileError(f"count must be an integer from 1 to {_MAX_DEVICES}, got {count!r}")
    name, memory, product = resolve_gpu(gpu, db)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    existing = _indices(root)
    if replace:
        for index in existing:
            if index >= count:
                device_file(root, index).unlink(missing_ok=True)
        start = 0
    else:
        start = max(existing) + 1 if existing else 0
    if start + count > _MAX_DEVICES:
        raise DeviceFileError(f"a node holds at most {_MAX_DEVICES} emuGPUs; {root} already has {len(existing)}")
    made = []
    for index in range(start, start + count):
        dev = EmuGpu(
            id=f"emugpu-{index}",
            index=index,
            gpu=name,
            memory_bytes=memory,
            # Stable across re-creation so a re-run initContainer writes identical files.
            uuid="EMU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpemu:{root.resolve()}:{index}:{name}")),
            product=product,
        )
        _atomic_write(device_file(root, index), json.dumps(dev.to_json(), indent=2) + "\n")
        made.append(dev)
    return made


def _indices(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    out = []
    for entry in os.listdir(root):
        m = _NAME_RE.match(entry)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def read_device(path: str | os.PathLike[str]) -> EmuGpu:
    """Parse one emuGPU file; DeviceFileError says what is wrong with it."""
    p = Path(path)
    m = _NAME_RE.match(p.name)
    if not m:
        raise DeviceFileError(f"{p.name}: emuGPU files are named emugpu-<index>.json")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise DeviceFileError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("kind") != FILE_KIND:
        raise DeviceFileError(f'{p}: not an emuGPU file (expected "kind": "{FILE_KIND}")')
    index = int(m.group(1))
    try:
        dev = EmuGpu(
            id=str(data["id"]),
            index=int(data["index"]),
            gpu=str(data["gpu"]),
            memory_bytes=int(data["memory_bytes"]),
            uuid=str(data.get("uuid", "")),
            healthy=bool(data.get("healthy", True)),
            product=str(data.get("product", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DeviceFileError(
            f"{p}: missing or invalid field {exc}; an emuGPU file holds id, index, gpu, memory_bytes"
        ) from None
    if dev.index != index or dev.id != f"emugpu-{index}":
        raise DeviceFileError(f"{p}: id/index {dev.id!r}/{dev.index} do not match the file name")
    if dev.memory_bytes <= 0 or not dev.gpu:
        raise DeviceFileError(f"{p}: gpu must be a GPU name and memory_bytes a positive integer")
    return dev


def scan_devices(directory: str | os.PathLike[str]) -> dict[str, EmuGpu | DeviceFileError]:
    """Every emuGPU file in ``directory`` by device id: the device, or why its file is bad."""
    root = Path(directory)
    out: dict[str, EmuGpu | DeviceFileError] = {}
    for index in _indices(root):
        path = device_file(root, index)
        try:
            out[f"emugpu-{index}"] = read_device(path)
        except FileNotFoundError:
            continue  # removed between listdir and read
        except (DeviceFileError, OSError) as exc:
            out[f"emugpu-{index}"] = exc if isinstance(exc, DeviceFileError) else DeviceFileError(str(exc))
    return out


def list_devices(directory: str | os.PathLike[str]) -> list[EmuGpu]:
    """The valid emuGPUs in ``directory``, index order (bad files are left out)."""
    return [d for d in scan_devices(directory).values() if isinstance(d, EmuGpu)]


def remove_devices(directory: str | os.PathLike[str], ids: Iterable[str] | None = None) -> list[str]:
    """Delete the named emuGPU files (all of them when ``ids`` is None); returns removed ids."""
    root = Path(directory)
    present = {f"emugpu-{i}": device_file(root, i) for i in _indices(root)}
    wanted = list(present) if ids is None else list(ids)
    unknown = [i for i in wanted if i not in present]
    if unknown:
        raise DeviceFileError(f"no emuGPU {', '.join(unknown)} in {root}; present: {', '.join(present) or 'none'}")
    for dev_id in wanted:
        present[dev_id].unlink(missing_ok=True)
    return wanted

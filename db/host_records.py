"""Host records: a real GPU host's framework issue times (``gpemu profile --host-side``).

One table, ``host_records``, owned by this module and created on first write: one row per named
host, with what ``--host db:NAME`` needs to model it (:mod:`gpemu.time.launch`): eager PyTorch's
host seconds per op of a forward pass and of a backward pass (kernel launch included), the
driver's per-launch part of it, and the time of the interpreter reference loop there (host work
the emulator measures on its own machine is scaled by the ratio of the two loops). The CPU's
model name, the torch version and the GPU it was measured on say where the figures come from.

Why a MetaData of its own (as :mod:`gpemu.db.op_measurements`): tables on gpemu.db's
``schema.metadata`` are *shipped*, recreated empty when the default database is rebuilt for new
shipped data; a lab's own measurements are copied whole instead, so they survive that rebuild.

Rows are keyed by name; recording a host again replaces its row.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Column, Engine, Float, Integer, MetaData, String, Table, Text, UniqueConstraint, select

from .schema import has_table

__all__ = ["HostRecord", "host_records", "write_host", "read_host", "read_hosts", "check_host_name", "HOST_NAME_FORM"]

metadata = MetaData()

host_records = Table(
    "host_records",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(128), nullable=False),
    Column("cpu", String(256), nullable=False),  # the CPU's model name (/proc/cpuinfo)
    Column("torch_version", String(64), nullable=False),
    Column("gpu", String(128), nullable=False),  # the GPU the host issued to while measured
    Column("forward_op_s", Float, nullable=False),  # host seconds per op of an eager forward pass
    Column("backward_op_s", Float, nullable=False),  # the same, of a backward pass (autograd's engine)
    Column("launch_s", Float, nullable=False),  # of which a kernel launch (CUDA runtime and driver)
    Column("reference_ms", Float, nullable=False),  # the interpreter reference loop there
    Column("measured_at", String(40), nullable=False),
    Column("metadata_json", Text, nullable=False, default="{}"),
    UniqueConstraint("name", name="uq_host_record"),
)

# A recorded host's name: lower case (settings are), usable after ``db:`` on a command line.
HOST_NAME_FORM = r"[a-z0-9][a-z0-9._-]{0,63}"


@dataclass(frozen=True)
class HostRecord:
    """One recorded host (see the module docstring for the fields)."""

    name: str
    cpu: str
    torch_version: str
    gpu: str
    forward_op_s: float
    backward_op_s: float
    launch_s: float
    reference_ms: float
    measured_at: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def check_host_name(name: str) -> str:
    """``name`` when it is a valid host record name, else a ValueError saying the form."""
    if not re.fullmatch(HOST_NAME_FORM, name):
        raise ValueError(
            f"a recorded host's name is 1-64 lower-case letters, digits, '.', '_' or '-' (starting with a "
            f"letter or digit), e.g. h100-node07; got {name!r}"
        )
    return name


def write_host(engine: Engine, record: HostRecord) -> HostRecord:
    """Store ``record`` (replacing a host of the same name) and return it as stored (stamped)."""
    check_host_name(record.name)
    metadata.create_all(engine, checkfirst=True)
    stamp = record.measured_at or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t = host_records
    with engine.begin() as conn:
        conn.execute(t.delete().where(t.c.name == record.name))
        conn.execute(
            t.insert().values(
                name=record.name,
                cpu=record.cpu,
                torch_version=record.torch_version,
                gpu=record.gpu,
                forward_op_s=record.forward_op_s,
                backward_op_s=record.backward_op_s,
                launch_s=record.launch_s,
                reference_ms=record.reference_ms,
                measured_at=stamp,
                metadata_json=json.dumps(record.metadata, sort_keys=True, default=str),
            )
        )
    return read_host(engine, record.name) or record


def read_hosts(engine: Engine) -> list[HostRecord]:
    """Every recorded host, by name (none when nothing was recorded yet: no table)."""
    if not has_table(engine, host_records):
        return []
    t = host_records
    with engine.connect() as conn:
        rows = conn.execute(select(t).order_by(t.c.name)).all()
    return [
        HostRecord(
            name=r.name,
            cpu=r.cpu,
            torch_version=r.torch_version,
            gpu=r.gpu,
            forward_op_s=r.forward_op_s,
            backward_op_s=r.backward_op_s,
            launch_s=r.launch_s,
            reference_ms=r.reference_ms,
            measured_at=r.measured_at,
            metadata=json.loads(r.metadata_json or "{}"),
        )
        for r in rows
    ]


def read_host(engine: Engine, name: str) -> HostRecord | None:
    """The host recorded under ``name``, or None."""
    return next((h for h in read_hosts(engine) if h.name == name), None)

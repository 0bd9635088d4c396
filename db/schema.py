"""SQLAlchemy 2.x schema of the profile database.

Unique constraints make every write an upsert on a natural key, so importing the same data
twice (or the profiler re-measuring) never duplicates rows.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    inspect,
)
from sqlalchemy.exc import SQLAlchemyError

__all__ = [
    "SCHEMA_VERSION",
    "MIGRATIONS",
    "metadata",
    "meta",
    "gpus",
    "models",
    "measurements",
    "distributions",
    "has_table",
]

# Bump when tables change: default databases built by an older gpemu are rebuilt on open (the
# user's rows carried over), other databases (--db URL) are migrated in place by MIGRATIONS.
# 1: the first schema. 2: GPUs carry every fact the cost model prices ops with (generation,
# compute capability, FP64 / non-tensor FP16 / tensor-core peaks, PCIe generation, NVLink),
# their source and provenance.
SCHEMA_VERSION = 2

metadata = MetaData()

meta = Table(
    "meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

gpus = Table(
    "gpus",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("aliases", Text, nullable=False, default="[]"),  # JSON list; short alias first
    Column("memory_bytes", BigInteger, nullable=False),
    Column("fp32_flops", Float, nullable=False),
    Column("fp16_flops", Float, nullable=False),
    Column("memory_bandwidth", Float, nullable=False),  # bytes/s
    Column("host_link_bandwidth_pinned", Float, nullable=False),  # bytes/s
    Column("host_link_bandwidth_pageable", Float, nullable=False),  # bytes/s
    Column("sm_count", Integer, nullable=False),
    # Schema 2. NULL: not known (a GPU added before schema 2, or a user who left it out).
    Column("generation", String(32), nullable=True),
    Column("compute_capability", String(8), nullable=True),  # "9.0"
    Column("fp64_flops", Float, nullable=True),
    Column("fp16_nontensor_flops", Float, nullable=True),
    Column("tf32_tensor_flops", Float, nullable=True),  # dense, FP32 accumulation; 0: none
    Column("fp16_tensor_flops", Float, nullable=True),
    Column("bf16_tensor_flops", Float, nullable=True),
    Column("pcie_gen", Integer, nullable=True),
    Column("nvlink_bandwidth", Float, nullable=True),  # bytes/s, all links both directions; 0: none
    Column("source", Text, nullable=False, server_default=""),
    # "datasheet" (shipped), "user" (gpemu gpus add / import), "profiled" (gpemu profile measured it)
    Column("provenance", String(16), nullable=False, server_default="user"),
)

models = Table(
    "models",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("class_name", String(128), nullable=False),
    Column("param_count", BigInteger, nullable=False),
    Column("param_bytes", BigInteger, nullable=False),
    Column("buffer_bytes", BigInteger, nullable=False),
    Column("fwd_flops_per_sample", Float, nullable=False),
    Column("fwd_bwd_flops_per_sample", Float, nullable=False),
    Column("input_size", Integer, nullable=True),
    Column("fingerprint", String(128), nullable=True),
)

measurements = Table(
    "measurements",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("gpu_id", Integer, ForeignKey("gpus.id", ondelete="CASCADE"), nullable=False),
    Column("model_id", Integer, ForeignKey("models.id", ondelete="CASCADE"), nullable=False),
    Column("kind", String(32), nullable=False),
    # 0 for batch-independent kinds (model_transfer); never NULL so the unique key holds.
    Column("batch_size", Integer, nullable=False),
    Column("world_size", Integer, nullable=False, default=1),
    Column("value", Float, nullable=False),
    Column("unit", String(16), nullable=False),  # "seconds" | "bytes" | "samples"
    Column("samples", Integer, nullable=True),
    Column("std", Float, nullable=True),
    Column("p50", Float, nullable=True),
    Column("p90", Float, nullable=True),
    Column("p99", Float, nullable=True),
    Column("source", Text, nullable=False, default=""),
    Column("measured_at", String(40), nullable=True),
    Column("metadata_json", Text, nullable=False, default="{}"),
    UniqueConstraint("gpu_id", "model_id", "kind", "batch_size", "world_size", name="uq_measurement"),
)

distributions = Table(
    "distributions",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("unit", String(16), nullable=False),
    Column("samples_json", Text, nullable=False),  # JSON list of floats, in recorded order
    Column("source", Text, nullable=False, default=""),
    Column("description", Text, nullable=False, default=""),
)

# In-place upgrades of a database made by an older schema (statements per old version; each
# brings the database to the next version). Tables new in a version are made by create_all.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: tuple(
        f"ALTER TABLE gpus ADD COLUMN {name} {sql}"
        for name, sql in (
            ("generation", "VARCHAR(32)"),
            ("compute_capability", "VARCHAR(8)"),
            ("fp64_flops", "FLOAT"),
            ("fp16_nontensor_flops", "FLOAT"),
            ("tf32_tensor_flops", "FLOAT"),
            ("fp16_tensor_flops", "FLOAT"),
            ("bf16_tensor_flops", "FLOAT"),
            ("pcie_gen", "INTEGER"),
            ("nvlink_bandwidth", "FLOAT"),
            ("source", "TEXT NOT NULL DEFAULT ''"),
            ("provenance", "VARCHAR(16) NOT NULL DEFAULT 'user'"),
        )
    ),
}


def has_table(engine: Engine, table: Table) -> bool:
    """Whether the database at ``engine`` has ``table`` (False when it cannot be read): the
    optional tables (op sweeps, recorded hosts) exist only once something was written to them."""
    try:
        return inspect(engine).has_table(table.name)
    except SQLAlchemyError:
        return False

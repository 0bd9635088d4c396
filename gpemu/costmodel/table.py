"""Many ops at once: a struct of numpy arrays, with features as affine functions of batch size.

Pricing one op at a time is what the emulator does at run time; fitting and benchmarking price
every op of 36 models at many batch sizes thousands of times, so they use an :class:`OpTable`.
For a CNN or a transformer every op's FLOPs and bytes are ``a + b x batch`` (activations scale
with the batch, weights do not), and so is a GEMM's reduction depth K (a weight gradient reduces
over the batch: K = batch x tokens), so a model recorded at two batch sizes is known at all of them:
:func:`affine_table` checks the two recordings have the same op sequence and derives ``a``/``b``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from .classify import OpClass, OpFeatures

__all__ = ["CLASSES", "DTYPES", "OpTable", "table_from_ops", "affine_table", "concat_tables"]

# Fixed orders: integer codes in tables and cache files.
CLASSES: tuple[OpClass, ...] = tuple(c for c in OpClass if c is not OpClass.FREE)
_CLASS_CODE = {c: i for i, c in enumerate(CLASSES)}
DTYPES: tuple[str, ...] = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "bool",
    "uint8",
    "int8",
    "float8_e4m3fn",
    "float8_e5m2",
    "other",
)
_DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}


@dataclass
class OpTable:
    """Ops of one or many models; ``flops = flops0 + flops1 x batch`` (same for ``nbytes`` and
    the reduction depth K: ``reduction + reduction1 x batch``).

    ``model`` numbers the model each op belongs to (0 for a single model); ``backward`` is 1 for
    backward-pass ops. ``names`` holds the op names (``name`` indexes into it).
    """

    cls: np.ndarray  # int8 code into CLASSES
    backward: np.ndarray  # int8 0/1
    flops0: np.ndarray
    flops1: np.ndarray
    bytes0: np.ndarray
    bytes1: np.ndarray
    dtype: np.ndarray  # int8 code into DTYPES
    groups: np.ndarray  # int32
    kernel: np.ndarray  # int32
    stride: np.ndarray  # int32
    reduction: np.ndarray  # float64: K at batch 0 (the intercept)
    reduction1: np.ndarray  # float64: K per sample (a weight gradient's K grows with the batch)
    name: np.ndarray  # int32 index into names
    model: np.ndarray  # int32
    names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return int(self.cls.shape[0])

    def flops(self, batch: float) -> np.ndarray:
        return self.flops0 + self.flops1 * batch

    def nbytes(self, batch: float) -> np.ndarray:
        return self.bytes0 + self.bytes1 * batch

    def depth(self, batch: float) -> np.ndarray:
        """The reduction depth K of each op at ``batch`` (0 where the op has none)."""
        return self.reduction + self.reduction1 * batch

    def select(self, mask: np.ndarray) -> OpTable:
        """The ops where ``mask`` is true (same names list)."""
        kw = {f.name: getattr(self, f.name)[mask] for f in fields(self) if f.name != "names"}
        return OpTable(names=self.names, **kw)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays for ``np.savez`` (names as a string array)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "names"}
        d["names"] = np.array(self.names, dtype=str)
        return d

    @classmethod
    def from_arrays(cls, d: dict[str, np.ndarray]) -> OpTable:
        kw = {f.name: np.asarray(d[f.name]) for f in fields(cls) if f.name != "names" and f.name in d}
        if "reduction1" not in kw:  # tables written before K was affine in the batch
            kw["reduction1"] = np.zeros(len(kw["cls"]))
        kw["reduction"] = kw["reduction"].astype(np.float64)
        return cls(names=tuple(str(x) for x in d["names"]), **kw)


def _codes(ops: Sequence[OpFeatures], names: dict[str, int]) -> dict[str, np.ndarray]:
    ops = [o for o in ops if o.op_class is not OpClass.FREE]
    for o in ops:
        names.setdefault(o.name, len(names))
    return {
        "cls": np.array([_CLASS_CODE[o.op_class] for o in ops], dtype=np.int8),
        "backward": np.array([int(o.backward) for o in ops], dtype=np.int8),
        "flops": np.array([o.flops for o in ops], dtype=np.float64),
        "nbytes": np.array([o.nbytes for o in ops], dtype=np.float64),
        "dtype": np.array([_DTYPE_CODE.get(o.dtype, _DTYPE_CODE["other"]) for o in ops], dtype=np.int8),
        "groups": np.array([o.groups for o in ops], dtype=np.int32),
        "kernel": np.array([o.kernel for o in ops], dtype=np.int32),
        "stride": np.array([o.stride for o in ops], dtype=np.int32),
        "reduction": np.array([o.reduction for o in ops], dtype=np.float64),
        "name": np.array([names[o.name] for o in ops], dtype=np.int32),
    }


def table_from_ops(ops: Sequence[OpFeatures], model: int = 0) -> OpTable:
    """A table of ops recorded at one batch size (features constant: ``*1`` arrays are zero)."""
    names: dict[str, int] = {}
    c = _codes(ops, names)
    zeros = np.zeros_like(c["flops"])
    return OpTable(
        cls=c["cls"],
        backward=c["backward"],
        flops0=c["flops"],
        flops1=zeros,
        bytes0=c["nbytes"],
        bytes1=zeros.copy(),
        dtype=c["dtype"],
        groups=c["groups"],
        kernel=c["kernel"],
        stride=c["stride"],
        reduction=c["reduction"],
        reduction1=np.zeros_like(c["reduction"]),
        name=c["name"],
        model=np.full(len(c["cls"]), model, dtype=np.int32),
        names=tuple(names),
    )


def affine_table(
    ops_a: Sequence[OpFeatures], batch_a: int, ops_b: Sequence[OpFeatures], batch_b: int, model: int = 0
) -> OpTable:
    """Features as ``a + b x batch`` from the same module recorded at two batch sizes.

    Raises ``ValueError`` when the two recordings differ in their op sequence (a module whose
    ops depend on the batch size cannot be scaled this way; record it at the batch you need).
    """
    names: dict[str, int] = {}
    a, b = _codes(ops_a, names), _codes(ops_b, names)
    if len(a["cls"]) != len(b["cls"]) or not np.array_equal(a["name"], b["name"]):
        raise ValueError("the op sequence changes with the batch size; record at each batch size instead")
    slope_f = (b["flops"] - a["flops"]) / (batch_b - batch_a)
    slope_b = (b["nbytes"] - a["nbytes"]) / (batch_b - batch_a)
    slope_k = (b["reduction"] - a["reduction"]) / (batch_b - batch_a)
    return OpTable(
        cls=a["cls"],
        backward=a["backward"],
        flops0=a["flops"] - slope_f * batch_a,
        flops1=slope_f,
        bytes0=a["nbytes"] - slope_b * batch_a,
        bytes1=slope_b,
        dtype=a["dtype"],
        groups=a["groups"],
        kernel=a["kernel"],
        stride=a["stride"],
        reduction=a["reduction"] - slope_k * batch_a,
        reduction1=slope_k,
        name=a["name"],
        model=np.full(len(a["cls"]), model, dtype=np.int32),
        names=tuple(names),
    )


def concat_tables(tables: Sequence[OpTable]) -> OpTable:
    """One table of several (names merged; ``model`` kept as each table has it)."""
    names: dict[str, int] = {}
    parts = []
    for t in tables:
        remap = np.array([names.setdefault(n, len(names)) for n in t.names] or [0], dtype=np.int32)
        parts.append((t, remap[t.name] if len(t) else t.name))
    kw = {}
    for f in fields(OpTable):
        if f.name in ("names", "name"):
            continue
        kw[f.name] = np.concatenate([getattr(t, f.name) for t, _ in parts])
    kw["name"] = np.concatenate([n for _, n in parts])
    return OpTable(names=tuple(names), **kw)

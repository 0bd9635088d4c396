"""The cost model's calibration data: each database model's ops (recorded once, cached) and its
measured times. A tool (``gpemu.profiler``), not part of the pricing library ``gpemu.costmodel``.

Used by the fit (:mod:`gpemu.profiler.costfit`) and the accuracy benchmark only, never on the
pricing path. The op lists come from ``examples/tvmodels/`` of the repository (plain-PyTorch
copies of the 36 torchvision architectures; found through ``sys.path``, the working directory or
this file's checkout), built on the meta device in train mode, input ``N x 3 x 224 x 224``,
one step of the loop the database measured (:mod:`gpemu.costmodel.measured_loop`), recorded at
two batch sizes and stored as :class:`~gpemu.costmodel.table.OpTable` (features affine in the
batch size). Recording all 36 takes ~40 s on one core; the result is cached in
``$GPEMU_COSTMODEL_CACHE`` (default ``~/.cache/gpemu/costmodel``) under a key that changes whenever
the recording code or torch changes.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gpemu.config import costmodel_cache_dir
from gpemu.costmodel.table import OpTable, affine_table

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.db import ProfileDB

__all__ = [
    "RECORD_BATCHES",
    "cache_dir",
    "record_model",
    "model_tables",
    "Measurements",
    "load_measurements",
    "repo_models",
    "code_key",
    "load_arrays",
    "save_arrays",
]

RECORD_BATCHES = (2, 4)
_SOURCES = ("classify.py", "flops.py", "record.py", "table.py", "measured_loop.py")


def cache_dir() -> Path:
    """Where recorded op tables are cached (outside the repository; gpemu.config says where)."""
    return costmodel_cache_dir()


def _library_dir() -> Path:
    import gpemu.costmodel

    return Path(gpemu.costmodel.__file__).resolve().parent


def _cache_key() -> str:
    import torch

    h = hashlib.sha1(torch.__version__.encode())
    here = _library_dir()
    for name in _SOURCES:
        h.update((here / name).read_bytes())
    h.update(inspect.getsource(record_model).encode() + repr(RECORD_BATCHES).encode())
    return h.hexdigest()[:12]


def code_key(*extra: str) -> str:
    """A key that changes whenever any module of the cost model library, this module or the fit
    (or ``extra``) changes: results cached under it (cross-validation predictions) are never stale."""
    import torch

    h = hashlib.sha1(torch.__version__.encode())
    here = Path(__file__).resolve().parent
    for path in [*sorted(_library_dir().glob("*.py")), here / "costdata.py", here / "costfit.py"]:
        h.update(path.read_bytes())
    for e in extra:
        h.update(e.encode())
    return h.hexdigest()[:12]


def load_arrays(name: str) -> dict[str, np.ndarray] | None:
    """Arrays cached under ``name`` (see :func:`save_arrays`), or None."""
    path = cache_dir() / f"{name}.npz"
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def save_arrays(name: str, arrays: dict[str, np.ndarray]) -> None:
    """Cache arrays under ``name`` (written atomically: concurrent runs never read half a file)."""
    _write_npz(cache_dir() / f"{name}.npz", arrays)


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` in one compressed .npz at ``path``, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez_compressed(tmp, **arrays)  # type: ignore[arg-type]  # (numpy's stub reads **arrays as its allow_pickle)
    os.replace(tmp, path)


def repo_models() -> dict[str, Callable[[], object]]:
    """``examples.tvmodels.MODELS`` of the gpemu repository: importable as it is, or found in the
    working directory or next to this file's checkout (``profiler/`` sits at the repository's
    root). Raises ``ImportError`` outside a checkout: the installed package does not need it."""
    try:  # (the repository's examples/, not a package: imported by name)
        tvmodels = importlib.import_module("examples.tvmodels")
    except ImportError:
        roots = [Path.cwd(), Path(__file__).resolve().parents[1]]
        root = next((r for r in roots if (r / "examples" / "tvmodels" / "__init__.py").exists()), None)
        if root is None:
            raise ImportError("examples/tvmodels/ not found: run from a gpemu repository checkout") from None
        sys.path.insert(0, str(root))
        tvmodels = importlib.import_module("examples.tvmodels")
    return tvmodels.MODELS


def record_model(
    builder: Callable[[], object], batches: Sequence[int] = RECORD_BATCHES, image: int = 224, model: int = 0
) -> OpTable:
    """Forward + backward ops of ``builder()`` (an ``nn.Module``) in the loop the database measured
    (:func:`gpemu.costmodel.measured_loop.record_measured_step`) as an affine table."""
    import torch

    from gpemu.costmodel.measured_loop import record_measured_step

    with torch.device("meta"):
        module = builder()
    module.train()  # type: ignore[attr-defined]
    recs = []
    for n in batches[:2]:
        fwd, bwd = record_measured_step(module, torch.empty(n, 3, image, image, device="meta"))
        recs.append(fwd + bwd)
    return affine_table(recs[0], batches[0], recs[1], batches[1], model=model)


def model_tables(
    names: Iterable[str] | None = None, *, use_cache: bool = True, progress: Callable[[str], None] | None = None
) -> dict[str, OpTable]:
    """Op tables of the database's models (all of ``examples.tvmodels`` by default), cached."""
    builders = repo_models()
    wanted = list(names) if names is not None else list(builders)
    path = cache_dir() / f"optables-{_cache_key()}.npz"
    cached: dict[str, OpTable] = {}
    if use_cache and path.exists():
        with np.load(path, allow_pickle=False) as z:
            for key in {k.split("/")[0] for k in z.files}:
                cached[key] = OpTable.from_arrays(
                    {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(key + "/")}
                )
    missing = [n for n in wanted if n not in cached]
    for name in missing:
        if progress:
            progress(name)
        cached[name] = record_model(builders[name])
    if missing and use_cache:
        _write_npz(path, {f"{n}/{k}": v for n, t in cached.items() for k, v in t.to_arrays().items()})
        for old in path.parent.glob("optables-*.npz"):  # tables of older code are never read again
            if old != path and ".tmp" not in old.name:
                old.unlink(missing_ok=True)
    return {n: cached[n] for n in wanted}


@dataclass
class Measurements:
    """Measured forward/backward seconds: ``seconds[gpu][model][phase]`` -> (batches, seconds)."""

    gpus: tuple[str, ...]  # database GPU names
    models: tuple[str, ...]
    series: dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray]]

    def get(self, gpu: str, model: str, phase: str, batches: Sequence[int]) -> np.ndarray:
        """Seconds at ``batches`` (exact batch sizes must be measured; NaN where not)."""
        xs, ys = self.series[(gpu, model, phase)]
        out = np.full(len(batches), np.nan)
        idx = np.searchsorted(xs, batches)
        for i, (b, j) in enumerate(zip(batches, idx, strict=False)):
            if j < len(xs) and xs[j] == b:
                out[i] = ys[j]
        return out


def load_measurements(db: ProfileDB, models: Sequence[str] | None = None) -> Measurements:
    """Every measured forward/backward series of the database's GPUs and ``models``."""
    gpus = tuple(g.name for g in db.gpus())
    names = tuple(models) if models is not None else tuple(m.name for m in db.models())
    series: dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray]] = {}
    for g in gpus:
        for m in names:
            for phase in ("forward", "backward"):
                pts = db.series(g, m, phase)
                if pts:
                    xs, ys = zip(*pts, strict=False)
                    series[(g, m, phase)] = (np.asarray(xs, dtype=float), np.asarray(ys, dtype=float))
    # The database also lists datasheet-only GPUs (no measurements): not calibration data.
    gpus = tuple(g for g in gpus if any(k[0] == g for k in series))
    return Measurements(gpus=gpus, models=names, series=series)

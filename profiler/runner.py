"""The profiling loop: models x batch sizes into the profile database.

One *unit* is one (model, batch size): warm-up iterations (not recorded), then the recorded
iterations, then all of the unit's rows in one transaction. Units already in the database are
skipped unless ``force``. A batch size that runs out of memory is recorded as the model's limit
on the GPU, larger batch sizes of that model are skipped, and profiling goes on with the next
model. Ctrl-C between or during units keeps the database consistent: an unfinished unit is
simply not written (a write in progress is finished first), then :class:`Interrupted` is raised.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from gpemu.db import Measurement, ModelInfo

from .device import device_memory, device_name, measure_gpu_spec, run_metadata
from .measure import BatchMeasurement, Measurer, Stats
from .models import LoadedModel, ModelSpecError, load_model, model_name_of, structural_fingerprint
from .store import LIMIT_KIND, PINNED_KIND, ProfileStore, now_iso

__all__ = ["ProfileOptions", "ProfileReport", "Interrupted", "profile_models", "unit_rows"]


@dataclass
class ProfileOptions:
    models: Sequence[str]
    batch_sizes: Sequence[int]
    device: torch.device
    gpu_name: str | None = None  # None: what the device reports ("cpu" on the CPU)
    input_shape: tuple[int, ...] | None = None
    input_dtype: torch.dtype = torch.float32
    num_classes: int | None = None
    warmup: int = 3
    iterations: int = 20
    optimizer: str = "sgd"
    memory_limit: int | None = None  # bytes
    force: bool = False


@dataclass
class ProfileReport:
    """What a run did, for the closing message."""

    gpu: str = ""
    measured: list[tuple[str, int]] = field(default_factory=list)
    skipped: list[tuple[str, int]] = field(default_factory=list)
    limits: dict[str, tuple[int, int]] = field(default_factory=dict)  # model -> (oom at, largest fit)
    model_transfers: list[str] = field(default_factory=list)


class Interrupted(Exception):
    """Ctrl-C: the database holds every unit finished before it; ``report`` says which."""

    def __init__(self, report: ProfileReport) -> None:
        super().__init__("interrupted")
        self.report = report


class _SigintGuard:
    """SIGINT raises KeyboardInterrupt at once, except inside ``critical()`` (a database write),
    where it is held until the write has finished."""

    def __init__(self) -> None:
        self._critical = 0
        self.pending = False
        self._old: Any = None

    def __enter__(self) -> _SigintGuard:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)

    def _handler(self, signum: int, frame: Any) -> None:
        if self._critical:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def critical(self) -> Iterator[None]:
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if self.pending and not self._critical:
            self.pending = False
            raise KeyboardInterrupt


def _stat_row(
    gpu: str,
    model: str,
    kind: str,
    batch_size: int,
    stats: Stats,
    meta: dict[str, Any],
    measured_at: str,
    world_size: int = 1,
) -> Measurement:
    return Measurement(
        gpu=gpu,
        model=model,
        kind=kind,
        batch_size=batch_size,
        world_size=world_size,
        value=stats.mean,
        samples=stats.count,
        std=stats.std,
        p50=stats.p50,
        p90=stats.p90,
        p99=stats.p99,
        source="gpemu profile",
        measured_at=measured_at,
        metadata={**meta, "min": stats.min, "max": stats.max},
    )


def unit_rows(gpu: str, model: str, m: BatchMeasurement, meta: dict[str, Any]) -> list[Measurement]:
    """The database rows of one measured (model, batch size)."""
    at = now_iso()
    bs = m.batch_size
    t = m.times
    pinned = t["h2d_pinned"].as_dict()
    rows = [
        _stat_row(gpu, model, "forward", bs, t["forward"], meta, at),
        _stat_row(gpu, model, "backward", bs, t["backward"], meta, at),
        _stat_row(gpu, model, "optimizer_step", bs, t["optimizer_step"], meta, at),
        # h2d_transfer is the pageable copy (what the shipped GPEmu data measured); the pinned
        # copy has its own kind (and rides along in h2d_transfer's metadata for older readers).
        _stat_row(
            gpu,
            model,
            "h2d_transfer",
            bs,
            t["h2d_pageable"],
            {**meta, "memory": "pageable", "input_bytes": m.input_bytes, "pinned": pinned},
            at,
        ),
        _stat_row(
            gpu, model, PINNED_KIND, bs, t["h2d_pinned"], {**meta, "memory": "pinned", "input_bytes": m.input_bytes}, at
        ),
        _stat_row(
            gpu,
            model,
            "d2h_transfer",
            bs,
            t["d2h_transfer"],
            {**meta, "what": "one input batch, device to pageable host memory", "input_bytes": m.input_bytes},
            at,
        ),
    ]
    mem_meta = {**meta, "memory_method": m.memory_method}
    for kind, value in (("peak_memory", m.peak_memory), ("persistent_memory", m.persistent_memory)):
        rows.append(
            Measurement(
                gpu=gpu,
                model=model,
                kind=kind,
                batch_size=bs,
                value=float(value),
                samples=t["forward"].count,
                source="gpemu profile",
                measured_at=at,
                metadata=mem_meta,
            )
        )
    return rows


def profile_models(
    store: ProfileStore,
    opts: ProfileOptions,
    progress: Callable[[str, int], None] | None = None,
    set_total: Callable[[int], None] | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> ProfileReport:
    """Profile every model at every batch size into ``store``.

    ``progress(description, advance)`` is called as units finish or are skipped; ``log`` gets
    one line per notable event (skips, OOM limits).
    """
    report = ProfileReport()
    advance = progress or (lambda desc, n: None)
    device = opts.device
    gpu = opts.gpu_name or device_name(device)
    memory_bytes = device_memory(device, opts.memory_limit)
    spec = store.gpu(gpu)
    if spec is None:
        log(f"'{gpu}' is new to the database: measuring its FLOP rate and bandwidths")
        spec = measure_gpu_spec(device, gpu, memory_bytes)
        store.add_gpu(spec)
    gpu = spec.name
    report.gpu = gpu
    meta = run_metadata(device, gpu, memory_bytes)
    meta.update(
        optimizer=opts.optimizer, warmup=opts.warmup, iterations=opts.iterations, memory_limit=opts.memory_limit
    )
    sizes = sorted(set(opts.batch_sizes))
    remaining = [len(opts.models) * len(sizes)]

    def drop(n: int) -> None:
        # Skipped units leave the total instead of counting as done, so the ETA reflects real work.
        remaining[0] -= n
        if set_total:
            set_total(remaining[0])

    drop(0)

    with _SigintGuard() as guard:
        session = _Session(store, opts, gpu, sizes, meta, report, guard, advance, drop, log)
        try:
            for spec_text in opts.models:
                session.profile(spec_text)
        except KeyboardInterrupt:
            raise Interrupted(report) from None
    return report


@dataclass
class _Session:
    """What every model of one :func:`profile_models` run shares: where rows go, the options,
    the GPU, the run's metadata and report, the Ctrl-C guard and the progress callbacks."""

    store: ProfileStore
    opts: ProfileOptions
    gpu: str
    sizes: list[int]
    meta: dict[str, Any]
    report: ProfileReport
    guard: _SigintGuard
    advance: Callable[[str, int], None]
    drop: Callable[[int], None]  # units that will not be measured after all
    log: Callable[[str], None]

    def profile(self, spec_text: str) -> None:
        """One model: its model transfer, then its batch sizes until one runs out of memory."""
        name = model_name_of(spec_text)
        # Loaded even when everything is done, so a different model reusing the name is caught.
        lm = load_model(spec_text, self.opts.input_shape, self.opts.input_dtype, self.opts.num_classes)
        if not self.opts.force:
            _check_same_model(self.store, lm)
        todo = self._batch_sizes_to_measure(name)
        if not todo and not self.opts.force and self.store.has_model_transfer(self.gpu, name):
            return
        measurer = Measurer(lm, self.opts.device, self.opts.optimizer, self.opts.memory_limit)
        model_meta = {
            **self.meta,
            "input_shape": list(lm.sample_shape),
            "input_dtype": str(lm.input_dtype).removeprefix("torch."),
            "num_classes": lm.num_classes,
            "model_spec": lm.spec,
        }
        self._model_transfer(name, lm, measurer, model_meta)
        below = min(todo, default=0)
        largest_fit = max((b for b in self.store.done_batch_sizes(self.gpu, name) if b < below), default=0)
        for i, bs in enumerate(todo):
            self.advance(f"{name}: batch {bs}", 0)
            measured = _measure(name, measurer, lm, bs, self.opts)
            if isinstance(measured, str):  # out of memory: this model's limit on the GPU
                measurer.release()
                self._record_limit(name, bs, largest_fit, measured, model_meta, rest=len(todo) - i)
                break
            rows = unit_rows(self.gpu, name, measured, model_meta)
            with self.guard.critical():
                self.store.write_unit(rows)
            largest_fit = bs
            self.report.measured.append((name, bs))
            self.advance(f"{name}: batch {bs}", 1)
        measurer.release()
        del measurer, lm
        if self.opts.device.type == "cuda":
            torch.cuda.empty_cache()

    def _batch_sizes_to_measure(self, name: str) -> list[int]:
        """The batch sizes of ``name`` still to measure: all with --force, else those neither in
        the database nor at or above a batch size that ran out of memory before (said once)."""
        todo = list(self.sizes)
        if self.opts.force:
            return todo
        done = self.store.done_batch_sizes(self.gpu, name)
        limit = self.store.limit(self.gpu, name)
        skip = [b for b in todo if b in done or (limit is not None and b >= limit.oom_batch_size)]
        if skip:
            self.report.skipped.extend((name, b) for b in skip)
            self.drop(len(skip))
            self.advance(f"{name}: {len(skip)} batch size(s) already done", 0)
            if limit is not None and any(b >= limit.oom_batch_size for b in skip):
                self.log(
                    f"{name}: batch sizes >= {limit.oom_batch_size} skipped (out of memory on {self.gpu} before; "
                    f"--force to retry)"
                )
        return [b for b in todo if b not in skip]

    def _model_transfer(self, name: str, lm: LoadedModel, measurer: Measurer, model_meta: dict[str, Any]) -> None:
        """The model moved to the device (timed unless the database has it), and registered."""
        self.advance(f"{name}: model transfer", 0)
        if self.opts.force or not self.store.has_model_transfer(self.gpu, name):
            transfer = measurer.measure_model_transfer()
        else:
            transfer = None
            measurer.to_device()
        # Registered (upserted) before any measurement row, since rows refer to it; FLOPs are
        # counted on the device. Every run that measures something refreshes it.
        _register_model(self.store, lm, measurer)
        if self.opts.force:
            self.store.clear_limit(self.gpu, name)
        if transfer is not None:
            row = _stat_row(self.gpu, name, "model_transfer", 0, transfer, model_meta, now_iso())
            with self.guard.critical():
                self.store.write_unit([row])
            self.report.model_transfers.append(name)

    def _record_limit(
        self, name: str, bs: int, largest_fit: int, message: str, model_meta: dict[str, Any], rest: int
    ) -> None:
        """Batch size ``bs`` ran out of memory: stored as the model's limit; the ``rest`` batch
        sizes from it on are dropped."""
        extra = [
            Measurement(
                gpu=self.gpu,
                model=name,
                kind=LIMIT_KIND,
                batch_size=0,
                value=float(largest_fit),
                source="gpemu profile",
                measured_at=now_iso(),
                metadata={**model_meta, "oom_batch_size": bs},
            )
        ]
        with self.guard.critical():
            self.store.record_limit(self.gpu, name, bs, largest_fit, message, model_meta, extra)
        self.report.limits[name] = (bs, largest_fit)
        self.log(
            f"{name}: out of memory at batch size {bs} on {self.gpu} (largest that fit: {largest_fit or 'none'}); "
            f"skipping {rest - 1} larger batch size(s), going on with the next model"
        )
        self.drop(rest)
        self.advance(f"{name}: out of memory at {bs}", 0)


def _measure(name: str, measurer: Measurer, lm: LoadedModel, bs: int, opts: ProfileOptions) -> BatchMeasurement | str:
    """One unit's measurement, or the first line of its out-of-memory error. Any other failure
    of the training iteration is a ModelSpecError saying which options to check."""
    try:
        return measurer.measure(bs, opts.warmup, opts.iterations)
    except torch.OutOfMemoryError as exc:
        # Only the text is kept: the exception's frames hold the batch's tensors, which must be
        # gone before release() returns their memory to the device.
        return (str(exc).strip().splitlines() or ["out of memory"])[0]
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelSpecError(
            f"{name}: a training iteration failed at batch size {bs} ({type(exc).__name__}: {first}); "
            f"check --input-shape (now {','.join(map(str, lm.sample_shape))}), --input-dtype and "
            f"--num-classes, or let the factory return (model, sample_batch). Units measured so far are saved."
        ) from exc


def _input_size(shape: tuple[int, ...]) -> int | None:
    return shape[-1] if len(shape) == 3 and shape[-1] == shape[-2] else None


def _check_same_model(store: ProfileStore, lm: LoadedModel) -> None:
    """Refuse to mix two different models (or input sizes) under one name: the database has no
    input-size dimension, so its lookups would blend them."""
    old = store.model(lm.name)
    if old is None:
        return
    params = sum(p.numel() for p in lm.module.parameters())
    size = _input_size(lm.sample_shape)
    problems = []
    if (old.class_name, old.param_count) != (type(lm.module).__name__, params):
        problems.append(
            f"it is a {old.class_name} with {old.param_count:,} parameters there, "
            f"this one is a {type(lm.module).__name__} with {params:,}"
        )
    if old.input_size is not None and size is not None and old.input_size != size:
        problems.append(f"it was measured with {old.input_size}x{old.input_size} inputs there, these are {size}x{size}")
    if problems:
        raise ModelSpecError(
            f"model {lm.name!r} is already in the database and differs: {'; '.join(problems)}. "
            f"Store it under another name (NAME=module:callable), or --force to replace that model's facts."
        )


def _register_model(store: ProfileStore, lm: LoadedModel, measurer: Measurer) -> None:
    module = lm.module
    params = list(module.parameters())
    fwd, total = measurer.flops_per_sample()
    input_size = _input_size(lm.sample_shape)
    store.add_model(
        ModelInfo(
            name=lm.name,
            class_name=type(module).__name__,
            param_count=sum(p.numel() for p in params),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
            fwd_flops_per_sample=fwd or 0.0,
            fwd_bwd_flops_per_sample=total or 0.0,
            fingerprint=structural_fingerprint(module),
            input_size=input_size,
        )
    )

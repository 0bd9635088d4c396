"""Which dataset model is this ``nn.Module``? (so its GPU time can come from real measurements)

Order of evidence:

1. **configured** — ``EmuConfig.model`` (``GPEMU_MODEL`` / ``--model``) names a dataset model; the
   first module with parameters gpemu is asked about (the user's model: its call comes before
   any of its submodules') takes that model's time, as does any module whose structure matches it.
2. **fingerprint** — structure: the module's class name and parameter count equal a dataset
   model's (``ProfileDB.models_by_structure``), confirmed by the structural fingerprint when the
   database has one. A replaced classification head (``model.fc = nn.Linear(2048, 10)``) is
   recognised too: the count is compared as if the head had the dataset's 1000 classes.
   A wrapper module whose own structure matches nothing but which *contains* identified
   submodules is identified by them (outermost identified submodules own the time): by those
   its first call's forward calls, once per call (:func:`confirm_parts`), so a copy it holds but
   never calls (an EMA model) costs nothing and a model called twice (a siamese network) twice.
3. **estimated** — nothing matches: time comes from the ops it runs, priced by the cost model
   (``gpemu.costs``, ``gpemu.costmodel``).

Results are cached per module object (weakly), so replay can ask on every call.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.db import ModelInfo

    from .runtime import Runtime

__all__ = ["ModelIdentity", "IdentifyState", "identify", "confirm_parts", "structural_fingerprint", "SOURCES"]

SOURCES = ("configured", "fingerprint", "estimated")
_DATASET_CLASSES = 1000  # the profiled torchvision models are ImageNet classifiers


@dataclass(eq=False)
class ModelIdentity:
    """What gpemu knows about one user module. Compared by identity (one object per module)."""

    name: str | None  # dataset model name (None when estimated)
    source: str  # "configured" | "fingerprint" | "estimated"
    class_name: str
    param_count: int
    fingerprint: str
    info: ModelInfo | None = None
    # Identified submodules of a wrapper: their times add up to the wrapper's. Until a call
    # confirms them (confirm_parts), every identified submodule it holds (``candidates``: weak
    # references to them, in the same order).
    parts: tuple[ModelIdentity, ...] = ()
    candidates: tuple[weakref.ref, ...] = field(default=(), repr=False)
    # Models priced by their ops: per-(kind, batch, device) seconds of the calls that ran.
    estimates: dict[tuple[str, int, int], float] = field(default_factory=dict, repr=False)
    param_bytes: int = 0
    param_shapes: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # A submodule of a model already said (the script calls it directly): its notes are not said.
    quiet: bool = False

    @property
    def label(self) -> str:
        return self.name or f"{self.class_name} (unknown, {self.param_count:,} parameters)"


def structural_fingerprint(module: nn.Module) -> str:
    """A short hash of the module tree: each submodule's type and its own parameters' shapes.

    Independent of parameter values, device and dtype, so a model from ``examples.tvmodels`` and
    one from torchvision with the same architecture have the same fingerprint.
    """
    h = hashlib.sha1()
    for _name, sub in module.named_modules():
        h.update(type(sub).__name__.encode())
        for pname, p in sub.named_parameters(recurse=False):
            h.update(f"|{pname}{tuple(p.shape)}".encode())
        h.update(b";")
    return h.hexdigest()[:16]


@dataclass
class IdentifyState:
    """Identities found in one run (``rt.identities``, made on first use)."""

    cache: weakref.WeakKeyDictionary[nn.Module, ModelIdentity] = field(default_factory=weakref.WeakKeyDictionary)
    configured_taken: bool = False  # the configured model was given to a module
    said: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)  # models whose identity was said


def _state(rt: Runtime) -> IdentifyState:
    st = rt.identities
    if st is None:
        st = rt.identities = IdentifyState()
    return st


def identify(rt: Runtime, module: nn.Module, quiet: bool = False) -> ModelIdentity:
    """The identity of ``module`` (cached per module object for the run). ``quiet``: do not say
    that it matches no dataset model (a part of a model that was already said so)."""
    st = _state(rt)
    cache = st.cache
    try:
        return cache[module]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: identify without caching
        return _identify(rt, module, st, quiet)
    part = _part_of_said(module, st)
    ident = _identify(rt, module, st, quiet or part)
    ident.quiet = part
    if not quiet and not part and ident.param_count:
        st.said.add(module)
    cache[module] = ident
    return ident


def _part_of_said(module: nn.Module, st: IdentifyState) -> bool:
    """Whether ``module`` is a submodule of a model whose identity was said (a script calling a
    model's part directly: an encoder, a head)."""
    return any(model is not module and any(sub is module for sub in model.modules()) for model in st.said)


def _counts(module: nn.Module) -> tuple[int, int, tuple[tuple[int, ...], ...]]:
    """Parameter count, bytes and shapes."""
    n = b = 0
    shapes = []
    for p in module.parameters():
        n += p.numel()
        b += p.numel() * p.element_size()
        shapes.append(tuple(p.shape))
    return n, b, tuple(shapes)


def _identify(rt: Runtime, module: nn.Module, st: IdentifyState, quiet: bool = False) -> ModelIdentity:
    count, nbytes, shapes = _counts(module)
    cls = type(module).__name__
    fp = structural_fingerprint(module)
    configured = rt.config.model
    match = _match_structure(rt, module, cls, count, fp)
    if configured:
        info = rt.db.model(configured)  # UnknownNameError lists valid names
        if match is not None and match.name == info.name or (count > 0 and not st.configured_taken):
            st.configured_taken = True
            rt.say_once(f"model {cls} ({count:,} parameters): GPU time of dataset model {info.name!r} (configured)")
            return ModelIdentity(info.name, "configured", cls, count, fp, info, param_bytes=nbytes, param_shapes=shapes)
    if match is not None:
        if not quiet:
            rt.say_once(f"model {cls} ({count:,} parameters) identified as {match.name!r} by its structure")
        return ModelIdentity(match.name, "fingerprint", cls, count, fp, match, param_bytes=nbytes, param_shapes=shapes)
    found = _identified_children(rt, module, st)
    if found:
        parts = tuple(ident for ident, _ in found)
        names = "+".join(p.name or "?" for p in parts)
        # (said when a call confirms which of them its forward calls: confirm_parts)
        refs = tuple(weakref.ref(child) for _, child in found)
        return ModelIdentity(
            names, parts[0].source, cls, count, fp, None, parts=parts, candidates=refs, param_bytes=nbytes
        )
    if count > 0 and not quiet:
        rt.say_once(
            f"model {cls} ({count:,} parameters) matches no dataset model: GPU time estimated "
            f"from the ops it runs (set GPEMU_MODEL / gpemu.patch(model=...) to use a measured model)"
        )
    return ModelIdentity(None, "estimated", cls, count, fp, None, param_bytes=nbytes)


def _match_structure(rt: Runtime, module: nn.Module, cls: str, count: int, fp: str) -> ModelInfo | None:
    if count == 0:
        return None
    candidates = rt.db.models_by_structure(cls, count)
    if not candidates:
        adjusted = _count_with_dataset_head(module, count)
        if adjusted is not None and adjusted != count:
            candidates = rt.db.models_by_structure(cls, adjusted)
    if not candidates:
        return None
    with_fp = [m for m in candidates if m.fingerprint]
    if with_fp:
        exact = [m for m in with_fp if m.fingerprint == fp]
        if exact:
            return exact[0]
        # Fingerprints known and none equal: structure differs; only fingerprint-less ones remain.
        candidates = [m for m in candidates if not m.fingerprint]
        if not candidates:
            return None
    return candidates[0]


def _count_with_dataset_head(module: nn.Module, count: int) -> int | None:
    """Parameter count if the final classifier layer had the dataset's 1000 outputs."""
    head = None
    for sub in module.modules():
        if isinstance(sub, nn.Linear) or (isinstance(sub, nn.Conv2d) and sub.kernel_size == (1, 1)):
            head = sub
    if head is None:
        return None
    if isinstance(head, nn.Linear):
        fan_in, out = head.in_features, head.out_features
    else:
        if head.groups != 1:
            return None
        fan_in, out = head.in_channels, head.out_channels
    bias = 1 if head.bias is not None else 0
    return count - out * (fan_in + bias) + _DATASET_CLASSES * (fan_in + bias)


def confirm_parts(rt: Runtime, module: nn.Module, ident: ModelIdentity, called: list[int]) -> ModelIdentity:
    """The identity of wrapper ``module`` from what its first call's forward called (``called``:
    ids of the modules called inside it, in order): each identified submodule it holds, once per
    call of it. Replaces ``ident`` (see :attr:`ModelIdentity.candidates`) in the run's cache; a
    wrapper that called none of them is priced by the ops it runs."""
    by_id = {id(m): (p, m) for p, ref in zip(ident.parts, ident.candidates, strict=True) if (m := ref()) is not None}
    parts = tuple(by_id[i][0] for i in called if i in by_id)
    cls, count = ident.class_name, ident.param_count
    if parts:
        names = "+".join(p.name or "?" for p in parts)
        rt.say_once(f"model {cls}: GPU time of the identified submodule(s) its forward calls: {names}")
        new = ModelIdentity(names, parts[0].source, cls, count, ident.fingerprint, None, parts=parts)
    else:
        rt.say_once(
            f"model {cls} ({count:,} parameters): its forward calls none of its identified submodules; "
            "GPU time estimated from the ops it runs"
        )
        new = ModelIdentity(None, "estimated", cls, count, ident.fingerprint, None)
    new.param_bytes = ident.param_bytes
    try:
        _state(rt).cache[module] = new
    except TypeError:  # not weak-referenceable
        pass
    return new


def _identified_children(rt: Runtime, module: nn.Module, st: IdentifyState) -> list[tuple[ModelIdentity, nn.Module]]:
    """Outermost submodules that match a dataset model (depth-first, not below a match)."""
    found: list[tuple[ModelIdentity, nn.Module]] = []

    def visit(mod: nn.Module) -> None:
        for child in mod.children():
            count, nbytes, shapes = _counts(child)
            if count == 0:
                continue
            cls = type(child).__name__
            fp = structural_fingerprint(child)
            info = _match_structure(rt, child, cls, count, fp)
            if info is not None:
                ident = ModelIdentity(
                    info.name, "fingerprint", cls, count, fp, info, param_bytes=nbytes, param_shapes=shapes
                )
                try:
                    st.cache[child] = ident
                except TypeError:
                    pass
                found.append((ident, child))
            else:
                visit(child)

    visit(module)
    return found

"""Reversible patching: every original gpemu replaces is recorded in one place.

``gpemu.patch()`` installs all of its replacements through a :class:`Patcher`;
``gpemu.unpatch()`` calls :meth:`Patcher.restore_all`, which puts every original back in
reverse order, so torch ends exactly as it was (tests compare the attributes).

Why a registry and not ``unittest.mock.patch``: several ``torch.cuda`` submodules import
functions by name (``from . import current_device``), so one logical patch touches many
attributes; and some originals are absent (``torch.cuda.set_device`` may not exist on a CPU
build), which must be restored as "absent" again. Modules too slow to import on every patch
(``torch.distributed.tensor``) are patched when the program imports them
(:meth:`Patcher.after_import`), and the import hook leaves with the rest.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["Patcher", "MISSING"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


@dataclass
class _Record:
    owner: Any
    name: str
    original: Any  # MISSING when the attribute did not exist
    in_dict: bool  # whether the original lived in owner.__dict__ (vs inherited)


class _AfterImport(importlib.abc.MetaPathFinder):
    """An import hook: runs ``callback(module)`` right after module ``name`` is executed."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self.busy = False  # finding the module's own spec, below (not for this hook)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _LoadThenCall(spec.loader, self.callback)
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _LoadThenCall(importlib.abc.Loader):
    """The module's own loader, then the hook's callback on the executed module (the module keeps
    its own loader: nothing of the hook stays on it)."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.callback(module)


class Patcher:
    """Replaces attributes and remembers the originals."""

    def __init__(self) -> None:
        self._records: list[_Record] = []
        self._undo: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ install
    def replace(self, owner: Any, name: str, new: Any) -> Any:
        """Set ``owner.name = new``; return the original (or MISSING)."""
        in_dict = (
            isinstance(owner, type)
            and name in owner.__dict__
            or (not isinstance(owner, type) and hasattr(owner, "__dict__") and name in vars(owner))
        )
        original = owner.__dict__[name] if isinstance(owner, type) and in_dict else getattr(owner, name, MISSING)
        self._records.append(_Record(owner, name, original, in_dict))
        setattr(owner, name, new)
        return original

    def replace_everywhere(
        self, original: Any, new: Any, modules: Iterable[ModuleType] | None = None, prefix: str = "torch"
    ) -> int:
        """Replace every module-level reference to ``original`` under ``prefix`` with ``new``.

        Catches copies made by ``from x import f``. Returns how many references were replaced.
        """
        return self.replace_everywhere_many([(original, new)], modules, prefix)

    def replace_everywhere_many(
        self, pairs: Iterable[tuple[Any, Any]], modules: Iterable[ModuleType] | None = None, prefix: str = "torch"
    ) -> int:
        """:meth:`replace_everywhere` for several ``(original, new)`` pairs in ONE pass over the
        modules (a pass over torch's ~1,000 modules takes milliseconds)."""
        table = {id(original): (original, new) for original, new in pairs}
        if not table:
            return 0
        count = 0
        mods = (
            list(modules)
            if modules is not None
            else [
                m for n, m in list(sys.modules.items()) if m is not None and (n == prefix or n.startswith(prefix + "."))
            ]
        )
        for mod in mods:
            try:
                items = list(vars(mod).items())
            except TypeError:
                continue
            for attr, value in items:
                hit = table.get(id(value))
                if hit is not None and hit[0] is value and getattr(mod, attr, None) is value:
                    self.replace(mod, attr, hit[1])
                    count += 1
        return count

    def on_restore(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` at restore time (for things that are not attributes: hooks, modes)."""
        self._undo.append(undo)

    def after_import(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        """Run ``callback(module)`` for module ``module_name``: now if it is imported, else right
        after the program imports it (gpemu does not import slow modules it may never need). The
        callback patches through this patcher as usual; :meth:`restore_all` removes the hook."""
        module = sys.modules.get(module_name)
        if module is not None:
            callback(module)
            return
        hook = _AfterImport(module_name, callback)
        sys.meta_path.insert(0, hook)
        self.on_restore(hook.remove)

    # ------------------------------------------------------------------ restore
    def restore_all(self) -> None:
        """Undo everything, newest first."""
        errors: list[BaseException] = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except BaseException as exc:  # keep restoring the rest
                errors.append(exc)
        while self._records:
            rec = self._records.pop()
            try:
                if rec.original is MISSING or (isinstance(rec.owner, type) and not rec.in_dict):
                    try:
                        delattr(rec.owner, rec.name)
                    except AttributeError:
                        pass
                elif (
                    not isinstance(rec.owner, type)
                    and not rec.in_dict
                    and not hasattr(type(rec.owner), rec.name)
                    and rec.name in getattr(rec.owner, "__dict__", {})
                ):
                    # An instance that served the attribute through its __getattr__ (torch._VF):
                    # removing ours restores it; setting the original would leave a copy behind.
                    delattr(rec.owner, rec.name)
                    if getattr(rec.owner, rec.name, MISSING) is not rec.original:
                        setattr(rec.owner, rec.name, rec.original)
                else:
                    setattr(rec.owner, rec.name, rec.original)
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise RuntimeError(f"gpemu.unpatch(): {len(errors)} originals could not be restored: {errors[0]!r}")

    @property
    def active(self) -> bool:
        return bool(self._records or self._undo)

    def __len__(self) -> int:
        return len(self._records)

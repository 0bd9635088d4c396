"""A module tree's parameters, training flags and hooks, walked once and cached between calls:
the replay fast path asks for them at every outermost module call (``gpemu.fastpaths.replay``)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["ModuleTree", "walk", "walk_tree"]


class ModuleTree:
    """A module tree's parameters and training flags, cached between calls. Valid while no
    Module attribute was set anywhere (the replay state's ``structure_gen``) and its ``_parameters``/``_modules``
    dicts kept their sizes. Its hooks are known absent while no module got a hook anywhere (the
    replay state's ``module_hook_gen``), else re-checked (one C-level ``any``)."""

    __slots__ = ("gen", "hook_gen", "params", "flags", "hook_dicts", "empty", "dicts", "lens", "first")
    gen: int
    hook_gen: int  # module_hook_gen when the tree was found without hooks (-1: not known)
    params: list
    flags: tuple
    hook_dicts: list
    # The ``_parameters``/``_modules`` dicts: those empty when walked (most, in a deep network:
    # a leaf's ``_modules``, a container's ``_parameters``) need only stay empty, which ``any``
    # tests at ~5 ns a dict; the others keep their sizes (``len`` through ``map``: ~18 ns).
    empty: list
    dicts: list
    lens: list[int]
    first: Any


def walk(
    trees: weakref.WeakKeyDictionary, gen: int, hook_gen: int, module: torch.nn.Module
) -> tuple[list, tuple, bool]:
    """(parameters, training flags, any hooks) of a module tree, cached in ``trees`` for structure
    generation ``gen`` and module-hook generation ``hook_gen`` (see :class:`ModuleTree`)."""
    tree = trees.get(module)
    if tree is not None and tree.gen == gen and not any(tree.empty) and list(map(len, tree.dicts)) == tree.lens:
        if tree.hook_gen != hook_gen:
            if any(tree.hook_dicts):
                return tree.params, tree.flags, True
            tree.hook_gen = hook_gen
        return tree.params, tree.flags, False
    params, flags, hooks, mods = walk_tree(module)
    tree = ModuleTree()
    tree.gen, tree.params, tree.flags = gen, params, flags
    tree.hook_gen = -1 if hooks else hook_gen
    tree.first = next(module.parameters(), None)  # in parameters() order (see _emulated_device)
    tree.hook_dicts = [
        d for m in mods for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    ]
    dicts = [m._parameters for m in mods] + [m._modules for m in mods]
    tree.empty = [d for d in dicts if not d]
    tree.dicts = [d for d in dicts if d]
    tree.lens = list(map(len, tree.dicts))
    try:
        trees[module] = tree
    except TypeError:  # not weak-referenceable: no caching
        pass
    return params, flags, hooks


def walk_tree(module: torch.nn.Module) -> tuple[list, tuple, bool, list]:
    """(parameters, training flags, any hooks, modules) in one pass over the module tree."""
    mods: list = []
    params: list = []
    seen: set[int] = set()
    flags: list[bool] = []
    hooks = False
    stack = [module]
    while stack:
        m = stack.pop()
        mods.append(m)
        flags.append(m.training)
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            hooks = True
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for c in m._modules.values():
            if c is not None:
                stack.append(c)
    return params, tuple(flags), hooks, mods

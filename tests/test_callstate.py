"""A call's state read along its last walk (gpemu.fastpaths.callstate.Template): the same
structure, leaves and numbers as a full scan, and no answer where the structure changed."""

from __future__ import annotations

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.fastpaths.callstate import scan


class Layer:
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys, self.values, self.seen = k, v, 0


class Cache:
    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers
        self.device = torch.device("cuda", 0)
        self.mode = "dynamic"


@pytest.fixture
def gpu():
    gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    yield
    gpemu.unpatch()


def _cache(length: int) -> Cache:
    kv = [torch.zeros(1, 2, length, 8, device="cuda") for _ in range(4)]
    return Cache([Layer(kv[0], kv[1]), Layer(kv[2], kv[3])])


def test_a_grown_cache_read_along_the_template_is_what_a_scan_finds(gpu) -> None:
    first = scan((torch.ones(1, 1, dtype=torch.long),), {"cache": _cache(5), "step": 5})
    assert first is not None and first.template is not None
    args, kwargs = (torch.ones(1, 1, dtype=torch.long),), {"cache": _cache(6), "step": 6}
    fast, full = first.template.rescan(args, kwargs), scan(args, kwargs)
    assert fast is not None and full is not None
    assert fast.structure == full.structure and fast.numbers == full.numbers
    assert [(p, k) for p, k, _ in fast.leaves] == [(p, k) for p, k, _ in full.leaves]
    assert all(a is b for (_, _, a), (_, _, b) in zip(fast.leaves, full.leaves, strict=True))
    assert fast.numbers != first.numbers  # (the cache's length moved)


def _changed(kind: str) -> dict:
    c = _cache(6)
    if kind == "attribute":
        c.layers[0].extra = 1
    elif kind == "length":
        c.layers.append(Layer(c.layers[0].keys, c.layers[0].values))
    elif kind == "dtype":
        c.layers[1].values = c.layers[1].values.half()
    elif kind == "plain":
        c.mode = "static"
    elif kind == "shared":  # one layer object twice: a scan keeps the second by identity
        c.layers[1] = c.layers[0]
    elif kind == "class":
        c.layers[0].seen = 0.5
    return {"cache": c, "step": 6}


@pytest.mark.parametrize("kind", ["attribute", "length", "dtype", "plain", "shared", "class"])
def test_a_changed_structure_is_not_read_along_the_template(gpu, kind: str) -> None:
    first = scan((torch.ones(1, 1, dtype=torch.long),), {"cache": _cache(5), "step": 5})
    assert first is not None and first.template is not None
    args, kwargs = (torch.ones(1, 1, dtype=torch.long),), _changed(kind)
    full = scan(args, kwargs)
    assert full is not None and full.structure != first.structure
    assert first.template.rescan(args, kwargs) is None

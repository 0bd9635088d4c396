"""The cross-entropy fast path: one op after a recorded call, with the GPU time, memory and
metadata of the op-by-op run; falls back wherever it could change a result."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpemu
from gpemu.clock import VirtualClock
from gpemu.fastpaths import loss as loss_fastpath


def _step(loss_fn, logits_leaf: torch.Tensor, target: torch.Tensor, **kw) -> dict:
    """GPU time charged, memory kept and peak, output and gradient metadata of one loss + backward."""
    engine = gpemu.runtime.current().engine
    torch.cuda.synchronize()
    t0 = engine.now()
    a0 = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logits = logits_leaf * 1.0  # a non-leaf, as a model's output is
    loss = loss_fn(logits, target, **kw)
    kept = torch.cuda.memory_allocated() - a0
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    torch.cuda.synchronize()
    return {
        "seconds": engine.now() - t0,
        "kept": kept,
        "peak": torch.cuda.max_memory_allocated() - a0,
        "out": (loss.shape, loss.dtype, loss.device, loss.requires_grad),
        "grad": (grad.shape, grad.stride(), grad.dtype, grad.device),
    }


@pytest.mark.parametrize(
    "kw", [{}, {"reduction": "sum", "label_smoothing": 0.1}, {"reduction": "none"}, {"ignore_index": 3}]
)
def test_replayed_loss_charges_the_time_and_memory_of_the_op_by_op_run(rt, kw) -> None:
    logits = torch.empty(64, 1000, device="cuda", requires_grad=True)
    target = torch.zeros(64, dtype=torch.long, device="cuda")
    op_by_op = F.cross_entropy.__wrapped__
    reference = _step(op_by_op, logits, target, **kw)
    assert reference["seconds"] > 0
    first = _step(F.cross_entropy, logits, target, **kw)  # records
    again = [_step(F.cross_entropy, logits, target, **kw) for _ in range(3)]  # replays
    info = loss_fastpath.loss_info()
    assert info["recorded"] == 1 and info["replayed"] == 3
    for got in [first, *again]:
        assert got["out"] == reference["out"] and got["grad"] == reference["grad"]
        assert got["seconds"] == pytest.approx(reference["seconds"], rel=1e-9, abs=1e-12)
        assert got["kept"] == reference["kept"] and got["peak"] == reference["peak"]


def test_the_criterion_module_and_a_weighted_loss_take_the_fast_path(rt) -> None:
    logits = torch.empty(8, 10, device="cuda", requires_grad=True)
    target = torch.zeros(8, dtype=torch.long, device="cuda")
    crit = nn.CrossEntropyLoss(weight=torch.ones(10)).cuda()
    for _ in range(3):
        crit(logits, target).backward()
    assert loss_fastpath.loss_info() == {"recorded": 1, "replayed": 2}
    assert logits.grad is not None and logits.grad.shape == (8, 10) and logits.grad.is_cuda


def test_fallbacks_keep_values_and_other_cases_op_by_op(rt) -> None:
    # Known host values (small tensors made on the host): the loss value is computed, not replayed.
    logits = torch.tensor([[2.0, 0.0]]).cuda().requires_grad_()
    target = torch.tensor([0]).cuda()
    for _ in range(3):
        value = F.cross_entropy(logits, target)
        assert value.item() == pytest.approx(0.126928, rel=1e-4)
    # Evaluation (no grad), a target that requires grad (soft labels), legacy arguments:
    big = torch.empty(16, 10, device="cuda", requires_grad=True)
    labels = torch.zeros(16, dtype=torch.long, device="cuda")
    soft = torch.empty(16, 10, device="cuda", requires_grad=True)
    with torch.no_grad():
        F.cross_entropy(big, labels)
    F.cross_entropy(big, soft.softmax(1)).backward()
    assert soft.grad is not None  # the soft target's gradient exists: it ran op by op
    with pytest.warns(UserWarning, match="size_average and reduce"):
        F.cross_entropy(big, labels, reduce=False)
    # Host tensors are torch's business (and its error).
    with pytest.raises(RuntimeError):
        F.cross_entropy(big, torch.zeros(16, dtype=torch.long))
    assert loss_fastpath.loss_info() == {"recorded": 0, "replayed": 0}


def test_a_loss_without_backward_frees_its_saved_memory(rt) -> None:
    logits = torch.empty(256, 1000, device="cuda", requires_grad=True)
    target = torch.zeros(256, dtype=torch.long, device="cuda")
    F.cross_entropy(logits * 1.0, target).backward()  # record
    base = torch.cuda.memory_allocated()
    loss = F.cross_entropy(logits * 1.0, target)  # replayed: keeps the log-probabilities for backward
    assert torch.cuda.memory_allocated() - base >= 256 * 1000 * 4
    del loss
    assert torch.cuda.memory_allocated() == base


def test_unpatch_restores_cross_entropy() -> None:
    original = F.cross_entropy
    gpemu.patch(gpu="V100", summary=False, clock=VirtualClock())
    try:
        assert F.cross_entropy is not original and F.cross_entropy.__wrapped__ is original
    finally:
        gpemu.unpatch()
    assert F.cross_entropy is original


def test_replay_off_leaves_cross_entropy_alone() -> None:
    original = F.cross_entropy
    gpemu.patch(gpu="V100", summary=False, replay=False, clock=VirtualClock())
    try:
        assert F.cross_entropy is original
    finally:
        gpemu.unpatch()


def test_autocast_still_computes_the_loss_in_float32_across_runs() -> None:
    # autocast's op lists are built once per process; each run patches cross_entropy anew
    for _ in range(2):
        gpemu.patch(gpu="V100", summary=False, clock=VirtualClock())
        try:
            logits = torch.empty(4, 10, device="cuda", requires_grad=True)
            target = torch.zeros(4, dtype=torch.long, device="cuda")
            with torch.autocast("cuda"):
                for _ in range(2):
                    loss = F.cross_entropy(logits.half() * 1.0, target)
                    assert loss.dtype == torch.float32
                    loss.backward()
        finally:
            gpemu.unpatch()

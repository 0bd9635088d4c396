"""What the host pays for ops on placeholder values: an op whose result values cannot be kept
(too large to know) is not run on the host over zeros the size of a model."""

from __future__ import annotations

import time

import torch


def _fused_adamw_cpu_s(side: int) -> float:
    """Host CPU seconds of one fused AdamW step (torch's ``_fused_adamw_``, as torch.optim and
    torchtitan run it) over four ``side`` x ``side`` fp32 parameters with unknown values."""
    params, grads, avgs, squares = ([torch.empty(side, side, device="cuda") for _ in range(4)] for _ in range(4))
    steps = [torch.ones((), device="cuda") for _ in range(4)]
    started = time.process_time()
    with torch.no_grad():
        torch._fused_adamw_(
            params, grads, avgs, squares, [], steps,
            lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
    return time.process_time() - started


def test_a_fused_optimizer_step_over_large_placeholders_costs_the_host_what_a_small_one_does(rt):
    # Four 4096 x 4096 parameters and their states: 1 GiB of zeros if the step ran on the host.
    small = min(_fused_adamw_cpu_s(64) for _ in range(3))
    large = min(_fused_adamw_cpu_s(4096) for _ in range(2))
    assert large < 10 * small + 0.02, (large, small)


def _gradient_norm_cpu_s(grads: list[torch.Tensor]) -> float:
    started = time.process_time()
    with torch.no_grad():
        norms = torch._foreach_norm(grads)  # (as clip_grad_norm_ computes the total norm)
    assert [n.item() for n in norms[:1]] == [0.0]  # placeholders read back as zeros
    return time.process_time() - started


def test_a_gradient_norm_over_large_placeholders_is_computed_on_the_host_once(rt):
    # Eight 2048 x 2048 fp32 gradients with unknown values (a known small one beside them, as a
    # norm layer's): each step's norm is the same host result, made once (zeros, 128 MiB).
    grads = [torch.empty(2048, 2048, device="cuda") for _ in range(8)] + [torch.zeros(64, device="cuda")]
    first = _gradient_norm_cpu_s(grads)
    again = min(_gradient_norm_cpu_s(grads) for _ in range(3))
    assert again < first / 5, (again, first)

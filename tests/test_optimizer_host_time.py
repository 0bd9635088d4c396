"""The modelled host time of an optimizer step (gpemu.costs.optimizer_step_host_seconds) is worked
out once per kind of settings: a learning-rate schedule, which changes the numbers every step,
does not make the emulator time torch's step again; a switch that changes the step's work does."""

from __future__ import annotations

import pytest
import torch

import gpemu
from gpemu import costs
from gpemu.clock import VirtualClock


@pytest.fixture
def timings(monkeypatch):
    calls: list[dict] = []

    def counted(optimizer_class, settings):  # (what torch's step costs here is not the point)
        calls.append(dict(settings))
        return costs.StepHostTime(fixed=20e-6, per_tensor=2e-6)

    monkeypatch.setattr(costs, "_time_steps", counted)
    return calls


def test_a_schedule_does_not_time_the_step_again_but_a_switch_does(timings):
    with gpemu.emulate(gpu="A100", clock=VirtualClock(), summary=False, host="h100-xeon") as rt:
        params = [torch.zeros(64, device="cuda", requires_grad=True) for _ in range(4)]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        seconds = []
        for _ in range(5):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
            schedule.step()  # (a new learning rate every step)
            seconds.append(costs.optimizer_step_host_seconds(rt, opt))
        assert len(timings) == 1 and len(set(seconds)) == 1 and seconds[0] > 0
        opt.param_groups[0]["nesterov"] = True  # (a switch: other ops in torch's step)
        costs.optimizer_step_host_seconds(rt, opt)
        assert len(timings) == 2 and timings[1]["nesterov"] is True
        opt.param_groups[0]["weight_decay"] = 0.01  # (zero to non-zero: the decay's ops join)
        costs.optimizer_step_host_seconds(rt, opt)
        assert len(timings) == 3


def test_no_host_model_costs_no_host_time(timings):
    with gpemu.emulate(gpu="A100", clock=VirtualClock(), summary=False, host="none") as rt:
        opt = torch.optim.SGD([torch.zeros(8, device="cuda", requires_grad=True)], lr=0.1)
        assert costs.optimizer_step_host_seconds(rt, opt) == 0.0 and timings == []


def _step_gpu_seconds(host: str, foreach: bool, n: int = 48) -> tuple[float, int]:
    """An SGD-momentum step's GPU seconds over ``n`` small parameters on an emulated H100, and its
    kernel launches."""
    with gpemu.emulate(gpu="H100", clock=VirtualClock(), summary=False, host=host) as rt:
        params = [torch.zeros(256, device="cuda", requires_grad=True) for _ in range(n)]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()  # (the first step creates the momentum buffers)
        return costs.optimizer_step_seconds(rt, opt, 0)[0], costs.optimizer_step_launches(rt, opt).launches


def test_without_a_host_model_each_launch_of_a_step_carries_the_calibration_hosts_issue_time():
    from gpemu.costmodel import default_model
    from gpemu.costmodel.measured_loop import parameter_bookkeeping_ops

    # the issue time the cost model fitted to the step's kernels in the measured loop's backward
    h = default_model().host_seconds(parameter_bookkeeping_ops([(256,)])[-1], "H100")
    per_tensor, launches = _step_gpu_seconds("none", foreach=False)
    assert launches == 3 * 48  # (mul_, add_ on the buffer, add_ on the parameter: per tensor)
    assert per_tensor >= launches * h  # host-bound: every launch waited for its issue
    foreach, few = _step_gpu_seconds("none", foreach=True)
    assert few < 10 and foreach < per_tensor / 10
    # behind a modelled host the GPU price is the kernels' (the host pays its own issue time)
    kernels, _ = _step_gpu_seconds("h100-xeon", foreach=False)
    assert kernels < launches * h / 2

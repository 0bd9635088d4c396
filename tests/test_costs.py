"""Costs from the profile database (with provenance), roofline estimates, optimizer steps and
the optimizer-step hooks (gpemu.optimizer_hooks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples import tvmodels
from gpemu import costs, engine, optimizer_hooks
from gpemu.clock import VirtualClock
from gpemu.config import EmuConfig
from gpemu.identify import ModelIdentity, identify
from gpemu.runtime import Runtime


@pytest.fixture(scope="module")
def db():
    from gpemu.db import open_profile_db

    d = open_profile_db(EmuConfig.from_env())
    d.gpus()
    return d


def make_rt(db, **settings) -> Runtime:
    cfg = EmuConfig.from_env(**settings)
    rt = Runtime(config=cfg, db=db, gpus=[db.gpu(g) for g in cfg.gpus_per_device])
    engine.install(rt)
    return rt


@pytest.fixture
def rt(db):
    r = make_rt(db, gpu="V100", clock=VirtualClock())
    yield r
    r.patcher.restore_all()


def test_identified_model_takes_database_time_with_provenance(rt, db):
    with torch.device("meta"):
        ident = identify(rt, tvmodels.resnet50())
    gpu = rt.gpus[0].name
    s, prov = costs.forward_seconds(rt, ident, 128, 0)
    assert (s, prov) == (db.lookup(gpu, "resnet50", 128, "forward").value, "measured")
    b, prov_b = costs.backward_seconds(rt, ident, 128, 0)
    assert b == db.lookup(gpu, "resnet50", 128, "backward").value and prov_b == "measured"
    big, prov_big = costs.forward_seconds(rt, ident, 512, 0)
    assert prov_big == "extrapolated" and big > s * 1.5


def test_costs_differ_by_gpu(db):
    rt2 = make_rt(db, device_gpus=("V100", "K80"))
    with torch.device("meta"):
        ident = identify(rt2, tvmodels.resnet18())
    fast, _ = costs.forward_seconds(rt2, ident, 64, 0)
    slow, _ = costs.forward_seconds(rt2, ident, 64, 1)
    assert slow > 2 * fast
    rt2.patcher.restore_all()


def test_repeated_lookups_are_memoised(rt):
    with torch.device("meta"):
        ident = identify(rt, tvmodels.alexnet())
    first = costs.forward_seconds(rt, ident, 64, 0)
    rt.db = None  # a second answer must not touch the database
    assert costs.forward_seconds(rt, ident, 64, 0) == first


def test_bad_batch_size_is_refused(rt):
    ident = ModelIdentity("resnet50", "configured", "ResNet", 1, "x")
    with pytest.raises(ValueError, match="positive integer"):
        costs.forward_seconds(rt, ident, 0, 0)


def test_wrapper_time_is_the_sum_of_its_parts(rt):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = tvmodels.resnet18(), tvmodels.alexnet()

    with torch.device("meta"):
        ident = identify(rt, Two())
    a = costs.forward_seconds(rt, ident.parts[0], 32, 0)[0]
    b = costs.forward_seconds(rt, ident.parts[1], 32, 0)[0]
    assert costs.forward_seconds(rt, ident, 32, 0) == (pytest.approx(a + b), "measured")


def test_unknown_model_is_estimated_per_op_and_scales_with_batch(rt):
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16 * 16, 10))
    ident = identify(rt, model)
    crude, prov = costs.forward_seconds(rt, ident, 64, 0)
    assert prov == "estimated" and crude > 0
    fwd, bwd = costs.estimate_module(rt, ident, model, (torch.empty(64, 3, 16, 16),), {}, 0)
    assert fwd > 0 and bwd > fwd  # backward does about twice the work
    assert costs.forward_seconds(rt, ident, 64, 0) == (fwd, "estimated")
    f128, _ = costs.forward_seconds(rt, ident, 128, 0)
    launch = ident.estimates[("forward-launch", 64, 0)]
    assert launch > 0 and f128 - launch == pytest.approx(2 * (fwd - launch))


def test_roofline_estimate_of_a_known_model_is_near_its_measurement(rt, db):
    """The calibrated roofline lands within 2x of the real ResNet-50 on V100 (sanity, not accuracy)."""
    with torch.device("meta"):
        model = tvmodels.resnet50()
    unknown = ModelIdentity(None, "estimated", "ResNet", 1, "x")
    fwd, bwd = costs.estimate_module(rt, unknown, model, (torch.empty(64, 3, 224, 224, device="meta"),), {}, 0)
    gpu = rt.gpus[0].name
    real = db.lookup(gpu, "resnet50", 64, "forward").value + db.lookup(gpu, "resnet50", 64, "backward").value
    assert 0.5 < (fwd + bwd) / real < 2.0


def test_op_seconds_roofline_and_charged_scope(rt):
    a = torch.empty(4096, 4096, device="meta")
    out = torch.mm(a, a)
    mm = costs.op_seconds(rt, torch.ops.aten.mm.default, (a, a), {}, out, 0)
    spec = rt.gpus[0]
    flops = 2 * 4096 ** 3
    assert mm == pytest.approx(flops / (spec.fp32_flops * costs.compute_efficiency(rt, spec)) + costs.LAUNCH_LATENCY)
    add = costs.op_seconds(rt, torch.ops.aten.add.Tensor, (a, a), {}, out, 0)
    assert add == pytest.approx(3 * a.nbytes / (spec.memory_bandwidth * costs.BANDWIDTH_EFFICIENCY)
                                + costs.LAUNCH_LATENCY)
    assert costs.op_seconds(rt, torch.ops.aten.view.default, (a, [-1]), {}, out.view(-1), 0) == 0.0
    half = a.half()
    assert costs.op_seconds(rt, torch.ops.aten.mm.default, (half, half), {}, half, 0) < mm / 4
    with rt.engine.charged_scope():
        assert costs.op_seconds(rt, torch.ops.aten.mm.default, (a, a), {}, out, 0) == 0.0


def test_optimizer_step_estimate_counts_state_bytes(rt):
    params = [nn.Parameter(torch.empty(1_000_000)) for _ in range(4)]
    plain = costs.optimizer_step_seconds(rt, torch.optim.SGD(params, lr=0.1), 0)
    momentum = costs.optimizer_step_seconds(rt, torch.optim.SGD(params, lr=0.1, momentum=0.9), 0)
    adam = costs.optimizer_step_seconds(rt, torch.optim.Adam(params), 0)
    assert plain[1] == momentum[1] == adam[1] == "estimated"
    assert plain[0] < momentum[0] < adam[0]
    bw = rt.gpus[0].memory_bandwidth * costs.BANDWIDTH_EFFICIENCY
    # Adam keeps two state tensors; foreach: (2 + 2) kernels for the 4 tensors
    assert adam[0] == pytest.approx(16e6 * 7 / bw + 4 * costs.LAUNCH_LATENCY)


def test_optimizer_hooks_scope_the_step_and_unpatch_removes_them(db):
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    before = (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    rt = make_rt(db, clock=VirtualClock())
    optimizer_hooks.install(rt)
    eng = rt.engine
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (before[0] + 1, before[1] + 1)
    seen = []

    class Watching(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(eng.in_charged_scope)
            return super().step(closure)

    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = Watching([p], lr=0.1)
    opt.step()
    assert seen == [True] and not eng.in_charged_scope
    assert rt.recorder.spans == []  # CPU parameters: no GPU time, no iteration
    rt.patcher.restore_all()
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == before

"""Costs from the profile database (with provenance), the cost model's op prices, optimizer steps
and the optimizer-step hooks (gpemu.optimizer_hooks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpemu.time as time_component
from examples import tvmodels
from gpemu import costs, optimizer_hooks
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
    time_component.install(rt)
    return rt


@pytest.fixture
def rt(db):
    r = make_rt(db, gpu="V100", clock=VirtualClock())
    yield r
    r.patcher.restore_all()


def _bookkeeping(model: nn.Module, gpu: str, batch: int) -> float:
    """The cost model's price of what the measured loop's backward column holds besides the model's
    backward pass: the per-parameter kernels (zeroing, accumulating, SGD) for ``model``'s
    parameters, and the cross-entropy loss over ``batch`` x 1000 logits, on ``gpu``."""
    from gpemu.costmodel import default_model, gpu_sheet
    from gpemu.costmodel.measured_loop import measured_loss_ops, parameter_bookkeeping_ops

    ops = parameter_bookkeeping_ops([tuple(p.shape) for p in model.parameters()])
    m, sheet = default_model(), gpu_sheet(gpu)
    return m.ops_seconds(ops, sheet) + m.ops_seconds(measured_loss_ops(batch), sheet)


def test_identified_model_takes_database_time_with_provenance(rt, db):
    with torch.device("meta"):
        model = tvmodels.resnet50()
    ident = identify(rt, model)
    gpu = rt.gpus[0].name
    s, prov = costs.forward_seconds(rt, ident, 128, 0)
    assert (s, prov) == (db.lookup(gpu, "resnet50", 128, "forward").value, "measured")
    # The shipped backward also timed its loop's gradient zeroing, accumulation and SGD step
    # (gpemu.costmodel.measured_loop): the model's backward is charged without them.
    b, prov_b = costs.backward_seconds(rt, ident, 128, 0)
    measured = db.lookup(gpu, "resnet50", 128, "backward").value
    assert b == pytest.approx(measured - _bookkeeping(model, "V100", 128)) and prov_b == "measured"
    assert 0.8 * measured < b < measured
    big, prov_big = costs.forward_seconds(rt, ident, 512, 0)
    assert prov_big == "extrapolated" and big > s * 1.5


def test_only_the_shipped_loop_s_backward_loses_its_optimizer_part(db, tmp_path):
    """A backward measured by ``gpemu profile`` (a source other than the shipped artifact's) is the
    backward pass alone and is charged as it is; AlexNet's 61 M parameters are most of the shipped
    backward at a small batch, and what comes off never takes it below its forward."""
    from gpemu.db import ARTIFACT_SOURCE, Measurement
    from gpemu.db.build import open_url

    with torch.device("meta"):
        model = tvmodels.alexnet()
    rows = {k: db.lookup("V100", "alexnet", 16, k).value for k in ("forward", "backward")}
    for source, expect in (
        (ARTIFACT_SOURCE, max(rows["backward"] - _bookkeeping(model, "V100", 16), rows["forward"])),
        ("gpemu profile", rows["backward"]),
    ):
        own = open_url(f"sqlite:///{tmp_path / (source.replace(' ', '-') + '.sqlite')}")
        own.add_gpu(db.gpu("V100"))
        own.add_model(db.model("alexnet"))
        own.add_measurements(
            [
                Measurement(gpu="V100", model="alexnet", kind=k, batch_size=16, value=v, source=source)
                for k, v in rows.items()
            ]
        )
        r = Runtime(config=EmuConfig.from_env(gpu="V100"), db=own, gpus=[own.gpu("V100")])
        b, _ = costs.backward_seconds(r, identify(r, model), 16, 0)
        assert b == pytest.approx(expect)
        own.close()
    assert max(rows["backward"] - _bookkeeping(model, "V100", 16), rows["forward"]) < 0.6 * rows["backward"]


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


def test_unknown_model_has_no_database_time(rt):
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16 * 16, 10))
    ident = identify(rt, model)
    assert costs.model_times(rt, ident, 64, 0) is None  # priced by the ops it runs
    assert costs.forward_seconds(rt, ident, 64, 0) == (0.0, "estimated")


def _mm(rt, a, b):
    return costs.op_price(rt, torch.ops.aten.mm.default, (a, b), {}, torch.mm(a, b), 0)


def test_op_price_follows_the_cost_model_precision_and_charged_scope(rt):
    a = torch.empty(4096, 4096, device="meta")
    fp32 = _mm(rt, a, a)
    # On a measured GPU in fp32 with PyTorch's default switches the op runs as measured.
    assert fp32.gpu > 0 and fp32.reference == fp32.gpu and fp32.mix == "gemm" and fp32.host > 0
    # A 4096^3 fp32 GEMM on a V100 (14 TFLOP/s FP32) takes at least its FLOPs at peak.
    assert fp32.gpu > 2 * 4096**3 / rt.gpus[0].fp32_flops
    half = _mm(rt, a.half(), a.half())
    # fp16 runs on the V100's tensor cores (112 TFLOP/s); its reference is the fp32 op as measured
    assert half.gpu < fp32.gpu / 3 and half.reference == pytest.approx(fp32.gpu)
    view = costs.op_price(rt, torch.ops.aten.view.default, (a, [-1]), {}, a.view(-1), 0)
    assert view.gpu == view.host == view.reference == 0.0
    assert costs.op_seconds(rt, torch.ops.aten.mm.default, (a, a), {}, torch.mm(a, a), 0) == fp32.gpu
    with rt.engine.charged_scope():  # covered by a module's or optimizer's charge
        assert costs.op_seconds(rt, torch.ops.aten.mm.default, (a, a), {}, torch.mm(a, a), 0) == 0.0


def test_tf32_switch_moves_fp32_gemms_to_tensor_cores_on_ampere(db):
    rt = make_rt(db, gpu="A100", clock=VirtualClock())
    a = torch.empty(4096, 4096, device="meta")
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        plain = _mm(rt, a, a)
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = _mm(rt, a, a)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
        rt.patcher.restore_all()
    assert tf32.gpu < plain.gpu / 2  # 156 TFLOP/s TF32 tensor cores vs 19.5 FP32
    assert tf32.reference == pytest.approx(plain.gpu)  # the database measured with the switch off


def test_attention_price_halves_under_a_causal_mask(rt):
    full = costs.attention_price(rt, 0, 96, 1024, 1024, 64, 64, torch.float16, False, False)
    causal = costs.attention_price(rt, 0, 96, 1024, 1024, 64, 64, torch.float16, True, False)
    backward = costs.attention_price(rt, 0, 96, 1024, 1024, 64, 64, torch.float16, False, True)
    assert causal.gpu < full.gpu and backward.gpu > 1.5 * full.gpu and full.mix == "gemm"


def test_measured_gpu_is_its_own_reference(rt):
    assert costs.reference_gpu(rt, 0).name == rt.gpus[0].name


def _queued(seconds: float, launches: int, gpu: str = "V100") -> float:
    """An optimizer step's kernels ``seconds`` over ``launches`` as a queue behind the calibration
    hosts' issue time of the step's kernels (no host model: ``--host none``)."""
    from gpemu.costmodel import default_model
    from gpemu.costmodel.measured_loop import parameter_bookkeeping_ops

    h = default_model().host_seconds(parameter_bookkeeping_ops([(1024,)])[-1], gpu)
    return max(launches * h + seconds / launches, h + seconds)


def test_optimizer_step_estimate_counts_the_passes_torch_makes(rt):
    params = [nn.Parameter(torch.empty(1_000_000)) for _ in range(4)]
    plain = costs.optimizer_step_seconds(rt, torch.optim.SGD(params, lr=0.1), 0)
    momentum = costs.optimizer_step_seconds(rt, torch.optim.SGD(params, lr=0.1, momentum=0.9), 0)
    adam = costs.optimizer_step_seconds(rt, torch.optim.Adam(params), 0)
    fused = costs.optimizer_step_seconds(rt, torch.optim.Adam(params, fused=True), 0)
    assert plain[1] == momentum[1] == adam[1] == fused[1] == "estimated"
    bw = rt.gpus[0].memory_bandwidth * costs.BANDWIDTH_EFFICIENCY
    launch = costs.LAUNCH_LATENCY
    # torch's SGD: param.add_(grad) reads 2 and writes 1 byte per parameter byte; with momentum
    # buf.mul_() (2), buf.add_(grad) (3) and param.add_(buf) (3): 8, in 3 foreach kernels.
    assert plain[0] == pytest.approx(_queued(16e6 * 3 / bw + 1 * launch, 1))
    assert momentum[0] == pytest.approx(_queued(16e6 * 8 / bw + 3 * launch, 3))
    # Adam's lerp_, mul_, addcmul_, sqrt, div_, add_ and addcdiv_ passes: 18 (the step counters'
    # scalar adds are noise), 7 kernels; the fused kernel reads and writes each tensor once.
    assert adam[0] == pytest.approx(_queued(16e6 * 18 / bw + 7 * launch, 7), rel=1e-4)
    assert fused[0] == pytest.approx(_queued(16e6 * 7 / bw + 1 * launch, 1))


def test_optimizer_of_another_module_is_priced_without_running_its_step(rt):
    ran = []

    class Logging(torch.optim.SGD):  # a program's own optimizer: its step may log, count, ...
        def step(self, closure=None):
            ran.append(1)
            return super().step(closure)

    params = [nn.Parameter(torch.empty(1_000_000)) for _ in range(4)]
    seconds, _ = costs.optimizer_step_seconds(rt, Logging(params, lr=0.1, momentum=0.9), 0)
    bw = rt.gpus[0].memory_bandwidth * costs.BANDWIDTH_EFFICIENCY
    assert ran == [] and seconds == pytest.approx(_queued(16e6 * 5 / bw + 3 * costs.LAUNCH_LATENCY, 3))


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


def test_optimizer_step_of_sharded_parameters_counts_the_local_shards(rt, tmp_path):
    """FSDP2 / tensor parallelism: each rank's step updates its shard of a DTensor parameter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        # this rank's half of a parameter sharded over two ranks
        half = nn.Parameter(
            DTensor.from_local(
                torch.empty(1_000_000), mesh, [Shard(0)], run_check=False, shape=torch.Size([2_000_000]), stride=(1,)
            )
        )
        whole = nn.Parameter(torch.empty(1_000_000))
        sharded = costs.optimizer_step_seconds(rt, torch.optim.Adam([half]), 0)
        plain = costs.optimizer_step_seconds(rt, torch.optim.Adam([whole]), 0)
    finally:
        dist.destroy_process_group()
    assert half.shape[0] == 2_000_000 and sharded == pytest.approx(plain)


@pytest.mark.parametrize("as_keyword", [False, True])
def test_forward_and_backward_inside_an_optimizer_closure_are_charged(as_keyword):
    """Lightning's automatic optimization and LBFGS run the forward and backward inside step()
    (a closure): that work is charged as the program's own; only the update is the step's."""
    import gpemu

    with gpemu.emulate(gpu="A100", clock=VirtualClock(), summary=False) as rt:
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(32, 64, device="cuda")

        def closure():
            opt.zero_grad()
            loss = model(x).sum()
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure=closure) if as_keyword else opt.step(closure)
        torch.cuda.synchronize()
        busy = {}
        for s in rt.recorder.spans:
            busy[s.kind] = busy.get(s.kind, 0.0) + s.end - s.start
        iterations = sum(1 for mark in rt.recorder.iterations if mark.device == 0)
    assert busy.get("optimizer", 0) > 0 and iterations == 3
    assert busy.get("forward", 0) + busy.get("backward", 0) + busy.get("op", 0) > 5 * busy["optimizer"]


def test_a_measured_time_carried_to_another_gpu_carries_the_transfer_error(rt):
    """A measured model's time carried to another GPU by the cost model's ratio (provenance
    'scaled', what gpemu.model_time asks for) has the cross-validated error of such transfers; an
    estimate from the ops has the op model's."""
    carried = costs.uncertainty(rt, 0, {"dense_conv": 1.0}, transferred=True)
    estimated = costs.uncertainty(rt, 0, {"dense_conv": 1.0})
    assert carried is not None and "carried" in carried.basis and 0 < carried.p50 <= carried.p90
    assert estimated is not None and "carried" not in estimated.basis
    assert str(carried).startswith("±")


def test_an_unknown_model_is_charged_what_the_cost_model_prices_for_it():
    """A model the database does not know runs op by op and each op is charged as the cost model
    prices it; the backward's ops (autograd's adds, copies and sums included) with the backward
    curves, as the model was calibrated (gpemu.device.backward_pass). So a run charges the
    forward and backward the cross-validated figures describe (CostModel.module_seconds)."""
    import gpemu
    from gpemu.costmodel import default_model

    with torch.device("meta"):
        net = tvmodels.resnet18()
    net.__class__ = type("UnknownResNet", (type(net),), {})  # its structure matches no dataset model
    expected = default_model().module_seconds(net, (torch.empty(64, 3, 224, 224, device="meta"),), "V100")
    net = net.to_empty(device="cpu")
    with gpemu.emulate(gpu="V100", clock=VirtualClock(), summary=False):
        model, x = net.cuda(), torch.empty(64, 3, 224, 224).cuda()
        for _ in range(2):  # recorded op by op, then replayed as the recorded pass
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
            out = model(x)
            mid.record()
            out.sum().backward()
            end.record()
            torch.cuda.synchronize()
            model.zero_grad()
        # (the replayed pass is the cost model's queue of host issue and kernel times; the
        # recording step itself is charged kernel by kernel as issued, on this virtual clock
        # with no host time between them)
        assert start.elapsed_time(mid) / 1e3 == pytest.approx(expected.forward, rel=0.002)
        assert mid.elapsed_time(end) / 1e3 == pytest.approx(expected.backward, rel=0.002)

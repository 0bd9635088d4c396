"""torch.compile priced as Inductor's kernels (gpemu.fusion): the kernels of small graphs against
what Inductor emits for them, the price of a fused kernel from the bytes at its boundary, the backward
fused too, graph breaks eager, and replays carrying the compiled prices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpemu
from gpemu import costs
from gpemu.clock import VirtualClock
from gpemu.costmodel import OpClass, OpFeatures


@pytest.fixture
def rt():
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock(), replay=False)
    yield rt
    gpemu.unpatch()


def _kernels(rt, fn, *args):
    """(name, seconds) of each GPU span ``fn(*args)`` makes."""
    first = len(rt.recorder.spans)
    fn(*args)
    return [(s.name.split(".")[0], s.end - s.start) for s in rt.recorder.spans[first:]]


def _streaming(rt, nbytes: float, backward: bool = False) -> float:
    """The cost model's price of one streaming kernel moving ``nbytes`` (independent of gpemu.fusion)."""
    return costs.kernel_price(rt, 0, OpFeatures("k", OpClass.ELEMENTWISE, backward, 0.0, nbytes)).gpu


# ------------------------------------------------------------------------------ small graphs
def test_softmax_written_out_is_one_kernel_reading_its_input_and_writing_its_output(rt):
    """Inductor emits one persistent-reduction kernel for a softmax (amax, sub, exp, sum, div)."""

    @torch.compile
    def softmax(x):
        e = (x - x.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)

    x = torch.empty(4096, 1024, device="cuda")
    (kernel,) = _kernels(rt, softmax, x)
    eager = _kernels(rt, softmax.__wrapped__, x)
    assert kernel[0].startswith("fused") and len(eager) == 5
    # one streaming pass over x and the output, no faster than its slowest reduction alone (the
    # pointwise ops are nothing but their bytes: they set no floor)
    reductions = [s for name, s in eager if name in ("amax", "sum")]
    expected = max(_streaming(rt, 2 * x.numel() * 4), max(reductions))
    assert kernel[1] == pytest.approx(expected, rel=1e-9)
    assert kernel[1] < sum(s for _, s in eager) / 3


def test_a_float8_cast_chain_costs_its_boundary_not_its_fp32_intermediates(rt):
    """torchao's cast (bf16 -> fp32, scale, clamp, -> float8) is one Inductor kernel reading bf16
    and writing float8: the fp32 intermediates its eager ops move are never written."""

    @torch.compile
    def cast(x, scale):
        return (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    x, scale = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16), torch.ones((), device="cuda")
    (kernel,) = _kernels(rt, cast, x, scale)
    eager = _kernels(rt, cast.__wrapped__, x, scale)
    assert kernel[0].startswith("fused") and len(eager) == 4
    assert kernel[1] == pytest.approx(_streaming(rt, x.numel() * (2 + 1) + scale.element_size()), rel=1e-9)
    assert kernel[1] < max(s for _, s in eager)


class _AmaxScaledGrad(torch.autograd.Function):
    """A backward that takes its gradient's amax, as float8 training's backward casts do."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * g.abs().amax()


def test_a_reduction_in_a_compiled_backward_costs_what_the_same_kernel_costs_forward(rt):
    """Inductor generates the same reduction kernel into a backward graph as into a forward one:
    the backward's ``abs + amax + mul`` is not priced on the backward curves' eager rates."""

    @torch.compile
    def forward_kernel(x):
        return x * x.abs().amax()

    x = torch.empty(4096, 4096, device="cuda")
    with torch.no_grad():
        ((name, forward),) = _kernels(rt, forward_kernel, x)
    xg = torch.empty(4096, 4096, device="cuda", requires_grad=True)
    y = torch.compile(_AmaxScaledGrad.apply)(xg)
    backward = [k for k in _kernels(rt, lambda: y.backward(torch.empty_like(y))) if k[0] == name]
    assert name == "fused: abs+amax+mul" and len(backward) == 1
    assert backward[0][1] == pytest.approx(forward, rel=0.1)


def test_residual_add_and_layer_norm_fuse_and_an_mlp_keeps_its_matrix_products(rt):
    """Inductor: ``add + native_layer_norm`` one kernel; a linear layer an extern addmm; GELU its
    own kernel between two matrix products."""
    ln = torch.nn.LayerNorm(1024).cuda()
    fc, proj = torch.nn.Linear(1024, 4096).cuda(), torch.nn.Linear(4096, 1024).cuda()

    @torch.compile
    def block(x, r):
        h = ln(x + r)
        return proj(F.gelu(fc(h)))

    x, r = torch.empty(2048, 1024, device="cuda"), torch.empty(2048, 1024, device="cuda")
    with torch.no_grad():
        names = [n for n, _ in _kernels(rt, block, x, r)]
    assert names == ["fused: add+native_layer_norm", "addmm", "gelu", "addmm"]


def test_a_compiled_training_step_saves_what_fusion_saves_forward_and_backward(rt):
    """An elementwise chain with a reduction, trained: compiled, the forward is one kernel and
    the backward's pointwise chain fuses too; the step is cheaper than eager."""

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1024))

        def forward(self, x):
            return (torch.tanh(x * self.scale) * 0.5 + 0.5).sum(-1)

    model = Chain().cuda()
    x = torch.empty(8192, 1024, device="cuda", requires_grad=True)

    def step(m):
        m(x).sum().backward()

    eager = _kernels(rt, step, model)
    compiled = _kernels(rt, step, torch.compile(model))
    fused = [n for n, _ in compiled if n.startswith("fused")]
    assert len(fused) >= 2  # forward and backward
    own = [s for n, s in eager if "host issue gaps" not in n]
    own_c = [s for n, s in compiled if "host issue gaps" not in n]
    assert len(own_c) < len(own)
    # the forward: reads x once, writes what the backward keeps (x*scale's tanh inputs are alive)
    assert sum(own_c) < 0.7 * sum(own)


def test_a_graph_break_leaves_the_broken_part_eager(rt):
    @torch.compiler.disable
    def eager_part(y):
        return y * 3 + 1

    @torch.compile
    def fn(x):
        return eager_part(x * 2 + 1) - 1

    @torch.compile
    def broken(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    x = torch.empty(1 << 20, device="cuda")
    assert [n for n, _ in _kernels(rt, fn, x)] == ["fused: mul+add", "mul", "add", "sub"]
    assert [n for n, _ in _kernels(rt, broken, x)] == ["mul", "add"]


def test_a_method_under_compiler_disable_binds_its_instance(rt):
    # A library imported while patched decorates methods (torchmetrics, Lightning): each call must
    # get its instance, as the undecorated function would, inside a compiled call and outside it.
    class Scaler(torch.nn.Module):
        @torch.compiler.disable
        def scaled(self, y):
            return y * self.factor

        def forward(self, x):
            return self.scaled(x + 1)

    m = Scaler()
    m.factor = 3
    x = torch.empty(1 << 20, device="cuda")
    assert m(x).shape == x.shape
    assert torch.compile(m)(x).shape == x.shape
    assert Scaler.scaled(m, x).shape == x.shape


def test_replays_carry_the_compiled_prices():
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock(), replay=True)
    try:
        mlp = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
        x = torch.empty(4096, 512, device="cuda")

        def steps(m, n=3):
            out = []
            for _ in range(n):
                torch.cuda.synchronize()
                t0 = rt.engine.now()
                m(x).sum().backward()
                torch.cuda.synchronize()
                out.append(rt.engine.now() - t0)
            return out

        eager = steps(mlp)
        compiled = steps(torch.compile(mlp))
        assert rt.replay.stats["replayed"] > 0
        assert compiled[-1] == pytest.approx(compiled[-2], rel=1e-6)  # replayed: the same price
        assert compiled[-1] < eager[-1]
    finally:
        gpemu.unpatch()


def test_a_backward_that_fails_leaves_no_compiled_region_behind(rt):
    model = torch.compile(torch.nn.Linear(256, 256).cuda())
    x = torch.empty(64, 256, device="cuda", requires_grad=True)
    y = model(x)

    def fail(grad):
        raise RuntimeError("a hook fails")

    x.register_hook(fail)
    with pytest.raises(RuntimeError, match="a hook fails"):
        y.sum().backward()
    z = torch.empty(1 << 16, device="cuda")
    # the region ends at the next op (its open group charged first); that op is eager again
    assert [n for n, _ in _kernels(rt, lambda: z * 2 + 1)][-2:] == ["mul", "add"]
    assert rt.tensors.fusion is None


@pytest.mark.slow  # (AlexNet's ops through their meta kernels: ~5 s alone)
def test_a_measured_model_compiled_carries_the_fusion_by_the_cost_models_ratio(rt, capsys):
    """AlexNet's measured (eager) times are carried to its compiled run by the ratio of its fused
    kernels to the same ops' eager prices: the compiled step is cheaper, the model still measured."""
    from examples import tvmodels

    model = tvmodels.alexnet().cuda()
    x = torch.empty(32, 3, 224, 224, device="cuda")

    def step(m):
        torch.cuda.synchronize()
        t0 = rt.engine.now()
        m(x).sum().backward()
        torch.cuda.synchronize()
        return rt.engine.now() - t0

    eager = [step(model) for _ in range(2)][-1]
    compiled = [step(torch.compile(model)) for _ in range(2)][-1]
    err = capsys.readouterr().err
    assert "alexnet on A100: forward time scaled from the profile database" in err
    assert 0.8 * eager < compiled < 0.995 * eager

"""Record/replay fast path: equivalence with the op-by-op path, cache keys, fallbacks, time, memory."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import gpemu
from gpemu.clock import VirtualClock
from gpemu.fastpaths import replay


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> dict:
        h = torch.relu(self.bn(self.conv(x)))
        return {"logits": self.fc(h.flatten(1)), "features": (h, h.mean())}


def _specs(tree):
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    return spec, [(t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in leaves]


def _step(model, batch=4):
    out = model(torch.randn(batch, 3, 8, 8).cuda())
    loss = out["logits"].sum() + out["features"][1]
    model.zero_grad(set_to_none=True)
    loss.backward()
    return out


def test_replay_matches_the_op_by_op_path(rt):
    model = Net().cuda()
    first = _step(model)  # recorded
    assert replay.replay_info()["recorded"] == 1
    rec_grads = {
        n: (p.grad.shape, p.grad.dtype, p.grad.device) if p.grad is not None else None
        for n, p in model.named_parameters()
    }
    second = _step(model)  # replayed
    assert replay.replay_info()["replayed"] == 1
    assert _specs(first) == _specs(second)
    rep_grads = {
        n: (p.grad.shape, p.grad.dtype, p.grad.device) if p.grad is not None else None
        for n, p in model.named_parameters()
    }
    assert rep_grads == rec_grads
    assert rec_grads["unused.weight"] is None and rec_grads["conv.weight"] == (
        (8, 3, 3, 3),
        torch.float32,
        torch.device("cuda", 0),
    )


def test_replay_input_grads_and_chained_modules(rt):
    a, b = nn.Linear(16, 32).cuda(), nn.Linear(32, 4).cuda()
    for _ in range(3):
        x = torch.randn(8, 16).cuda().requires_grad_()
        h = a(x)
        b(h).sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        assert a.weight.grad.shape == a.weight.shape
        a.zero_grad(), b.zero_grad()
    assert replay.replay_info()["replayed"] >= 4


def test_cache_key_changes_rerecord(rt):
    model = Net().cuda()
    _step(model)
    _step(model, batch=6)  # new input shape
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(4, 3, 8, 8).cuda())
    assert not out["logits"].requires_grad
    with torch.no_grad():
        model(torch.randn(4, 3, 8, 8).cuda())
    model.train()
    model.conv.weight.requires_grad_(False)  # freezing a layer invalidates recordings
    _step(model)
    assert model.conv.weight.grad is None and model.fc.weight.grad is not None
    info = replay.replay_info()
    assert info["recorded"] == 4 and info["replayed"] == 1


def test_hooks_force_the_normal_path(rt, capsys):
    model = Net().cuda()
    seen = []
    model.fc.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    for _ in range(3):
        _step(model)
    assert len(seen) == 3  # the hook ran every time: fc is never replayed
    info = replay.replay_info()
    # the model runs op by op every time; its submodules without hooks are units of their own
    # (recorded once, then replayed), fc with its hook runs op by op
    assert info["fallback"] == 3 + 3 and info["recorded"] == 2 and info["replayed"] == 4
    assert "module hooks are registered" in capsys.readouterr().err


def test_replay_off_by_config():
    gpemu.patch(gpu="V100", summary=False, replay=False, clock=VirtualClock())
    model = Net().cuda()
    _step(model), _step(model)
    assert replay.replay_info()["replayed"] == 0 and replay.replay_info()["fallback"] == 2
    gpemu.unpatch()


def test_plain_value_outputs_replay_and_object_outputs_fall_back(rt):
    """Plain values among the outputs (None for weights not returned, a label) are given back
    as they are; an object (a cache the call filled) cannot be replayed: the call runs op by op,
    and its submodules are replayed as units of their own."""
    import types

    class Odd(nn.Module):
        def __init__(self, make) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.make = make

        def forward(self, x):
            return self.lin(x), self.make()

    plain = Odd(lambda: ("label", None)).cuda()
    for _ in range(3):
        out, (label, nothing) = plain(torch.randn(2, 4).cuda())
        assert label == "label" and nothing is None and out.shape == (2, 4)
    assert replay.replay_info()["replayed"] == 2
    odd = Odd(lambda: types.SimpleNamespace(cache=[])).cuda()
    for _ in range(3):
        out, holder = odd(torch.randn(2, 4).cuda())
        assert isinstance(holder, types.SimpleNamespace) and holder.cache == [] and out.shape == (2, 4)
        out.sum().backward()
    info = replay.replay_info()
    assert info["fallback"] == 2  # the second and third calls of `odd`
    assert info["recorded"] == 2 and info["replayed"] == 3  # + odd.lin: recorded, then replayed once


def test_outermost_module_owns_forward_and_backward_time(rt):
    """An unknown model is priced by the ops it runs: the recorded call's ops are charged one by
    one (user code runs once), and each replay charges their sums as one forward and one backward
    span of the outermost module (inner modules are not charged separately)."""
    from gpemu.identify import identify

    model = Net().cuda()
    _step(model)  # recorded: op by op
    spans = rt.recorder.spans
    # (its forward's ops one by one; then, as one forward span, what its kernels waited for the
    # host issuing them: the forward ends where its replays' passes end)
    waited = [s for s in spans if s.kind in ("forward", "backward")]
    assert [s.kind for s in waited] in ([], ["forward"])
    recorded_ops = sum(s.end - s.start for s in spans if s.kind == "op")
    first = len(spans)
    for _ in range(2):
        _step(model)
    fwd = [s for s in spans[first:] if s.kind == "forward"]
    bwd = [s for s in spans[first:] if s.kind == "backward"]
    assert len(fwd) == 2 and len(bwd) == 2  # one per iteration: inner modules not charged
    assert all(s.name == fwd[0].name for s in fwd) and fwd[0].end - fwd[0].start > 0
    ident = identify(rt, model)
    forward, backward = ident.estimates[("forward", 4, 0)], ident.estimates[("backward", 4, 0)]
    assert fwd[0].end - fwd[0].start == pytest.approx(forward) and bwd[0].end - bwd[0].start == pytest.approx(backward)
    # A pass is its ops' kernels plus the host time a real host takes to issue them where the GPU
    # waits for it (the cost model's queue): at least the module's kernels (most of what the
    # recorded step charged; the loss's own ops are outside the module).
    assert forward + backward > 0.8 * recorded_ops


@pytest.mark.slow
def test_replay_memory_matches_recording(rt):
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.Tanh()).cuda()
    mem = rt.memory[0]
    x = torch.empty(256, 512, device="cuda")
    held, peaks = [], []
    start = mem.allocated
    for _ in range(3):
        mem.reset_peak()
        base = mem.allocated
        out = model(x)
        held.append(mem.allocated - base)  # outputs + saved activations
        out.sum().backward()
        del out
        gc.collect()
        peaks.append(mem.peak_allocated)
        model.zero_grad(set_to_none=True)
    assert held[0] > 256 * 512 * 4  # saved activations, not just the output
    assert held[1] == held[0] == held[2]
    assert peaks[2] == pytest.approx(peaks[0], rel=0.05)
    assert mem.allocated == start  # saved activations freed by backward, grads dropped


def test_resnet_like_model_from_examples(rt):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import tvmodels
    except ImportError:
        pytest.skip("examples/tvmodels/ not available")
    model = tvmodels.resnet18(num_classes=10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        out = model(torch.randn(2, 3, 64, 64).cuda())
        loss = nn.functional.cross_entropy(out, torch.zeros(2, dtype=torch.long).cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert out.shape == (2, 10)
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert replay.replay_info()["replayed"] == 2


def test_replayed_grads_reach_autograd_grad_and_parameter_hooks(rt):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).cuda()
    x = torch.randn(4, 8).cuda()
    model(x).sum().backward()  # recorded
    model.zero_grad(set_to_none=True)
    # torch.autograd.grad w.r.t. parameters: gradients are returned, .grad untouched
    grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    assert [g.shape for g in grads] == [p.shape for p in model.parameters()]
    assert all(p.grad is None for p in model.parameters())
    # post-accumulate-grad hooks (as DDP uses) still fire on replay
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda t: fired.append(t.shape))
    model(x).sum().backward()
    assert len(fired) == 4 and replay.replay_info()["replayed"] == 2
    # accumulation keeps the existing gradient tensor
    g = model[0].weight.grad
    model(x).sum().backward()
    assert model[0].weight.grad is g


def test_outputs_can_be_modified_in_place(rt):
    model = nn.Linear(4, 3).cuda()
    for _ in range(3):  # recorded, replayed, replayed
        out = model(torch.randn(2, 4).cuda())
        out /= 2.0
        torch.relu_(out)
        out.sum().backward()
        assert model.weight.grad.shape == (3, 4)


class TwoHeads(nn.Module):
    """Like GoogLeNet in training mode: an auxiliary head the loss may not use."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 10)
        self.aux = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> tuple:
        h = torch.relu(self.body(x))
        return self.head(h), self.aux(h)


def test_unused_output_gets_no_plain_meta_gradients(rt) -> None:
    model = TwoHeads().cuda()
    x = torch.empty(4, 16, device="cuda")
    out, _ = model(x)  # recorded op by op
    out.sum().backward()
    # as in torch: the unused head's parameters get no gradient at all (autograd used to make
    # zeros from the wrapper's metadata, plain meta tensors, and run the aux branch on them)
    assert model.aux.weight.grad is None and model.aux.bias.grad is None
    assert type(model.head.weight.grad) is gpemu.device.EmuTensor
    for _ in range(3):  # replayed
        model.zero_grad(set_to_none=True)
        out, _ = model(x)
        out.sum().backward()
        for p in model.parameters():
            assert p.grad is None or type(p.grad) is gpemu.device.EmuTensor
        assert type(model.head.weight.grad) is gpemu.device.EmuTensor
    assert replay.replay_info()["replayed"] == 3


def test_unknown_models_run_once_and_are_priced_by_what_ran(rt):
    """Pricing an unknown model never runs its forward a second time (on another device or
    otherwise): side effects and lazily built caches are a GPU run's, and the price follows the
    ops that ran (here: the sequence length)."""

    class Lazy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)
            self.calls = 0
            self.mask = None

        def forward(self, x):
            self.calls += 1
            if self.mask is None or self.mask.shape[0] != x.shape[1]:
                self.mask = torch.tril(torch.ones(x.shape[1], x.shape[1], device=x.device))
            scores = (self.proj(x) @ x.transpose(1, 2)) * self.mask
            return scores @ x

    model = Lazy().cuda()
    out = model(torch.zeros(2, 64, 32, device="cuda"))
    assert model.calls == 1  # ran once
    assert model.mask.device.type == "cuda" and model.mask.is_cuda  # a device tensor, not a meta one
    out.sum().backward()
    from gpemu.identify import identify

    ident = identify(rt, model)
    short = ident.estimates[("forward", 2, 0)]
    model(torch.zeros(2, 4096, 32, device="cuda")).sum().backward()  # another sequence length: recorded
    long = ident.estimates[("forward", 2, 0)]
    # 64x the tokens, quadratic attention-like products (the short pass is mostly its host's
    # issue time, the cost model's queue)
    assert long > 4 * short


def test_two_forwards_then_one_backward_charge_both_backwards(rt):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    x = torch.zeros(16, 64, device="cuda")
    first, second = model(x), model(x)  # recorded, then replayed before the recording's backward
    torch.cuda.synchronize()
    before = len(rt.recorder.spans)
    (first.sum() + second.sum()).backward()
    torch.cuda.synchronize()
    backward = [s for s in rt.recorder.spans[before:] if s.kind == "backward"]
    from gpemu.identify import identify

    measured = identify(rt, model).estimates[("backward", 16, 0)]
    assert len(backward) == 1 and backward[0].end - backward[0].start == pytest.approx(measured)
    # and the recording's own backward was charged op by op at what the replay charges: its kernels
    # and its pass's issue gaps (plus the backward of the two sums and their addition: tiny kernels)
    ops = sum(s.end - s.start for s in rt.recorder.spans[before:] if s.kind == "op")
    assert measured <= ops <= 1.1 * measured


def test_slices_of_one_tensor_are_the_same_call(rt):
    """word_language_model feeds source[i:i+35] batches of one long tensor: each slice sits at
    another storage offset but is the same call (recorded once, then replayed)."""
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100)).cuda()
    source = torch.zeros(35 * 6, 4, dtype=torch.long).cuda()
    for i in range(0, 35 * 6, 35):
        model(source[i : i + 35]).sum().backward()
    info = replay.replay_info()
    assert info["recorded"] == 1 and info["replayed"] == 5


def test_object_arguments_new_at_every_call_are_not_replayed(rt):
    """An HF layer gets a new cache object at every call and updates it: such a call is never
    replayed (a replay would skip the update); its submodules are. The same object every time
    (a config) replays. Recordings do not keep the objects of old calls alive."""
    import gc
    import weakref

    class Cache:
        def __init__(self) -> None:
            self.tensors = []

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, cache):
            y = self.proj(x)
            cache.tensors.append(y)  # the side effect a replay would skip
            return y

    layer = Layer().cuda()
    x = torch.zeros(2, 8, device="cuda")
    refs = []
    for i in range(4):
        cache = Cache()
        refs.append(weakref.ref(cache))
        layer(x, cache).sum().backward()
        assert len(cache.tensors) == 1  # the call ran: the cache was updated every time
        if i == 0:
            # the first call is recorded; its key must not keep the cache (and the emulated
            # memory of the tensors it holds) alive after the call
            del cache
            gc.collect()
            assert refs[0]() is None
    del cache
    gc.collect()
    assert sum(r() is not None for r in refs) == 0  # no recording holds an old cache
    info = replay.replay_info()
    assert info["fallback"] == 3 and info["replayed"] >= 1  # calls 2-4; proj replayed inside them
    same = Cache()
    other = Layer().cuda()
    for _ in range(3):
        other(x, same).sum().backward()
    assert replay.replay_info()["replayed"] >= info["replayed"] + 2


def test_units_of_an_op_by_op_model_cost_what_its_ops_cost():
    """An HF-style model (a new cache object at every call) runs op by op and its submodules are
    replayed as units of their own. A replayed unit must charge the GPU time its ops were charged
    op by op: steps while the units are being recorded and steps that replay them cost the same.
    Two ways this failed: a unit priced as a pass started on an idle GPU (host issue times of the
    cost model's calibration added, +18% per GPT-2 step in bf16), and a unit's backward window
    counting other nodes the autograd engine ran inside it (the position embedding's window
    stayed open to the end of the backward and counted the token embedding's backward)."""

    class Cache:
        pass

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(64)
            self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(approximate="tanh"), nn.Linear(256, 64))

        def forward(self, h, cache):
            return h + self.mlp(self.ln(h))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(1000, 64), nn.Embedding(128, 64)
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(64, 1000)

        def forward(self, ids, cache):
            h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for b in self.blocks:
                h = b(h, cache)
            return self.head(h), cache

    rt = gpemu.patch(gpu="H100", summary=False, clock=VirtualClock())
    try:
        model = Model().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.zeros(8, 128, dtype=torch.long, device="cuda")
        busy = []
        for _ in range(7):
            n0 = len(rt.recorder.spans)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, _ = model(ids, Cache())
            logits.float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            spans = rt.recorder.spans[n0:]
            busy.append((sum(s.end - s.start for s in spans), {s.kind for s in spans}))
        assert busy[0][1] == {"op", "optimizer"}  # all op by op (the model is recorded)
        assert {"forward", "backward"} <= busy[-1][1]  # its units replayed
        assert replay.replay_info()["replayed"] > 0
        for seconds, _ in busy[1:]:
            assert seconds == pytest.approx(busy[0][0], rel=1e-6)
    finally:
        gpemu.unpatch()


def test_tf32_switches_are_part_of_the_situation():
    """A recording priced with TF32 GEMMs (tensor cores on an A100) is not replayed once the
    program turns TF32 off: the step is recorded again and priced on the FMA units."""
    saved = torch.backends.cuda.matmul.allow_tf32
    r = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    try:
        model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)).cuda()
        x = torch.randn(8192, 4096).cuda()

        def gpu_seconds() -> float:
            torch.cuda.synchronize()
            n = len(r.recorder.spans)
            model(x).sum().backward()
            torch.cuda.synchronize()
            return sum(s.end - s.start for s in list(r.recorder.spans)[n:] if s.kind != "copy")

        torch.backends.cuda.matmul.allow_tf32 = True
        gpu_seconds()
        tf32 = gpu_seconds()  # replayed
        torch.backends.cuda.matmul.allow_tf32 = False
        fp32 = gpu_seconds()
        fp32_again = gpu_seconds()
        info = replay.replay_info()
    finally:
        gpemu.unpatch()
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert info["recorded"] == 2 and info["replayed"] == 2
    assert fp32 > 3 * tf32  # 19.5 TFLOP/s on FMA units against 156 TFLOP/s on TF32 tensor cores
    assert fp32_again == pytest.approx(fp32, rel=0.02)


class _OnDemandNode:
    """An autograd node as torch 2.11 hands C++ nodes to Python: ``next_functions`` makes a new
    Python object for each next node on every access and keeps none of them, so a freed one's
    id is soon another's (torch 2.13 keeps them; this double stands in for the older torch)."""

    def __init__(self, depth: int, fan: int) -> None:
        self.depth, self.fan = depth, fan

    @property
    def next_functions(self) -> tuple:
        if self.depth == 0:
            return ()
        return tuple((_OnDemandNode(self.depth - 1, self.fan), 0) for _ in range(self.fan))


def test_graph_walk_sees_every_node_when_torch_makes_node_objects_on_demand():
    from gpemu.model_time import graph_nodes

    # A chain of 40 nodes: each one must be visited once, none skipped because a freed node
    # object's id was taken by the next one made.
    assert sum(1 for _ in graph_nodes([_OnDemandNode(39, 1)])) == 40
    # Two edges per node (each access makes distinct objects): a tree of 2^8 - 1 nodes.
    assert sum(1 for _ in graph_nodes([_OnDemandNode(7, 2)])) == 2**8 - 1

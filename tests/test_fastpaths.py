"""Host-side fast paths: skipped optimizer steps, cached module walks, grouped gradient memory,
forward time from the call's start, settle() after sync waits. Each must fall back correctly."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import gpemu
from gpemu.clock import VirtualClock
from gpemu.fastpaths import optimizer as ofp
from gpemu.fastpaths import replay


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()


def _train(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    x = torch.zeros(16, 32, device="cuda")
    for _ in range(n):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_sgd_momentum_steps_skipped_after_state_exists(rt) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 5)
    info = ofp.fast_path_info()
    # step 1 creates the momentum buffers, step 2 is measured, steps 3-5 are skipped
    assert (info["real"], info["fast"]) == (2, 3)
    spans = [s for s in rt.recorder.spans if s.kind == "optimizer"]
    assert len(spans) == 5 and len({round(s.end - s.start, 12) for s in spans}) == 1
    assert len(rt.recorder.iterations) == 5


def test_adam_step_counters_advance_on_skipped_steps(rt) -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 6)
    assert ofp.fast_path_info()["fast"] == 4
    steps = {float(opt.state[p]["step"]) for p in model.parameters()}
    assert steps == {6.0}
    # a parameter without a gradient keeps its counter, as the real step does
    model[0].weight.requires_grad_(False)
    _train(model, opt, 2)
    assert float(opt.state[model[0].bias]["step"]) == 8.0
    assert float(opt.state[model[0].weight]["step"]) == 6.0


def test_fallbacks_closure_subclass_capturable_and_changed_groups(rt) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 3)
    fast = ofp.fast_path_info()["fast"]
    x = torch.zeros(16, 32, device="cuda")

    def closure():
        loss = model(x).sum()
        loss.backward()
        return loss

    opt.step(closure)  # closures always run for real
    assert ofp.fast_path_info()["fast"] == fast
    opt.zero_grad()
    # a new param group: the next step runs for real (and creates its state)
    extra = nn.Linear(4, 4).cuda()
    opt.add_param_group({"params": list(extra.parameters())})
    real = ofp.fast_path_info()["real"]
    _train(model, opt, 1)
    assert ofp.fast_path_info()["real"] == real + 1

    class MySGD(torch.optim.SGD):
        pass

    opt2 = MySGD(model.parameters(), lr=0.1, momentum=0.9)
    before = dict(ofp.fast_path_info())
    _train(model, opt2, 4)
    assert ofp.fast_path_info()["fast"] == before["fast"]  # subclasses never take the fast (step) path

    opt3 = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    _train(model, opt3, 4)
    assert ofp.fast_path_info()["fast"] == before["fast"]  # capturable: real steps


def test_load_state_dict_invalidates_the_plan(rt) -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 3)
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    real = ofp.fast_path_info()["real"]
    _train(model, opt, 2)
    assert ofp.fast_path_info()["real"] == real + 1  # re-measured once, then skipped again
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {5.0}


def test_replay_off_means_real_steps() -> None:
    gpemu.patch(gpu="V100", summary=False, replay=False, clock=VirtualClock())
    try:
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _train(model, opt, 4)
        assert ofp.fast_path_info()["fast"] == 0 and ofp.fast_path_info()["zero_grad_fast"] == 0
    finally:
        gpemu.unpatch()


def test_skipped_step_keeps_transient_memory_peak(rt) -> None:
    model = _net()
    # weight decay makes the foreach step allocate temporaries
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    mem = rt.memory[0]
    _train(model, opt, 2)
    x = torch.zeros(16, 32, device="cuda")
    peaks = []
    for _ in range(2):
        model(x).sum().backward()
        mem.reset_peak()
        opt.step()
        peaks.append(mem.peak_allocated - mem.allocated)
        opt.zero_grad()
    assert ofp.fast_path_info()["fast"] >= 1
    assert peaks[0] > 0 and peaks[0] == peaks[1]


def test_walk_cache_sees_new_submodules_training_flags_and_hooks(rt) -> None:
    model = _net()
    x = torch.zeros(4, 32, device="cuda")
    model(x)
    model(x)
    replayed = replay.replay_info()["replayed"]
    model.eval()
    model(x)  # new situation: recorded, not replayed
    assert replay.replay_info()["replayed"] == replayed
    model.append(nn.Linear(10, 3).cuda())
    assert model(x).shape == (4, 3)
    calls = []
    handle = model[0].register_forward_hook(lambda *a: calls.append(1))
    model(x)
    assert calls == [1]  # hooks force the op-by-op path
    handle.remove()  # (bumps nothing: a tree found hooked is re-checked at every call)
    model(x)
    fallback = replay.replay_info()["fallback"]
    model(x)
    assert calls == [1] and replay.replay_info()["fallback"] == fallback  # replayed whole again
    for register in ("register_forward_pre_hook", "register_full_backward_pre_hook", "register_full_backward_hook"):
        handle = getattr(model[-1], register)(lambda *a, name=register: calls.append(name))
        model(x).sum().backward()
        assert calls[-1] == register and replay.replay_info()["fallback"] > fallback
        fallback = replay.replay_info()["fallback"]
        handle.remove()
    model(x)
    assert replay.replay_info()["fallback"] == fallback


def test_walk_cache_sees_parameter_and_submodule_dicts_written_directly(rt) -> None:
    """Writes that bypass every Module method (torch's own ModuleList.insert, pruning's
    ``del module._parameters[name]``, a library's direct insertion) still renew the walk."""
    blocks = nn.ModuleList([nn.Linear(8, 8)])
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), blocks).cuda()
    first, inner = nn.Linear(8, 8).cuda(), nn.Linear(8, 8).cuda()  # (.cuda() renews every walk)
    assert len(rt.replay.params_of(model)) == 4
    blocks.insert(0, first)  # a non-empty dict grows
    assert len(rt.replay.params_of(model)) == 6
    model[1]._modules["inner"] = inner  # an empty dict gets an entry
    assert len(rt.replay.params_of(model)) == 8
    del model[0]._parameters["bias"]  # a non-empty dict shrinks
    assert len(rt.replay.params_of(model)) == 7
    assert set(map(id, rt.replay.params_of(model))) == set(map(id, model.parameters()))


@pytest.mark.slow
def test_grouped_gradient_memory_freed_with_the_gradients(rt) -> None:
    model = _net()
    mem = rt.memory[0]
    x = torch.zeros(16, 32, device="cuda")
    for _ in range(3):
        model(x).sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert len({g.data_ptr() for g in grads}) == len(grads)  # distinct addresses
        with_grads = mem.allocated
        for p in model.parameters():
            p.grad = None
        del grads
        gc.collect()
        param_bytes = sum((p.numel() * 4 + 511) // 512 * 512 for p in model.parameters())
        assert with_grads - mem.allocated == param_bytes


@pytest.mark.parametrize("model_name", [None, "resnet50"])
def test_forward_time_starts_when_the_call_starts(model_name) -> None:
    """A replayed call (and a measured model's recorded call) charges its forward from the moment
    the call started, not after the emulator's own host work inside the call. (An unknown model's
    recorded call charges its ops as they run.)"""
    clock = VirtualClock()
    gpemu.patch(gpu="V100", summary=False, clock=clock, model=model_name)
    try:
        model = _net()
        x = torch.zeros(16, 32, device="cuda")
        if model_name is None:
            model(x).sum().backward()  # the recording, priced by its ops
        torch.cuda.synchronize()
        orig = replay._outer_call

        def slow(*args, **kwargs):
            clock.advance(0.5)  # the emulator's host work inside the call
            return orig(*args, **kwargs)

        replay._outer_call = slow
        try:
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = clock.now()
                model(x)
                rt = gpemu.runtime.current()
                fwd = [s for s in rt.recorder.spans if s.kind == "forward"][-1]
                assert fwd.start == pytest.approx(t0)
        finally:
            replay._outer_call = orig
    finally:
        gpemu.unpatch()


def test_pageable_copy_is_issued_at_the_call_and_its_return_path_is_forgiven() -> None:
    """x.cuda() of pageable memory: the copy starts when the program asked for it, and the
    emulator's work after the copy's wait does not delay the program's next GPU work."""
    clock = VirtualClock()
    gpemu.patch(gpu="V100", summary=False, clock=clock)
    try:
        rt = gpemu.runtime.current()
        engine = rt.engine
        ts = rt.tensors
        transfers = rt.transfers
        orig_charge, orig_wrap = transfers.charge, ts.wrap

        def slow_charge(*args, **kwargs):
            clock.advance(0.004)  # emulator book-keeping before the copy is queued (< the copy)
            return orig_charge(*args, **kwargs)

        def slow_wrap(*args, **kwargs):
            clock.advance(0.02)  # emulator work after the copy's wait, before returning
            return orig_wrap(*args, **kwargs)

        transfers.charge, ts.wrap = slow_charge, slow_wrap
        try:
            torch.cuda.synchronize()
            t0 = engine.now()
            torch.zeros(64, 3, 224, 224).cuda()
        finally:
            del transfers.charge
            del ts.wrap
        copy = [s for s in rt.recorder.spans if s.kind == "transfer"][-1]
        assert copy.start == pytest.approx(t0, abs=1e-9)
        # back in the program at the copy's end on the emulated timeline, not 20 ms later
        assert engine.now() == pytest.approx(copy.end, abs=1e-9)
    finally:
        gpemu.unpatch()


def test_settle_forgives_only_time_right_after_a_wait() -> None:
    from gpemu.recorder import Recorder
    from gpemu.time import TimeEngine

    clock = VirtualClock()
    eng = TimeEngine(1, Recorder(), clock=clock)
    s = eng.default_stream(0)
    s.enqueue(1.0, "forward", "m")
    eng.synchronize(0)
    clock.advance(0.001)  # the emulator computes a placeholder value
    eng.settle()
    assert eng.now() == pytest.approx(clock.now() - 0.001)
    s.enqueue(1.0, "forward", "m")
    clock.advance(2.0)  # the program's own host work: the GPU finished meanwhile
    eng.synchronize(0)  # no wait: nothing to forgive
    eng.settle()
    assert eng.now() == pytest.approx(clock.now() - 0.001)  # only the earlier lateness stays


def test_backend_oom_reaches_the_program_unchanged_and_sees_the_device_peak(rt) -> None:
    seen = []

    class Refusing:
        def run(self, device, seconds, peak_bytes, kind):
            seen.append(peak_bytes)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (sharing manager refused)")

    eng = rt.engine
    x = torch.zeros(1024, 1024, device="cuda")  # 4 MiB tracked on device 0
    eng.set_backend(Refusing())
    try:
        eng.stream(0).enqueue(0.01, "op", "k")
        with pytest.raises(torch.cuda.OutOfMemoryError, match="refused"):
            eng.synchronize(0)
        assert seen and seen[0] >= 4 * 1024 * 1024
    finally:
        eng.close()
        eng.set_backend(None)
    del x


def test_stream_is_capturing_and_host_shadow_api(rt) -> None:
    from gpemu.device import host_shadow, set_host_shadow

    assert torch.cuda.current_stream().is_capturing() is False
    t = torch.tensor([1.0, 2.0], device="cuda")
    assert host_shadow(t).tolist() == [1.0, 2.0]
    assert set_host_shadow(t, torch.tensor([3, 4]))
    assert t.tolist() == [3.0, 4.0]
    assert not set_host_shadow(t, torch.zeros(3))  # wrong size: value becomes unknown
    assert host_shadow(t) is None and t.tolist() == [0.0, 0.0]
    assert host_shadow(torch.ones(2)) is None


def test_backward_inputs_subset_sets_only_those_gradients(rt) -> None:
    model = _net()
    x = torch.zeros(16, 32, device="cuda")
    for _ in range(3):  # recorded, then replayed
        model(x).sum().backward(inputs=[model[2].weight])
        assert [p.grad is not None for p in model.parameters()] == [False, False, True, False]
        model[2].weight.grad = None
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert replay.replay_info()["replayed"] >= 3


# ----------------------------------------------------------------------------------------------
# loss.backward() without the autograd engine (gpemu.fastpaths.backward._direct_backward)
# ----------------------------------------------------------------------------------------------
def _classifier_steps(rt, n: int, direct: bool, before_backward=None, head=None) -> dict:
    """n training steps of a small classifier; GPU spans (kind, duration, start offset), memory
    and gradient metadata of the last one. ``head(logits)``: what the loss is taken of."""
    rt.replay.direct_enabled = direct
    # Earlier models (the other path's run, earlier tests) are freed by the garbage collector, as
    # torch's own modules and optimizers are: collected now, not in the middle of a measured step
    # (where freeing their memory would lower this step's peak).
    gc.collect()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.zeros(4, 3, 8, 8, device="cuda")
        y = torch.zeros(4, dtype=torch.long, device="cuda")
        mem = rt.memory[0]
        for _ in range(n):
            torch.cuda.synchronize()
            first = len(rt.recorder.spans)
            mem.reset_peak()
            base = mem.allocated
            out = model(x)
            loss = nn.functional.cross_entropy(out if head is None else head(out), y)
            if before_backward is not None:
                before_backward(loss)
            loss.backward()
            after = mem.allocated - base
            peak = mem.peak_allocated - base
            grads = [(p.grad.shape, p.grad.dtype, p.grad.device) for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        spans = rt.recorder.spans[first:]
        t0 = spans[0].start
        return {
            "spans": [(s.kind, s.name, round(s.end - s.start, 12), round(s.start - t0, 12)) for s in spans],
            "after": after,
            "peak": peak,
            "grads": grads,
        }
    finally:
        rt.replay.direct_enabled = True


def test_direct_backward_charges_and_allocates_what_the_engine_path_does(rt) -> None:
    reference = _classifier_steps(rt, 6, direct=False)
    assert replay.replay_info().get("direct_backward", 0) == 0
    got = _classifier_steps(rt, 6, direct=True)
    assert replay.replay_info()["direct_backward"] >= 2  # the steps after recording and hub mode
    assert got == reference
    assert any(kind == "backward" for kind, *_ in got["spans"])


# What a training step does to logits between model and loss: a reshape, a cast, a transpose.
_HEADS = {
    "view": lambda out: out.view(2, 2, 10).flatten(0, 1),
    "cast": lambda out: out.double().reshape(4, 10),
    "transpose": lambda out: out.t().t(),
}


@pytest.mark.parametrize("name", sorted(_HEADS))
def test_direct_backward_runs_torchs_nodes_between_loss_and_module_as_the_engine_does(rt, name) -> None:
    reference = _classifier_steps(rt, 6, direct=False, head=_HEADS[name])
    assert replay.replay_info().get("direct_backward", 0) == 0
    got = _classifier_steps(rt, 6, direct=True, head=_HEADS[name])
    assert replay.replay_info()["direct_backward"] >= 2
    assert got == reference
    if name == "cast":  # the cast back is a kernel of the backward (priced so: same spans)
        names = [op for _, op, *_ in got["spans"]]
        assert "_to_copy.default" in names[names.index("cross_entropy backward") :]


def test_direct_backward_through_torchs_nodes_matches_the_engine_behind_a_modelled_host() -> None:
    """Behind a modelled host each op costs issue time: the nodes' ops cost the same there."""
    rt = gpemu.patch(gpu="H100", summary=False, clock=VirtualClock(), host="h100-xeon")
    try:
        reference = _classifier_steps(rt, 6, direct=False, head=_HEADS["cast"])
        got = _classifier_steps(rt, 6, direct=True, head=_HEADS["cast"])
        assert replay.replay_info()["direct_backward"] >= 2
        assert got == reference
    finally:
        gpemu.unpatch()


def test_direct_backward_leaves_nodes_that_keep_tensors_to_the_engine(rt) -> None:
    # exp keeps its result for its backward: the engine frees it once the node ran
    reference = _classifier_steps(rt, 6, direct=False, head=torch.exp)
    got = _classifier_steps(rt, 6, direct=True, head=torch.exp)
    assert replay.replay_info().get("direct_backward", 0) == 0
    assert got == reference


def test_direct_backward_leaves_hooks_on_torchs_nodes_and_retained_gradients_to_the_engine(rt) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()
    x, y = torch.zeros(16, 32, device="cuda"), torch.zeros(16, dtype=torch.long, device="cuda")
    seen: list[str] = []

    def step(retain: str = "", node_hook: bool = False) -> tuple[int, torch.Tensor]:
        """One step, logits reshaped for the loss; the direct backwards it added, and the logits
        (``retain="logits"``) or reshaped logits (``"flat"``) whose gradient it retained."""
        used = replay.replay_info().get("direct_backward", 0)
        out = model(x)
        flat = out.view(4, 4, 10).flatten(0, 1)
        kept = out if retain == "logits" else flat
        if retain:
            kept.retain_grad()
        if node_hook:  # registered in C++ through torch's Python door (_HookMixin)
            flat.grad_fn.register_prehook(lambda g: seen.append("node"))
        nn.functional.cross_entropy(flat, y).backward()
        model.zero_grad()
        return replay.replay_info().get("direct_backward", 0) - used, kept

    for _ in range(4):
        step()  # recording, two plain backwards, then hub mode
    assert step()[0] == 1
    # a hook on torch's own node between loss and module: the engine runs it
    assert step(node_hook=True)[0] == 0 and seen == ["node"]
    # retain_grad() hooks the node in C++ alone: the engine fills .grad, as on a GPU
    for retain in ("logits", "flat"):
        used, kept = step(retain)
        assert used == 0 and kept.grad is not None and kept.grad.shape == kept.shape
    assert step()[0] == 1


def test_direct_backward_leaves_hooked_graphs_and_input_gradients_to_the_engine(rt) -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.zeros(4, 3, 8, 8, device="cuda")
    y = torch.zeros(4, dtype=torch.long, device="cuda")

    def step(before_backward=None) -> int:
        """One step; how many direct backwards it added."""
        used = replay.replay_info().get("direct_backward", 0)
        loss = nn.functional.cross_entropy(model(x), y)
        if before_backward is not None:
            before_backward(loss)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        return replay.replay_info().get("direct_backward", 0) - used

    for _ in range(4):
        step()  # recording, two plain backwards, then hub mode
    assert step() == 1
    seen: list[str] = []
    # a hook on the replayed module's graph node, or on the loss tensor: the engine runs and calls it
    assert step(lambda loss: loss.grad_fn.next_functions[0][0].register_hook(lambda *a: seen.append("node"))) == 0
    assert step(lambda loss: loss.register_hook(lambda g: seen.append("tensor"))) == 0
    assert seen == ["node", "tensor"]
    with torch.autograd.detect_anomaly(check_nan=False):  # anomaly mode: the engine
        assert step() == 0
    with torch.autograd.profiler.profile():  # a recording profiler sees the engine's nodes
        assert step() == 0
    assert step() == 1  # a graph built with no hook since takes the direct path again
    # an input that needs a gradient (adversarial examples, saliency): the engine computes it
    x.requires_grad_()
    for _ in range(3):
        x.grad = None
        assert step() == 0
        assert x.grad is not None and x.grad.shape == x.shape


def test_optimizer_step_wrapper_runs_hooks_and_keeps_torchs_range_under_a_profiler(rt) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 3)  # the fast path is in use
    calls: list[str] = []

    def pre(o, args, kwargs):
        calls.append("pre")
        return args, kwargs  # a pre-hook may hand back new arguments

    pre_handle = opt.register_step_pre_hook(pre)
    post_handle = register_optimizer_step_post_hook(lambda o, a, k: calls.append("post"))
    try:
        spans = len([s for s in rt.recorder.spans if s.kind == "optimizer"])
        _train(model, opt, 1)
        assert calls == ["pre", "post"]
        assert len([s for s in rt.recorder.spans if s.kind == "optimizer"]) == spans + 1  # gpemu's hook ran
        with torch.autograd.profiler.profile() as prof:
            _train(model, opt, 1)
        assert any(e.name == "Optimizer.step#SGD.step" for e in prof.function_events)
        assert calls == ["pre", "post", "pre", "post"]
        opt.register_step_pre_hook(lambda o, a, k: "not a tuple")
        with pytest.raises(RuntimeError, match="must return None or a tuple"):
            _train(model, opt, 1)
    finally:
        pre_handle.remove()
        post_handle.remove()


def test_replayed_forward_loss_and_backward_are_emulator_entries(rt, monkeypatch) -> None:
    """The emulator's own host time in a replayed forward, a replayed loss and the engine-free
    backward is not on the emulated host timeline (gpemu.time.TimeEngine.enter); the program's
    own time between them is."""
    import gpemu.fastpaths.backward as backwardfp
    import gpemu.fastpaths.loss as lossfp
    import gpemu.fastpaths.replay as replayfp

    clock = rt.engine.clock
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.zeros(16, 32, device="cuda"), torch.zeros(16, dtype=torch.long, device="cuda")

    def step():
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(4):
        step()
    assert replayfp.replay_info()["hub"] > 0 and lossfp.loss_info()["replayed"] > 0
    slow = 0.010  # the emulator's own work, made slow

    def slowed(fn):
        def inner(*a, **k):
            clock.advance(slow)
            return fn(*a, **k)

        return inner

    monkeypatch.setattr(replayfp, "_new_outputs", slowed(replayfp._new_outputs))
    monkeypatch.setattr(backwardfp, "replay_backward", slowed(replayfp.replay_backward))
    monkeypatch.setattr(lossfp, "_replayed_backward", slowed(lossfp._replayed_backward))
    torch.cuda.synchronize()
    t0 = rt.engine.now()
    out = model(x)
    assert rt.engine.now() == pytest.approx(t0, abs=1e-12)  # forward: 10 ms of emulator time forgiven
    clock.advance(0.001)  # the program's own time counts
    loss = torch.nn.functional.cross_entropy(out, y)
    assert rt.engine.now() == pytest.approx(t0 + 0.001, abs=1e-12)
    direct = replayfp.replay_info()["direct_backward"]
    loss.backward()
    assert replayfp.replay_info()["direct_backward"] == direct + 1
    assert rt.engine.now() == pytest.approx(t0 + 0.001, abs=1e-12)  # 20 ms in backward forgiven

"""Host-side fast paths: skipped optimizer steps, cached module walks, grouped gradient memory,
forward time from the call's start, settle() after sync waits. Each must fall back correctly."""

from __future__ import annotations

import gc
import weakref

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
    model[0].register_forward_hook(lambda *a: calls.append(1))
    model(x)
    assert calls == [1]  # hooks force the op-by-op path


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


# ----------------------------------------------------------------------------------------------
# gradient wrapper reuse through the fast zero_grad (GradientState.drop_gradients)
# ----------------------------------------------------------------------------------------------
def _conv_net() -> nn.Module:
    # parameters of several shapes and one dtype each: the spares are matched by metadata
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 5)).cuda()


def _step(model: nn.Module, opt: torch.optim.Optimizer, **zero_grad_kwargs) -> None:
    model(torch.zeros(4, 3, 8, 8, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad(**zero_grad_kwargs)


def test_zero_grad_hands_unreferenced_gradients_to_the_next_backward(rt) -> None:
    model = _conv_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mem = rt.memory[0]
    for _ in range(3):
        _step(model, opt)
    x = torch.zeros(4, 3, 8, 8, device="cuda")
    base = mem.allocated
    model(x).sum().backward()
    grads = {p: weakref.ref(p.grad) for p in model.parameters()}
    grad_bytes = mem.allocated - base
    assert grad_bytes >= sum(p.numel() * 4 for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert mem.allocated == base  # the spares' memory is released with the gradients
    assert all(ref() is not None for ref in grads.values())  # ...but the wrappers are kept
    assert ofp.fast_path_info()["zero_grad_fast"] >= 4
    model(x).sum().backward()
    # the same wrappers again (parameters of one shape may swap theirs), each matching its parameter
    assert {id(p.grad) for p in model.parameters()} == {id(ref()) for ref in grads.values()}
    assert model[3].weight.grad is grads[model[3].weight]()  # the only parameter of its shape
    for p in model.parameters():
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype and p.grad.device == p.device
        assert p.grad.data_ptr() != 0 and not p.grad.requires_grad
    assert mem.allocated - base == grad_bytes
    assert gpemu.current().gradients.info()["spares"] == 0


def test_referenced_gradients_are_not_reused(rt) -> None:
    model = _conv_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mem = rt.memory[0]
    for _ in range(3):
        _step(model, opt)
    x = torch.zeros(4, 3, 8, 8, device="cuda")
    model(x).sum().backward()
    w, b, fc = model[0].weight, model[0].bias, model[3].weight
    kept = w.grad  # a Python reference
    view = b.grad.view(-1)  # a view holds its base from C++
    detached = fc.grad.detach()  # shares the memory, not the wrapper
    kept_ptr = kept.data_ptr()
    before = mem.allocated
    opt.zero_grad()
    # the kept gradient and the view's base still hold their memory; the detached copy holds fc's
    held = kept.numel() * 4 + b.numel() * 4 + fc.numel() * 4
    assert mem.allocated >= before - sum(p.numel() * 4 for p in model.parameters()) + held - 2048
    model(x).sum().backward()
    assert w.grad is not kept and kept.data_ptr() == kept_ptr and kept.shape == w.shape
    assert view._base is not b.grad
    assert detached.data_ptr() != fc.grad.data_ptr()  # fc's wrapper was reused with new memory
    del kept, view, detached


def _warm_conv_net(rt) -> tuple:
    """A conv net, its SGD, the device's tracker and an input, after four steps (recording,
    plain backwards, hub mode, a gradient set made and released)."""
    model = _conv_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.zeros(4, 3, 8, 8, device="cuda")
    for _ in range(4):
        _step(model, opt)
    return model, opt, rt.memory[0], x


def _armed_set(model: nn.Module):
    sets = gpemu.current().gradients.live_sets()
    assert len(sets) == 1 and {id(p) for p in sets[0].params} == {id(p) for p in model.parameters()}
    return sets[0]


def test_gradient_set_dropped_and_handed_out_whole(rt) -> None:
    model, opt, mem, x = _warm_conv_net(rt)
    gs = _armed_set(model)
    assert gs.state in ("hidden", "released")  # given back by the last zero_grad, wrappers kept
    base = mem.allocated
    model(x).sum().backward()
    grads = {p: weakref.ref(p.grad) for p in model.parameters()}
    assert gs.state == "armed" and all(p.grad is not None for p in model.parameters())
    grad_bytes = mem.allocated - base
    assert grad_bytes >= sum(p.numel() * 4 for p in model.parameters())
    # all gradients share one group block, taken again with one tracker call
    parents = {p.grad.emu_block.parent for p in model.parameters()}
    assert len(parents) == 1
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert mem.allocated == base  # given back as soon as they were dropped
    assert all(r() is not None for r in grads.values())  # ...but the wrappers are kept
    model(x).sum().backward()
    assert all(p.grad is grads[p]() for p in model.parameters())  # the very same wrappers again
    assert mem.allocated - base == grad_bytes
    assert {p.grad.emu_block.parent for p in model.parameters()} == parents  # the same group, taken again


def test_gradient_set_dropped_another_way_frees_memory_at_once(rt) -> None:
    model, opt, mem, x = _warm_conv_net(rt)
    base = mem.allocated
    model(x).sum().backward()
    old = {p: weakref.ref(p.grad) for p in model.parameters()}
    for p in model.parameters():
        p.grad = None  # a plain loop
    gc.collect()
    assert mem.allocated == base and all(r() is None for r in old.values())
    model(x).sum().backward()  # a new set is made
    assert all(p.grad is not None for p in model.parameters())
    for p in model.parameters():
        p.grad = None
    assert mem.allocated == base
    _step(model, opt)
    assert mem.allocated == base and _armed_set(model).state in ("hidden", "released")


def test_module_zero_grad_gives_a_gradient_set_back_whole(rt) -> None:
    model, opt, mem, x = _warm_conv_net(rt)
    base = mem.allocated
    fast = ofp.fast_path_info()["module_zero_grad_fast"]
    for _ in range(3):  # the accuracy benchmark's loop: model.zero_grad(), no optimizer
        model(x).sum().backward()
        grads = {p: p.grad for p in model.parameters()}
        assert mem.allocated > base
        del grads
        model.zero_grad()
        assert mem.allocated == base and all(p.grad is None for p in model.parameters())
    assert ofp.fast_path_info()["module_zero_grad_fast"] == fast + 3
    assert _armed_set(model).state == "hidden"
    # set_to_none=False: torch's own, zeroing in place (the same gradients)
    model(x).sum().backward()
    before = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=False)
    assert all(g is p.grad for g, p in zip(before, model.parameters(), strict=False))
    assert ofp.fast_path_info()["module_zero_grad_fast"] == fast + 3


def test_gradient_set_with_a_held_gradient_is_given_up(rt) -> None:
    model, opt, mem, x = _warm_conv_net(rt)
    gs = _armed_set(model)
    model(x).sum().backward()
    w = model[0].weight
    kept = w.grad
    opt.zero_grad()
    assert not gs.alive and all(p.grad is None for p in model.parameters())
    # the kept gradient's memory stays allocated (it shares the group's block, as before sets)
    assert mem.allocated >= kept.numel() * 4 and kept.shape == w.shape
    model(x).sum().backward()
    assert w.grad is not kept and all(p.grad is not None for p in model.parameters())
    del kept


def test_gradient_set_accumulates_in_place_and_refuses_marked_gradients(rt) -> None:
    model, opt, mem, x = _warm_conv_net(rt)
    model(x).sum().backward()
    first = {p: p.grad for p in model.parameters()}
    after_one = mem.allocated
    model(x).sum().backward()  # gradient accumulation: same tensors, no new gradient memory
    assert all(p.grad is first[p] for p in model.parameters()) and mem.allocated == after_one
    gs = _armed_set(model)
    del first
    model[3].weight.grad.note = "mine"  # an attribute on a gradient: never handed out again
    opt.zero_grad()
    assert gs.alive and gs.state == "armed"  # not given back (checked before anything changed)...
    assert all(p.grad is None for p in model.parameters())  # ...and dropped one by one instead
    model(x).sum().backward()
    assert not hasattr(model[3].weight.grad, "note")


def test_gradient_set_out_of_memory_at_reuse_changes_nothing(rt) -> None:
    model, opt, mem, x = _warm_conv_net(rt)
    gs = _armed_set(model)
    loss = model(x).sum()
    before = mem.allocated
    hog = torch.empty(mem.capacity - mem.allocated - 1024, dtype=torch.uint8, device="cuda")  # fills the card
    with pytest.raises(torch.cuda.OutOfMemoryError):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert gs.alive and gs.state in ("hidden", "released")  # still given back, wrappers kept for later
    del hog, loss
    assert mem.allocated <= before
    _step(model, opt)  # and training goes on
    assert all(p.grad is None for p in model.parameters())


def test_one_gradient_set_per_parameter_across_batch_sizes(rt) -> None:
    model = _conv_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mem = rt.memory[0]
    for _ in range(3):
        _step(model, opt)  # momentum buffers exist from here on
    base = mem.allocated
    for bs in (2, 4, 2, 4, 4, 2):  # two recordings of the same module
        model(torch.zeros(bs, 3, 8, 8, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        assert mem.allocated == base and all(p.grad is None for p in model.parameters())
    _armed_set(model)


def test_zero_grad_fallbacks_keep_torch_semantics(rt) -> None:
    model = _conv_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        _step(model, opt)
    fast = ofp.fast_path_info()["zero_grad_fast"]
    # set_to_none=False: torch's own loop zeroes the gradients in place (same tensors)
    model(torch.zeros(4, 3, 8, 8, device="cuda")).sum().backward()
    before = [p.grad for p in model.parameters()]
    opt.zero_grad(set_to_none=False)
    assert [p.grad for p in model.parameters()] == before  # identity (list == compares by `is` first)
    assert all(g is p.grad for g, p in zip(before, model.parameters(), strict=False))
    assert ofp.fast_path_info()["zero_grad_fast"] == fast
    del before
    # while the torch profiler records: torch's zero_grad (its record_function range) runs
    with torch.autograd.profiler.profile():
        opt.zero_grad()
    assert ofp.fast_path_info()["zero_grad_fast"] == fast
    assert all(p.grad is None for p in model.parameters())
    # a gradient that requires grad is never made a spare
    model(torch.zeros(4, 3, 8, 8, device="cuda")).sum().backward()
    w = model[0].weight
    w.grad = torch.zeros_like(w).requires_grad_()
    ref = weakref.ref(w.grad)
    opt.zero_grad()
    gc.collect()
    assert ref() is None


def test_zero_grad_with_replay_off_is_torchs() -> None:
    gpemu.patch(gpu="V100", summary=False, replay=False, clock=VirtualClock())
    try:
        model = _conv_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            _step(model, opt)
        assert ofp.fast_path_info()["zero_grad_fast"] == 0
        assert all(p.grad is None for p in model.parameters())
    finally:
        gpemu.unpatch()


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
# hub mode: replays pass one leaf to autograd instead of every parameter (gpemu.fastpaths.replay.Direct)
# ----------------------------------------------------------------------------------------------
def _plain_iterations(model: nn.Module, x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        model(x).sum().backward()
        for p in model.parameters():
            p.grad = None


def test_hub_mode_after_plain_backwards_same_gradients_memory_and_time(rt) -> None:
    model = _conv_net()
    x = torch.zeros(4, 3, 8, 8, device="cuda")
    mem = rt.memory[0]
    _plain_iterations(model, x, 2)  # recorded, then one plain replay
    assert replay.replay_info().get("hub", 0) == 0

    def one() -> tuple:
        mem.reset_peak()
        base = mem.allocated
        out = model(x)
        n_inputs = len(out.grad_fn.next_functions)
        out.sum().backward()
        grads = [(tuple(p.grad.shape), p.grad.dtype, p.grad.device) for p in model.parameters()]
        result = (mem.allocated - base, mem.peak_allocated - base, grads)
        for p in model.parameters():
            p.grad = None
        spans = [sp for sp in rt.recorder.spans if sp.kind in ("forward", "backward")][-2:]
        return result, n_inputs, [(sp.kind, round(sp.end - sp.start, 12)) for sp in spans]

    before, n_full, times_full = one()  # the second plain replay: still every parameter an input
    after, n_hub, times_hub = one()
    assert replay.replay_info()["hub"] == 1
    assert times_hub == times_full and [k for k, _ in times_hub] == ["forward", "backward"]
    assert n_full == 1 + len(list(model.parameters())) and n_hub == 2  # input x + the hub
    assert after == before  # same gradients, same memory and peak
    assert all(p.grad is None for p in model.parameters())


def test_targeted_gradients_through_a_hub_graph(rt) -> None:
    model = _conv_net()
    x = torch.zeros(4, 3, 8, 8, device="cuda", requires_grad=True)
    _plain_iterations(model, x, 4)
    hub_before = replay.replay_info().get("hub", 0)
    assert hub_before >= 1
    w, fc = model[0].weight, model[3].weight
    # torch.autograd.grad naming parameters: placeholders of their metadata; .grad untouched
    loss = model(x).sum()
    assert replay.replay_info()["hub"] == hub_before + 1
    gw, gx = torch.autograd.grad(loss, [w, x])
    assert gw.shape == w.shape and gw.device == w.device and gx.shape == x.shape
    assert all(p.grad is None for p in model.parameters())
    # after that, hub mode is off for the run: every parameter is an autograd input again
    loss = model(x).sum()
    assert replay.replay_info()["hub"] == hub_before + 1
    (gfc,) = torch.autograd.grad(loss, fc)
    assert gfc.shape == fc.shape


def test_backward_inputs_through_a_hub_graph_sets_only_those(rt) -> None:
    model = _conv_net()
    x = torch.zeros(4, 3, 8, 8, device="cuda")
    _plain_iterations(model, x, 4)
    assert replay.replay_info().get("hub", 0) >= 1
    loss = model(x).sum()
    loss.backward(inputs=[model[3].weight])
    assert [p.grad is not None for p in model.parameters()] == [False, False, False, False, True, False]
    assert model[3].weight.grad.shape == model[3].weight.shape


def test_input_gradient_through_a_hub_graph_leaves_parameters_alone(rt) -> None:
    model = _conv_net()
    x = torch.zeros(4, 3, 8, 8, device="cuda", requires_grad=True)
    _plain_iterations(model, x, 4)
    hub = replay.replay_info()["hub"]
    x.grad = None
    loss = model(x).sum()
    assert replay.replay_info()["hub"] == hub + 1
    (gx,) = torch.autograd.grad(loss, x)  # a gradient penalty's call: x only
    assert gx.shape == x.shape
    assert all(p.grad is None for p in model.parameters())
    # the recording leaves hub mode; plain backward still sets every gradient
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_targeted_forms_through_a_hub_graph(rt) -> None:
    """Named (dict) inputs, GradientEdge roots and positional ``inputs`` reach the same answer."""
    from torch.autograd.graph import get_gradient_edge

    model = _conv_net()
    x = torch.zeros(4, 3, 8, 8, device="cuda", requires_grad=True)
    w = model[0].weight
    _plain_iterations(model, x, 4)
    out = model(x).sum()
    named = torch.autograd.grad(out, {"w": w, "x": x})
    assert set(named) == {"w", "x"} and named["w"].shape == w.shape and named["x"].shape == x.shape
    gpemu.unpatch()
    gpemu.patch(gpu="V100", summary=False, clock=VirtualClock())
    model = _conv_net()
    x = torch.zeros(4, 3, 8, 8, device="cuda")
    _plain_iterations(model, x, 4)
    out = model(x).sum()
    torch.autograd.backward(get_gradient_edge(out), torch.ones(()), None, False, None, [model[3].weight])
    assert [p.grad is not None for p in model.parameters()] == [False, False, False, False, True, False]


def test_hub_mode_gradient_accumulation_and_reuse_together(rt) -> None:
    model = _conv_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.zeros(4, 3, 8, 8, device="cuda")
    mem = rt.memory[0]
    for _ in range(4):
        _step(model, opt)  # zero_grad(set_to_none=True) each time: spares + hub mode
    hub = replay.replay_info()["hub"]
    assert hub >= 1
    model(x).sum().backward()
    grads = [p.grad for p in model.parameters()]
    after_first = mem.allocated
    model(x).sum().backward()  # accumulation: same gradient tensors, no new memory
    assert replay.replay_info()["hub"] == hub + 2
    assert all(g is p.grad for g, p in zip(grads, model.parameters(), strict=False))
    assert mem.allocated == after_first
    del grads
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_implicit_loss_gradient_costs_what_ones_like_costs(rt) -> None:
    engine = rt.engine
    w = torch.empty(1000, device="cuda", requires_grad=True)

    def step(explicit: bool) -> tuple[float, int]:
        w.grad = None
        torch.cuda.synchronize()
        t0 = engine.now()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = (w * 2.0).sum()
        loss.backward(torch.ones_like(loss) if explicit else None)
        torch.cuda.synchronize()
        return engine.now() - t0, torch.cuda.max_memory_allocated() - base

    reference = step(True)
    runs = [step(False) for _ in range(3)]
    assert gpemu.current().replay.implicit  # the shortcut learned the loss's implicit gradient
    for seconds, peak in runs:
        assert seconds == pytest.approx(reference[0], rel=1e-9) and peak == reference[1]
    assert w.grad is not None and w.grad.shape == w.shape


# ----------------------------------------------------------------------------------------------
# loss.backward() without the autograd engine (gpemu.fastpaths.backward._direct_backward)
# ----------------------------------------------------------------------------------------------
def _classifier_steps(rt, n: int, direct: bool, before_backward=None) -> dict:
    """n training steps of a small classifier; GPU spans (kind, duration, start offset), memory
    and gradient metadata of the last one."""
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
            loss = nn.functional.cross_entropy(model(x), y)
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

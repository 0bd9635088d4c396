"""Value mode (``values="real"``): emulated tensors carry their real values, computed on the CPU,
so programs that branch on values behave as on a GPU; emulated times and memory are those of a
run with placeholder values."""

from __future__ import annotations

import math

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.config import ConfigError, EmuConfig
from gpemu.device.values import HostMemoryRefused, available_host_bytes


@pytest.fixture
def real():
    r = gpemu.patch(gpu="A100", summary=False, values="real", clock=VirtualClock())
    yield r
    gpemu.unpatch()


def _data(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.05 * torch.randn(64, 1, generator=g)
    return x.to(device), y.to(device)


def _train(device: str, tmp_path, epochs: int = 60, patience: int = 3) -> tuple[list[float], int, bool]:
    """A loop that checkpoints on its best loss and stops early once the loss stops improving
    (or is small): (losses, epochs run, checkpoint written)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = _data(device)
    best, stale, losses = math.inf, 0, []
    path = tmp_path / f"best-{device}.pt"
    for _ in range(epochs):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        value = loss.item()
        losses.append(value)
        if value < best - 1e-4:
            best, stale = value, 0
            torch.save(model.state_dict(), path)
        else:
            stale += 1
        if stale >= patience or value < 0.01:
            break
    return losses, len(losses), path.exists()


@pytest.mark.slow
def test_a_training_loop_sees_its_loss_fall_checkpoints_and_stops_early(real, tmp_path):
    losses, epochs, saved = _train("cuda", tmp_path)
    assert saved and losses[-1] < 0.2 * losses[0]  # (placeholders: every loss 0.0, nothing saved)
    assert epochs < 60  # stopped early on its own values
    gpemu.unpatch()
    cpu_losses, cpu_epochs, _ = _train("cpu", tmp_path)
    # The same script on the CPU: the same values (one generator seeds both) and the same stop.
    assert losses[0] == pytest.approx(cpu_losses[0], rel=1e-5)
    assert losses[-1] == pytest.approx(cpu_losses[-1], rel=1e-2) and epochs == cpu_epochs
    state = torch.load(tmp_path / "best-cuda.pt", map_location="cpu")
    assert all(torch.count_nonzero(v) > 0 for v in state.values())  # real weights were saved


def test_grad_scaler_skips_steps_that_overflow_and_backs_off(real):
    torch.manual_seed(0)  # (how many back-offs the gradients need depends on the data: the same data each run)
    model = torch.nn.Linear(16, 16).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40, growth_interval=1000)
    x = torch.randn(32, 16, device="cuda")
    before = model.weight.detach().cpu()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()  # fp16 gradients at 2**40 overflow
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model.weight.detach().cpu(), before)  # the step was skipped
    assert scaler.get_scale() == 2.0**39  # backed off
    for _ in range(30):  # until the scale fits: steps are taken again
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() < 2.0**20 and not torch.equal(model.weight.detach().cpu(), before)


def test_random_ops_follow_the_programs_cuda_seed_and_leave_the_cpu_generator(real):
    torch.manual_seed(7)
    cpu_draw = torch.rand(3)
    torch.manual_seed(7)
    a = torch.randn(1000, device="cuda")
    d = torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5)
    assert torch.equal(torch.rand(3), cpu_draw)  # the program's CPU stream is its own
    assert 0.8 < a.std().item() < 1.2 and 300 < int((d == 0).sum().item()) < 700
    torch.cuda.manual_seed(7)
    assert torch.equal(torch.randn(1000, device="cuda").cpu(), a.cpu())  # reseeding repeats
    state = torch.cuda.get_rng_state()
    b = torch.rand(10, device="cuda").cpu()
    torch.cuda.set_rng_state(state)  # (activation checkpointing's recomputation)
    assert torch.equal(torch.rand(10, device="cuda").cpu(), b)


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_attention_values_and_gradients_match_the_cpu(real, autocast):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 32)
    qe = q.cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = torch.nn.functional.scaled_dot_product_attention(qe, qe, qe, is_causal=True)
    out.float().pow(2).sum().backward()
    qr = q.clone().requires_grad_(True)
    ref = torch.nn.functional.scaled_dot_product_attention(qr, qr, qr, is_causal=True)
    ref.pow(2).sum().backward()
    tol = 5e-2 if autocast else 1e-4
    assert torch.allclose(out.float().cpu(), ref.detach(), atol=tol)
    assert torch.allclose(qe.grad.cpu(), qr.grad, atol=tol * 10)


def _gpu_seconds(values: str) -> tuple[float, float]:
    rt = gpemu.patch(gpu="A100", summary=False, values=values, clock=VirtualClock(), replay=False)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x, y = torch.randn(128, 64, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
        for _ in range(6):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        torch.cuda.synchronize()
        busy = sum(s.end - s.start for s in rt.recorder.spans)
        return busy, rt.memory[0].peak_allocated
    finally:
        gpemu.unpatch()


def test_emulated_gpu_time_and_memory_are_those_of_placeholder_values():
    # Real values step aside from the fast paths (replays, the fused loss, skipped optimizer
    # steps) and run every op, as placeholders do without them: the GPU is charged the same.
    busy_p, peak_p = _gpu_seconds("placeholders")
    busy_r, peak_r = _gpu_seconds("real")
    assert busy_r == pytest.approx(busy_p, rel=0.01)
    assert peak_r == peak_p


def test_a_run_whose_values_outgrow_the_host_is_refused_with_one_line():
    available = available_host_bytes()
    if available is None or available > 100 * 2**30:
        pytest.skip("needs a host with less available memory than an H200 (141 GB) and /proc/meminfo")
    gpemu.patch(gpu="H200", summary=False, values="real", clock=VirtualClock())
    with pytest.raises(HostMemoryRefused) as refused:
        torch.empty(available, dtype=torch.uint8, device="cuda")  # fits the GPU, not the host
    message = str(refused.value)
    assert "\n" not in message and "--values placeholders" in message and "GiB" in message


def test_the_setting_implies_virtual_time_and_refuses_bad_values():
    assert EmuConfig(values="real").virtual_time  # what the script's clocks print is emulated time
    assert not EmuConfig(values="real", clock="real").virtual_time  # unless asked otherwise
    assert not EmuConfig().real_values and EmuConfig().fast_paths
    assert not EmuConfig(values="real").fast_paths
    assert EmuConfig.from_env({"GPEMU_VALUES": "Real"}).real_values
    with pytest.raises(ConfigError, match="values must be one of placeholders, real"):
        EmuConfig(values="exact")


def _step_times(values: str, replay: bool = True) -> list[float]:
    """Emulated seconds of each step of a loop that syncs every step (``loss.item()``), on virtual
    time (what a script's own clock reads there), a K80 so the GPU sets the pace."""
    rt = gpemu.patch(gpu="K80", summary=False, values=values, clock="virtual", replay=replay)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x, y = torch.randn(2048, 256, device="cuda"), torch.randint(0, 10, (2048,), device="cuda")
        times = []
        for _ in range(8):
            t = rt.engine.now()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            loss.item()
            times.append(rt.engine.now() - t)
        return times[3:]
    finally:
        gpemu.unpatch()


@pytest.mark.slow
def test_a_value_run_prints_the_step_times_of_placeholder_values():
    # Each value step computes its values on the CPU, longer than the emulated GPU's step: that
    # time was forgiven inside the ops, then counted again at every sync (the host re-aligned on
    # the CPU clock), and the module call, backward and zero_grad the fast paths run as the
    # emulator's own work counted as the program's (before: 500 ms against 62 on a K80).
    placeholders, real = _step_times("placeholders"), _step_times("real")
    assert sorted(real)[2] == pytest.approx(sorted(placeholders)[2], rel=0.02)  # (measured: +0.6-0.8%)


def test_on_virtual_time_work_forgiven_before_a_sync_stays_forgiven():
    rt = gpemu.patch(gpu="A100", summary=False, clock="virtual")
    try:
        engine = rt.engine
        stream = engine.stream(0)
        t0 = engine.now()
        engine.enter()
        engine.clock.advance(0.040)  # 40 ms of the emulator's own work (a value run's CPU compute)
        engine.leave()
        stream.enqueue(0.010, "op", "10 ms of GPU work")
        stream.synchronize()  # the GPU's work ends before the clock's reading: still 10 ms for the host
        assert engine.now() - t0 == pytest.approx(0.010, abs=0.002)
        t1 = engine.now()
        stream.enqueue(0.020, "op", "20 ms of GPU work")
        stream.synchronize()
        assert engine.now() - t1 == pytest.approx(0.020, abs=0.002)
    finally:
        gpemu.unpatch()

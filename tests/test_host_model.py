"""The modelled host (gpemu.time.launch): framework issue time per op, the bounded launch queue,
replays charging the host time of the ops they stand for (issue 29)."""

from __future__ import annotations

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.config import ConfigError, EmuConfig
from gpemu.time.launch import (
    DRIVER_LAUNCH_S,
    HOST_PRESETS,
    LAUNCH_QUEUE_DEPTH,
    host_model,
    probe_dispatch_seconds,
    reference_loop_ms,
)

XEON = HOST_PRESETS["h100-xeon"].op_s
XEON_BACKWARD = HOST_PRESETS["h100-xeon"].backward_op_s or XEON  # (an op of a backward pass)


def _run(host: str, **kw):
    # (a manual clock: the program's own Python time does not move it, only modelled time and waits)
    return gpemu.emulate(gpu="A100", clock=VirtualClock(), summary=False, host=host, **kw)


def test_host_setting_forms_and_one_line_errors():
    assert EmuConfig.from_env({}).host == "none" and host_model(None) is None  # (GPU time only by default)
    assert EmuConfig.from_env({"GPEMU_HOST": " H100-Xeon "}).host == "h100-xeon"
    assert EmuConfig.from_env({}, host="0.5x").to_env()["GPEMU_HOST"] == "0.5x"
    for bad in ("0x", "fast!", "1000x", "nan"):
        with pytest.raises(ConfigError, match="host must be 'this'"):
            EmuConfig.from_env({}, host=bad)
    with pytest.raises(ValueError, match="h100-xeon"):
        host_model("no-such-host")
    assert host_model("none") is None


def test_speed_scales_this_machines_probe(tmp_path):
    this, twice = host_model("this", tmp_path), host_model("2x", tmp_path)
    assert this is not None and twice is not None
    assert this.launch_s == DRIVER_LAUNCH_S and this.queue_depth == LAUNCH_QUEUE_DEPTH
    assert twice.op_s == pytest.approx(this.op_s / 2)
    # measured once, then read back from the cache
    assert (tmp_path / "host-probe.json").exists()
    probed = probe_dispatch_seconds(tmp_path)
    assert 1e-8 < probed < this.dispatch_s < 1e-3  # (the probe, and what the CUDA build adds to it)


def test_this_machine_at_the_h100_hosts_speed_reads_that_hosts_issue_time(tmp_path):
    # The issue's first check: this machine's model, carried to the speed of the H100's host by
    # the reference loops, lands near what eager PyTorch spent per op there (40 us).
    this = host_model("this", tmp_path)
    assert this is not None
    xeon = HOST_PRESETS["h100-xeon"]
    there = this.op_s * xeon.reference_ms / reference_loop_ms(tmp_path)
    assert 0.7 * xeon.op_s < there < 1.3 * xeon.op_s


def test_each_op_costs_the_host_its_issue_time_and_starts_after_its_launch():
    with _run("h100-xeon") as rt:
        eng = rt.engine
        x = torch.ones(64, 64, device="cuda")
        torch.cuda.synchronize()
        t0 = eng.now()
        for _ in range(100):
            x = x + 1
        assert eng.now() - t0 == pytest.approx(100 * XEON)
        spans = [s for s in rt.recorder.spans if s[2] == "op"][-100:]
        # each kernel (a few us) waits for its launch: the GPU idles between them, launch-bound
        for i, span in enumerate(spans):
            assert span[4] == pytest.approx(t0 + (i + 1) * XEON)
    with _run("none") as rt:
        x = torch.ones(64, 64, device="cuda")
        t0 = rt.engine.now()
        for _ in range(100):
            x = x + 1
        assert rt.engine.now() == t0  # GPU time only: the host runs ahead without cost


def test_a_full_launch_queue_blocks_the_host():
    n = 3000
    with _run("h100-xeon") as rt:
        eng = rt.engine
        x = torch.ones(2048, 2048, device="cuda")
        torch.cuda.synchronize()
        y = x @ x
        kernel = rt.recorder.spans[-1][5] - rt.recorder.spans[-1][4]
        assert kernel > 10 * XEON  # (long kernels: the queue fills)
        torch.cuda.synchronize()
        t0 = eng.now()
        for _ in range(n):
            y = x @ x
        issued = eng.now() - t0
        waits = [w for w in rt.recorder.waits if w[1] == "launch-queue"]
        torch.cuda.synchronize()
        drained = eng.now() - t0 - issued
    # the host issued LAUNCH_QUEUE_DEPTH launches without waiting (the kernels that ended
    # meanwhile freed their entries), then waited for a kernel's end before each launch: the
    # host ran at the GPU's pace, and the final sync waited for one full queue
    done_meanwhile = int(LAUNCH_QUEUE_DEPTH * XEON / kernel)
    assert abs(len(waits) - (n - LAUNCH_QUEUE_DEPTH - done_meanwhile)) <= 2
    assert issued + drained == pytest.approx(n * kernel + XEON, rel=1e-3)
    assert drained == pytest.approx(LAUNCH_QUEUE_DEPTH * kernel, rel=1e-2)
    assert y.shape == (2048, 2048)


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _step_issue_times(replay: bool) -> tuple[list[float], int]:
    """Host time of four forward+backward calls of a small MLP, and how many calls ran op by op."""
    with _run("h100-xeon", replay=replay) as rt:
        eng = rt.engine
        model = _Mlp().cuda()
        x = torch.ones(16, 64, device="cuda")
        issue = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = eng.now()
            model(x).sum().backward()
            issue.append(eng.now() - t0)
            model.zero_grad()  # (set to None: no accumulation kernels in the next step)
        return issue, rt.model_time.stats["op_by_op"]


def test_a_replayed_step_costs_the_host_what_the_op_by_op_step_did():
    replayed, recorded_calls = _step_issue_times(replay=True)
    op_by_op, all_calls = _step_issue_times(replay=False)
    assert recorded_calls < all_calls == 4  # (the replays did replay)
    # every op of the forward and backward (3 linears, 2 ReLUs, their gradients) costs the host
    # an issue time, on the recording call and on every replay alike
    assert op_by_op[0] >= 10 * XEON
    for a, b in zip(replayed, op_by_op, strict=True):
        assert a == pytest.approx(b, rel=0.02)


def test_gpemu_run_refuses_an_unknown_host_in_one_line(capsys):
    from gpemu.cli import main

    rc = main(["run", "--host", "fastest", "--", "python", "-c", "pass"])  # (refused before it starts)
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "h100-xeon" in err[0] and "Traceback" not in err[0]


def test_multi_tensor_launches_chunk_as_torch_does():
    from gpemu.costs import multi_tensor_launches

    assert multi_tensor_launches([4] * 64, 2) == 1
    assert multi_tensor_launches([4] * 200, 2) == 4  # 64 tensors per launch with two lists
    assert multi_tensor_launches([4] * 200, 4) == 6  # 36 with four (fused Adam)
    assert multi_tensor_launches([320 * 65536 * 2], 1) == 2  # 320 blocks of 65,536 per launch
    assert multi_tensor_launches([], 2) == 1


def _step_seconds(make) -> float:
    """Emulated time of the third step of an optimizer over 300 small parameters."""
    with _run("this") as rt:
        params = [torch.nn.Parameter(torch.empty(256, device="cuda")) for _ in range(300)]
        opt = make(params)
        for _ in range(3):
            for p in params:
                p.grad = torch.zeros_like(p)
            torch.cuda.synchronize()
            t0 = rt.engine.now()
            opt.step()
            torch.cuda.synchronize()
            took = rt.engine.now() - t0
        traffic = 300 * 256 * 4 * 8 / rt.gpus[0].memory_bandwidth
    assert took > 20 * traffic  # launch-bound: the host, not the memory traffic
    return took


def test_many_small_tensors_step_at_the_hosts_pace_per_tensor_foreach_fused():
    per_tensor = _step_seconds(lambda ps: torch.optim.AdamW(ps, foreach=False))
    foreach = _step_seconds(lambda ps: torch.optim.AdamW(ps))
    fused = _step_seconds(lambda ps: torch.optim.AdamW(ps, fused=True))
    # per tensor: a call and a launch per pass and tensor; foreach: a call per pass and a launch
    # per 64 tensors; fused: one call
    assert per_tensor > 1.3 * foreach > 1.3 * fused


def test_the_emulators_set_up_is_forgiven_however_long_it_takes():
    """A CUDA event around a first call must not read the emulator's one-time set-up (database
    look-ups, recording a measured loop: 0.7-1.2 s on a busy host). On the real clock an ordinary
    emulator entry is forgiven at most MAX_FORGIVEN_WORK (longer: the OS held the process); set-up,
    nested in an entry or not, is forgiven whole."""
    import time

    from gpemu.time.host import MAX_FORGIVEN_WORK

    with gpemu.emulate(gpu="A100", summary=False) as rt:  # the real clock
        eng = rt.engine
        t0 = eng.now()
        eng.setup_call(time.sleep, 0.15)
        eng.call(eng.setup_call, time.sleep, 0.15)
        setup = eng.now() - t0
        t1 = eng.now()
        eng.call(time.sleep, 0.15)
        plain = eng.now() - t1
    assert setup < 0.02, setup
    assert plain > 0.15 - MAX_FORGIVEN_WORK - 0.01, plain


def _busy_and_steps(host: str, replay: bool, zero: bool = True) -> tuple[list[float], list[float]]:
    """GPU busy time (the spans' durations) and the time of each of four forward+backward steps
    of the small MLP (``zero=False``: into gradients never zeroed)."""
    with _run(host, replay=replay) as rt:
        eng = rt.engine
        model = _Mlp().cuda()
        x = torch.ones(16, 64, device="cuda")
        busy, steps = [], []
        for _ in range(4):
            torch.cuda.synchronize()
            first, t0 = len(rt.recorder.spans), eng.now()
            model(x).sum().backward()
            torch.cuda.synchronize()
            steps.append(eng.now() - t0)
            busy.append(sum(s[5] - s[4] for s in rt.recorder.spans[first:]))
            if zero:
                model.zero_grad()
        return busy, steps


def test_with_a_modelled_host_the_gpu_runs_kernels_only_and_a_small_model_is_host_bound():
    """The host term's meaning (issue 29): a modelled host pays the issue time, the GPU's prices
    are its kernels. Replayed steps (charged as one pass each way) keep the GPU busy exactly as
    long as the op-by-op step's kernels; the launch-bound MLP's step is the host's issue time."""
    kernels, by_ops = _busy_and_steps("h100-xeon", replay=False)
    busy, replayed = _busy_and_steps("h100-xeon", replay=True)
    for a, b in zip(busy, kernels, strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    for a, b in zip(replayed, by_ops, strict=True):
        assert a == pytest.approx(b, rel=0.02)
    assert kernels[-1] < 0.5 * by_ops[-1]  # host-bound: the GPU idles more than half the step
    assert by_ops[-1] >= 10 * XEON  # (each op's issue time, forward and backward)
    # with no host model, the calibration hosts' issue gaps are priced in the replayed passes
    # (the cost model's fitted per-op host term: docs/time.md), so the GPU is busy longer
    none_busy, _ = _busy_and_steps("none", replay=True)
    assert none_busy[-1] > 2 * kernels[-1]


def test_a_replayed_backward_accumulating_into_gradients_charges_their_kernels_and_launches():
    # (gradient accumulation over micro-batches, or a loop that never zeroes: autograd adds each
    # new gradient into the parameter's, one kernel and one launch per parameter)
    by_ops_busy, by_ops = _busy_and_steps("h100-xeon", replay=False, zero=False)
    busy, replayed = _busy_and_steps("h100-xeon", replay=True, zero=False)
    assert by_ops_busy[1] > by_ops_busy[0]  # (the first backward made the gradients: no adds)
    assert by_ops[1] >= by_ops[0] + 6 * XEON_BACKWARD  # six parameters' adds, each issued by the host
    for a, b in zip(busy, by_ops_busy, strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    for a, b in zip(replayed, by_ops, strict=True):
        assert a == pytest.approx(b, rel=0.02)


def test_a_backward_passs_ops_cost_the_hosts_backward_figure():
    """A backward pass's ops cost the preset's backward figure (its host-bound backwards: 37-58 us
    per op against 40-49 per forward op, gpemu.time.launch), not the forward's."""
    assert XEON_BACKWARD != XEON
    with _run("h100-xeon") as rt:
        eng = rt.engine
        w = torch.ones(64, 64, device="cuda", requires_grad=True)
        y = (w * 2).sum()
        t0 = eng.now()
        y.backward()
        # the seed gradient (ones_like, made before the engine runs) and the multiplication's
        # gradient (the sum's is a view: no kernel)
        assert eng.now() - t0 == pytest.approx(XEON + XEON_BACKWARD, rel=0.02)
        t0 = eng.now()
        for _ in range(10):
            w.detach().add_(1)
        assert eng.now() - t0 == pytest.approx(10 * XEON)


@pytest.mark.slow  # (~10 s: 2,460 launches op by op on a busy host)
def test_replayed_passes_take_their_launches_places_in_the_queue():
    """A replayed forward stands for all its kernels' launches: un-synced replayed steps fill the
    1,024-launch queue as the op-by-op ones do, so the host cannot run ahead of the GPU by more
    than a queue's worth of work (nanoGPT's printed iteration time between its syncs)."""

    def host_ahead(replay: bool) -> float:
        with _run("this", replay=replay) as rt:
            eng = rt.engine
            layers: list[torch.nn.Module] = []
            for _ in range(20):  # (GPU-bound: large GEMMs, 41 launches a forward)
                layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
            model = torch.nn.Sequential(*layers).cuda()
            x = torch.ones(1024, 1024, device="cuda")
            with torch.no_grad():
                model(x)
                torch.cuda.synchronize()
                t0 = eng.now()
                for _ in range(60):  # 2,460 launches, no sync
                    model(x)
                issued = eng.now() - t0
                torch.cuda.synchronize()
            return issued / (eng.now() - t0)

    by_ops, replayed = host_ahead(False), host_ahead(True)
    assert by_ops > 0.4  # the queue held the host back (unbounded: its issue time, ~0.1 of the GPU's)
    assert replayed == pytest.approx(by_ops, abs=0.05)

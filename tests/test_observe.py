"""Summary accounting (busy / data stall / other idle), metrics JSON, end-of-run hooks."""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import gpemu
from gpemu import observe, run_outputs
from gpemu.clock import VirtualClock
from gpemu.observe import RunRecords, Timeline, compute_summary, format_summary, iteration_breakdown
from gpemu.recorder import GpuSpan, Recorder
from gpemu.time import EmuEvent, TimeEngine

START = 100.0
FWD, BWD, H2D, OPT = 0.1, 0.2, 0.01, 0.01
HOST_BETWEEN = 0.002  # host time between forward and backward enqueues (GPU still busy: no stall)


def scripted_run(stalls: list[float]) -> tuple[RunRecords, Recorder]:
    """One device; before iteration i the host spends stalls[i] s 'fetching data' (GPU idle)."""
    clock = VirtualClock(start=START)
    rec = Recorder(started_at=START)
    eng = TimeEngine(1, rec, clock=clock)
    s = eng.default_stream(0)
    for stall in stalls:
        clock.advance(stall)
        s.enqueue(H2D, "transfer", "h2d pinned")
        s.enqueue(FWD, "forward", "net")
        clock.advance(HOST_BETWEEN)
        s.enqueue(BWD, "backward", "net")
        s.enqueue(OPT, "optimizer", "SGD")
        eng.end_iteration(0)
        eng.synchronize(0, "item")
        rec.memory_sample(0, clock.now(), 1000, 2 << 20)
    return RunRecords(
        gpus=["V100"],
        spans=rec.spans,
        waits=rec.waits,
        memory=rec.memory,
        iterations=rec.iterations,
        counters=rec.counters,
        started_at=START,
        ended_at=clock.now(),
    ), rec


def adds_up(win: dict) -> None:
    assert win["busy_s"] + win["data_stall_s"] + win["other_idle_s"] == pytest.approx(win["wall_s"], abs=1e-9)
    assert win["idle_s"] == pytest.approx(win["data_stall_s"] + win["other_idle_s"], abs=1e-12)
    assert win["utilisation"] == pytest.approx(win["busy_s"] / win["wall_s"])


def test_known_stalls_are_accounted_exactly():
    stalls = [0.5, 0.05, 0.0, 0.3, 0.1]
    records, rec = scripted_run(stalls)
    s = compute_summary(records)
    dev = s["devices"][0]
    per_iter = H2D + FWD + BWD + OPT
    n = len(stalls)
    assert dev["iterations"] == n
    whole, steady = dev["whole"], dev["steady"]
    adds_up(whole)
    adds_up(steady)
    # whole run: from the first GPU work (after the first stall) to the end of the last
    assert whole["start_s"] == pytest.approx(stalls[0])
    assert whole["wall_s"] == pytest.approx(n * per_iter + sum(stalls[1:]))
    assert whole["busy_s"] == pytest.approx(n * per_iter)
    assert whole["data_stall_s"] == pytest.approx(sum(stalls[1:]))
    assert whole["other_idle_s"] == pytest.approx(0.0, abs=1e-12)
    # steady state: end of iteration 0 to end of the last; iterations 1.. only
    assert steady["wall_s"] == pytest.approx((n - 1) * per_iter + sum(stalls[1:]))
    assert steady["data_stall_s"] == pytest.approx(sum(stalls[1:]))
    assert dev["au"] == pytest.approx(steady["utilisation"])
    assert dev["au_window"] == "steady"
    # every stall waited for the next input copy
    assert set(steady["stall_before_s"]) == {"transfer"}
    assert steady["busy_by_kind_s"] == pytest.approx(
        {"backward": (n - 1) * BWD, "forward": (n - 1) * FWD, "transfer": (n - 1) * H2D, "optimizer": (n - 1) * OPT}
    )
    # host waited at each .item() from just after enqueueing the backward to the GPU's end
    assert dev["host_waits"]["count"] == n
    assert dev["host_waits"]["by_reason_s"]["item"] == pytest.approx(
        n * (per_iter - H2D - FWD - HOST_BETWEEN + H2D + FWD)
    )
    # iteration times: each is its compute plus its stall
    it = dev["iteration_time"]
    assert it["max_s"] == pytest.approx(per_iter + max(stalls[1:]))
    assert it["min_s"] == pytest.approx(per_iter + min(stalls[1:]))
    # per-iteration breakdown recovers each injected stall
    tl = Timeline(records.spans)
    rows = iteration_breakdown(tl, [m.time for m in rec.iterations])
    assert [r["data_stall_s"] for r in rows[1:]] == pytest.approx(stalls[1:])
    assert [r["busy_s"] for r in rows] == pytest.approx([per_iter] * n)
    for r in rows:
        assert r["busy_s"] + r["data_stall_s"] + r["other_idle_s"] == pytest.approx(r["duration_s"])
    assert s["data_stall_share"] == pytest.approx(sum(stalls[1:]) / steady["wall_s"])


def test_overlapping_streams_count_once_and_dependency_wait_is_not_a_stall():
    clock = VirtualClock(start=START)
    rec = Recorder(started_at=START)
    eng = TimeEngine(2, rec, clock=clock)
    s0 = eng.default_stream(0)
    side = eng.new_stream(0)
    s1 = eng.default_stream(1)
    s0.enqueue(0.5, "forward", "a")  # [100, 100.5]
    side.enqueue(0.3, "transfer", "h2d")  # overlaps on another stream: [100, 100.3]
    s1.enqueue(1.0, "comm", "all_reduce")  # device 1 [100, 101]
    done = EmuEvent(eng)
    done.record(s1)
    s0.wait_event(done)  # device 0 waits on the GPU side for device 1
    s0.enqueue(0.2, "backward", "a")  # enqueued at 100, starts at 101
    clock.advance(1.5)  # host busy: device 0 idle, nothing enqueued
    s0.enqueue(0.1, "optimizer", "SGD")  # [101.5, 101.6]
    records = RunRecords(
        gpus=["V100", "V100"], spans=rec.spans, waits=rec.waits, started_at=START, ended_at=clock.now()
    )
    s = compute_summary(records)
    d0, d1 = s["devices"]
    adds_up(d0["whole"])
    assert d0["whole"]["busy_s"] == pytest.approx(0.5 + 0.2 + 0.1)
    assert d0["whole"]["busy_by_kind_s"]["transfer"] == pytest.approx(0.3)
    assert d0["whole"]["other_idle_s"] == pytest.approx(0.5)  # waiting on device 1's work
    assert d0["whole"]["data_stall_s"] == pytest.approx(0.3)  # host enqueued at 101.5
    assert d0["whole"]["stall_before_s"] == pytest.approx({"optimizer": 0.3})
    assert d1["whole"]["utilisation"] == pytest.approx(1.0)
    assert d1["steady"] is None and d1["iterations"] == 0
    text = format_summary(s)
    assert "GPU 1" in text and "other idle" in text


def test_timeline_partitions_its_span_exactly():
    spans = [
        GpuSpan(0, 0, "forward", "x", 1.0, 2.0, 1.0),
        GpuSpan(0, 0, "backward", "x", 2.5, 3.0, 2.4),
        GpuSpan(0, 1, "op", "y", 2.8, 3.5, 2.0),
        GpuSpan(0, 0, "op", "z", 4.0, 4.5, 3.9),
    ]
    tl = Timeline(spans)
    assert tl.start == 1.0 and tl.end == 4.5
    for (_, a1, *_), (b0, *_) in zip(tl.segments, tl.segments[1:], strict=False):
        assert a1 == pytest.approx(b0)  # contiguous, no overlap
    parts = tl.between(0.0, 10.0)
    assert parts["busy"] == pytest.approx(1.0 + 1.0 + 0.5)
    assert parts["data_stall"] == pytest.approx(0.4 + 0.4)  # 2.0-2.4 and 3.5-3.9
    assert parts["other_idle"] == pytest.approx(0.1 + 0.1)  # 2.4-2.5 and 3.9-4.0
    assert tl.between(1.5, 2.45) == pytest.approx({"busy": 0.5, "data_stall": 0.4, "other_idle": 0.05})


def test_no_work_gives_empty_but_valid_summary():
    s = compute_summary(RunRecords(gpus=["A100"], started_at=0.0, ended_at=1.0))
    assert s["devices"][0]["whole"] is None and s["au"] == 0.0
    assert "no GPU work recorded" in format_summary(s)
    json.dumps(s)


def test_patched_run_with_host_sleeps(tmp_path):
    """A real (tiny) training loop under gpemu.patch with a known host-side fetch delay."""
    rt = gpemu.patch(gpu="V100", model="resnet50", summary=False)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x0, y0 = torch.randn(32, 3, 8, 8), torch.randint(0, 10, (32,))
    fetch = 0.04
    n = 5
    for _ in range(n):
        time.sleep(fetch)  # the "data loader"
        x, y = x0.cuda(), y0.cuda()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
    s = observe.summary()
    dev = s["devices"][0]
    assert dev["iterations"] == n
    for win in (dev["whole"], dev["steady"]):
        adds_up(win)
    steady = dev["steady"]
    assert steady["data_stall_s"] >= 0.9 * (n - 1) * fetch
    assert max(steady["stall_before_s"], key=steady["stall_before_s"].get) == "transfer"
    assert steady["busy_by_kind_s"]["forward"] > 0 and steady["busy_by_kind_s"]["backward"] > 0
    assert dev["memory"]["peak_allocated_bytes"] == torch.cuda.max_memory_allocated(0)
    assert 0 < dev["memory"]["persistent_bytes"] <= dev["memory"]["peak_allocated_bytes"]
    assert dev["memory"]["capacity_bytes"] == rt.gpus[0].memory_bytes
    assert s["transfers"]["h2d_copies"] == 2 * n
    assert s["transfers"]["h2d_bytes"] >= n * (x0.numel() * 4 + y0.numel() * 8)
    # metrics file of the same summary is plain JSON
    path = run_outputs.write_metrics(s, tmp_path / "sub" / "m.json")
    assert json.loads(path.read_text())["devices"][0]["iterations"] == n


def test_unpatch_unregisters_the_exit_hook(monkeypatch):
    calls = []
    monkeypatch.setattr(run_outputs, "finish", lambda rt: calls.append(rt))
    rt = gpemu.patch(gpu="V100", summary=False)
    hook = rt.at_exit
    gpemu.unpatch()
    # atexit.unregister removed it: running all remaining exit callbacks now would not call it,
    # so check through the public count instead of running them.
    before = atexit._ncallbacks()
    atexit.unregister(hook)
    assert atexit._ncallbacks() == before
    hook()  # the hook itself still works when called
    assert calls == [rt]


def test_per_rank_path():
    assert run_outputs.per_rank_path("out/m.json", None) == Path("out/m.json")
    assert run_outputs.per_rank_path("out/m.json", 0) == Path("out/m.json")
    assert run_outputs.per_rank_path("out/m.json", 3) == Path("out/m.rank3.json")


def test_summary_needs_a_run():
    with pytest.raises(RuntimeError, match="not patched"):
        observe.summary()


# The console entry point as a user runs it (`gpemu ...`), with this interpreter.
GPEMU = [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main())"]

SCRIPT = textwrap.dedent("""
    import time, torch
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        time.sleep(0.03)
        x, y = torch.randn(16, 3, 8, 8).cuda(), torch.randint(0, 10, (16,)).cuda()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step(); loss.item()
    print("trained on", torch.cuda.get_device_name(0))
""")


@pytest.mark.subprocess
def test_gpemu_run_writes_summary_metrics_and_trace(tmp_path):
    """End to end through `gpemu run`: the unmodified script's exit prints and writes both files."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    metrics, trace = tmp_path / "metrics.json", tmp_path / "trace.json"
    proc = subprocess.run(
        [
            *GPEMU,
            "run",
            "--gpu",
            "A100",
            "--model",
            "resnet50",
            "--metrics",
            str(metrics),
            "--trace",
            str(trace),
            "--",
            "python",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "trained on" in proc.stdout
    assert "gpemu summary: 1 emulated GPU(s)" in proc.stderr
    assert "accelerator utilisation (AU)" in proc.stderr
    m = json.loads(metrics.read_text())
    assert m["format"] == "gpemu-metrics/1" and m["num_gpus"] == 1 and "A100" in m["gpus"][0]
    assert m["iterations"] == 4
    dev = m["devices"][0]
    adds_up(dev["steady"])
    assert dev["steady"]["data_stall_s"] >= 0.9 * 3 * 0.03
    assert 0 < m["au"] < 1
    assert json.loads(trace.read_text())["otherData"]["format"] == "gpemu-trace/1"


def test_finish_respects_no_summary_and_skips_processes_without_work(tmp_path, capsys):
    metrics, trace = tmp_path / "m.json", tmp_path / "t.json"
    rt = gpemu.patch(gpu="V100", summary=False, metrics_path=str(metrics), trace_path=str(trace))
    assert run_outputs.finish(rt) is None  # nothing ran on the GPU: no files (a worker must not clobber them)
    assert not metrics.exists() and not trace.exists()
    rt.engine.default_stream(0).enqueue(0.001, "op", "tiny")
    s = run_outputs.finish(rt)
    err = capsys.readouterr().err
    assert "gpemu summary" not in err and "metrics written" in err
    assert json.loads(metrics.read_text())["devices"][0]["whole"]["busy_s"] == pytest.approx(
        s["devices"][0]["whole"]["busy_s"]
    )
    assert trace.exists()


def test_summary_says_where_each_models_time_came_from(tmp_path):
    """The summary's "model time" line and the metrics' models: a measured model run under bf16
    autocast is scaled for precision (no measurement checks that ratio: no ±); a model the
    database does not know is estimated with the cost model's cross-validated ±."""
    from examples import tvmodels
    from gpemu import trace, trace_reader

    with torch.device("meta"):
        net = tvmodels.resnet18()
    net = net.to_empty(device="cpu")
    with gpemu.emulate(gpu="A100", clock=VirtualClock(), summary=False) as rt:
        measured = net.cuda()
        unknown = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            measured(torch.empty(8, 3, 224, 224).cuda()).float().sum().backward()
        unknown(torch.randn(16, 64).cuda()).sum().backward()
        records = observe.records_from_runtime(rt)
    summary = compute_summary(records)
    by_model = {m["model"]: m for m in summary["models"]}
    assert by_model["resnet18"]["forward"] == by_model["resnet18"]["backward"] == "scaled"
    assert by_model["resnet18"]["scaled_for"] == "precision" and "uncertainty" not in by_model["resnet18"]
    assert by_model["Sequential"]["forward"] == "estimated" and by_model["Sequential"]["uncertainty"].startswith("±")
    text = format_summary(summary)
    assert (
        "model time" in text
        and "resnet18 on A100: scaled (precision)" in text
        and "Sequential on A100: estimated ±" in text
    )
    # a trace keeps them for `gpemu report`
    path = trace.write_trace(records, tmp_path / "trace.json")
    assert trace_reader.load_trace(path).models == records.models

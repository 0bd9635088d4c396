"""`gpemu report`: prints the summary recomputed from a trace, writes a figure."""

from __future__ import annotations

import json

import pytest

from gpemu.cli import main
from gpemu.clock import VirtualClock
from gpemu.observe import RunRecords, compute_summary
from gpemu.recorder import Recorder
from gpemu.time import TimeEngine
from gpemu.trace import write_trace


@pytest.fixture
def trace(tmp_path):
    clock = VirtualClock(start=10.0)
    rec = Recorder(started_at=10.0)
    eng = TimeEngine(1, rec, clock=clock)
    s = eng.default_stream(0)
    for i in range(6):
        clock.advance(0.2 if i % 2 else 0.05)  # alternating slow / fast batches
        s.enqueue(0.01, "transfer", "h2d pinned")
        s.enqueue(0.05, "forward", "net")
        s.enqueue(0.1, "backward", "net")
        s.enqueue(0.01, "optimizer", "SGD")
        eng.end_iteration(0)
        rec.memory_sample(0, clock.now(), 500 << 20, 600 << 20)
        eng.synchronize(0, "item")
        rec.memory_sample(0, clock.now(), 300 << 20, 600 << 20)
    records = RunRecords(
        gpus=["V100"],
        spans=rec.spans,
        waits=rec.waits,
        memory=rec.memory,
        iterations=rec.iterations,
        started_at=10.0,
        ended_at=clock.now(),
    )
    return records, write_trace(records, tmp_path / "trace.json")


def test_report_prints_the_summary(trace, capsys):
    records, path = trace
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "GPU 0 (V100)" in out and "6 iteration(s)" in out
    steady = compute_summary(records)["devices"][0]["steady"]
    assert f"({100 * steady['data_stall_share']:.1f}%)" in out  # the stall share of this run
    assert "transfer" in out


def test_report_json_matches_summary(trace, capsys):
    records, path = trace
    assert main(["report", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = compute_summary(records)
    assert got["devices"][0]["steady"]["data_stall_s"] == pytest.approx(want["devices"][0]["steady"]["data_stall_s"])
    assert got["devices"][0]["memory"]["peak_allocated_bytes"] == 500 << 20


def test_report_writes_a_png(trace, tmp_path, capsys):
    _, path = trace
    png = tmp_path / "fig" / "timeline.png"
    assert main(["report", str(path), "--plot", str(png), "--bins", "40"]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 800 and img.shape[1] > 800  # a paper-sized figure, not an empty canvas
    assert img[..., :3].std() > 0.05


def test_report_bad_input_is_one_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope.json")]) == 2
    assert "no trace file" in capsys.readouterr().err
    other = tmp_path / "chrome.json"
    other.write_text(json.dumps({"traceEvents": []}))
    assert main(["report", str(other)]) == 2
    assert "not a gpemu trace" in capsys.readouterr().err
    assert main(["report", str(other), "--plot", str(tmp_path / "x.jpg")]) == 2


def _scripted_trace(path, stalls, iterations, model_copy=True):
    """A run on a virtual clock: an optional model copy, then ``iterations`` steps, before step i
    the host spends ``stalls[i % len(stalls)]`` s (GPU idle: data stall)."""
    clock = VirtualClock(start=10.0)
    rec = Recorder(started_at=10.0)
    eng = TimeEngine(1, rec, clock=clock)
    s = eng.default_stream(0)
    clock.advance(0.5)
    if model_copy:
        s.enqueue(0.03, "transfer", "model h2d (net, measured)")
        rec.add("model_transfer_bytes", 100 << 20)
    for i in range(iterations):
        clock.advance(stalls[i % len(stalls)])
        s.enqueue(0.001, "transfer", "h2d pinned")
        s.enqueue(0.004, "forward", "net")
        rec.memory_sample(0, clock.now(), 900 << 20, 1 << 30)
        s.enqueue(0.008, "backward", "net")
        s.enqueue(0.001, "optimizer", "SGD")
        eng.end_iteration(0)
        eng.synchronize(0, "item")
        rec.memory_sample(0, clock.now(), 300 << 20, 1 << 30)
    records = RunRecords(
        gpus=["V100"],
        spans=rec.spans,
        waits=rec.waits,
        memory=rec.memory,
        iterations=rec.iterations,
        counters=rec.counters,
        started_at=10.0,
        ended_at=clock.now(),
    )
    return records, write_trace(records, path)


def test_compare_two_traces_side_by_side(tmp_path, capsys):
    _, a = _scripted_trace(tmp_path / "a.json", [0.014], 20)  # stalls as long as the GPU work
    _, b = _scripted_trace(tmp_path / "b.json", [0.0], 30)  # a faster loader: no stall
    assert main(["report", str(a), "--compare", str(b)]) == 0
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.split("│")] for line in out.splitlines() if "│" in line]
    rows = {c[0]: c[1:] for c in cells}
    assert "a.json" in out and "b.json" in out
    assert rows["data stall share"] == ["50.0%", "0.0%", "-50.0 pp"]  # 14 ms stall + 14 ms busy per step, then none
    assert rows["iteration time, mean"] == ["28.00 ms", "14.00 ms", "-50.0%"]
    assert rows["GPU busy / iteration"] == ["14.00 ms", "14.00 ms", "+0.0%"]  # same GPU work per iteration
    assert rows["forward / iteration"] == ["4.00 ms", "4.00 ms", "+0.0%"]
    assert rows["iterations"] == ["20", "30", ""]


def test_compare_json_holds_both(tmp_path, capsys):
    _, a = _scripted_trace(tmp_path / "a.json", [0.01], 5)
    _, b = _scripted_trace(tmp_path / "b.json", [0.0], 5)
    assert main(["report", str(a), "--compare", str(b), "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["a"]["devices"][0]["steady"]["data_stall_s"] == pytest.approx(4 * 0.01)
    assert both["b"]["devices"][0]["steady"]["data_stall_s"] == pytest.approx(0.0, abs=1e-9)


def test_plot_helpers_for_long_runs(tmp_path):
    from gpemu.cli.report_plot import _envelope, _memory_series, _nice_step

    assert [_nice_step(n, 150) for n in (30, 150, 151, 2000)] == [1, 1, 2, 20]
    records, _ = _scripted_trace(tmp_path / "t.json", [0.002], 3)
    ts, alloc, reserved, from_copy = _memory_series(records, 0, 10.5, records.ended_at)
    # memory is drawn from the model copy on (0 before it, the model's bytes after it)
    assert from_copy and alloc[:2] == [0, 100 << 20] and ts[1] == pytest.approx(10.5)
    assert max(alloc) == 900 << 20 and alloc[-1] == 300 << 20
    centres, lo, hi = _envelope([0.0, 1.0, 1.5, 3.0], [1, 5, 2, 7], 0.0, 4.0, 4)
    assert list(lo) == [1, 2, 2, 7] and list(hi) == [1, 5, 2, 7]


@pytest.mark.slow
def test_plot_a_long_run(tmp_path, capsys):
    _, path = _scripted_trace(tmp_path / "long.json", [0.0, 0.002, 0.02], 2000)
    png = tmp_path / "long.png"
    assert main(["report", str(path), "--plot", str(png)]) == 0
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 800 and img.shape[1] > 1000
    assert "2000 iteration(s)" in capsys.readouterr().out


def test_compare_ignores_rounding_noise(tmp_path):
    from gpemu.cli.report_cmd import compare_rows
    from gpemu.trace_reader import load_trace

    _, a = _scripted_trace(tmp_path / "a.json", [0.01], 5)
    sa = compute_summary(load_trace(a))
    sb = json.loads(json.dumps(sa))
    sb["devices"][0]["steady"]["other_idle_s"] = 1e-17  # float noise of a sum of segments
    rows = {r[0]: r[1:] for r in compare_rows(sa, sb)}
    assert rows["other idle / iteration"] == ("0.00 ms", "0.00 ms", "")
    sb["devices"][0]["steady"]["other_idle_s"] = 0.004
    assert compare_rows(sa, sb)[[r[0] for r in compare_rows(sa, sb)].index("other idle / iteration")][3] == "from 0"

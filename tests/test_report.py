"""`gpemu report`: prints the summary recomputed from a trace, writes a figure."""

from __future__ import annotations

import json

import pytest

from gpemu.cli import main
from gpemu.clock import VirtualClock
from gpemu.engine import TimeEngine
from gpemu.observe import RunRecords, compute_summary
from gpemu.recorder import Recorder
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
    records = RunRecords(gpus=["V100"], spans=rec.spans, waits=rec.waits, memory=rec.memory,
                         iterations=rec.iterations, started_at=10.0, ended_at=clock.now())
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

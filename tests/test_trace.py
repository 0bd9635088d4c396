"""The Chrome trace: valid Trace Event Format JSON, and a faithful record of the run."""

from __future__ import annotations

import json

import pytest

from gpemu.clock import VirtualClock
from gpemu.observe import RunRecords, compute_summary
from gpemu.recorder import Recorder
from gpemu.time import TimeEngine
from gpemu.trace import IDLE_TID, TraceError, load_trace, write_trace

START = 50.0


def two_gpu_run() -> RunRecords:
    """Two devices, a side stream on device 0, stalls, host waits, memory samples."""
    clock = VirtualClock(start=START)
    rec = Recorder(started_at=START)
    eng = TimeEngine(2, rec, clock=clock)
    side = eng.new_stream(0)
    for i in range(4):
        clock.advance(0.05 * (i + 1))
        for d in (0, 1):
            s = eng.default_stream(d)
            s.enqueue(0.01, "transfer", "h2d pinned")
            s.enqueue(0.1, "forward", "net")
            s.enqueue(0.2, "backward", "net")
            s.enqueue(0.03, "comm", "all_reduce")
            s.enqueue(0.01, "optimizer", "SGD")
            eng.end_iteration(d)
            rec.memory_sample(d, clock.now(), (i + 1) * 1_000_000 + d, 4 << 20)
        side.enqueue(0.05, "preprocess", "decode")
        eng.synchronize(None, "item")
    return RunRecords(
        gpus=["V100", "A100"],
        spans=rec.spans,
        waits=rec.waits,
        memory=rec.memory,
        iterations=rec.iterations,
        counters={"h2d_bytes": 123.0, "h2d_copies": 8.0},
        notes=["a note"],
        started_at=START,
        ended_at=clock.now(),
        memory_stats=[
            {
                "capacity": 32 << 30,
                "peak_allocated": 5_000_000,
                "peak_reserved": 4 << 20,
                "allocated": 1,
                "reserved": 2,
                "ooms": 1,
            },
            {},
        ],
        config="gpus=[V100,A100]",
    )


@pytest.fixture
def trace_file(tmp_path):
    records = two_gpu_run()
    path = write_trace(records, tmp_path / "trace.json")
    return records, path


def test_trace_is_valid_chrome_trace_json(trace_file):
    records, path = trace_file
    doc = json.loads(path.read_text())
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    for e in events:
        assert e["ph"] in {"M", "X", "i", "C"}
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0 and isinstance(e["cat"], str)
        if e["ph"] == "i":
            assert e["s"] in {"g", "p", "t"}
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values())
    # one process per emulated GPU, named
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {1: "GPU 0 (V100)", 2: "GPU 1 (A100)"}
    # threads: host, one per stream used, idle track
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert (1, "stream 0 (default)") in threads and (2, "stream 0 (default)") in threads
    assert (1, "stream 1") in threads and (2, "stream 1") not in threads
    assert any(name.startswith("host") for _, name in threads)
    # every GPU span is an X event in microseconds on its stream's thread
    spans = [e for e in events if e["ph"] == "X" and "enqueued_us" in e.get("args", {})]
    assert len(spans) == len(records.spans)
    assert {e["cat"] for e in spans} == {"transfer", "forward", "backward", "comm", "optimizer", "preprocess"}
    fwd = next(e for e in spans if e["cat"] == "forward")
    assert fwd["dur"] == pytest.approx(0.1e6)
    assert {e["tid"] for e in spans if e["cat"] == "preprocess"} == {2}
    # iteration boundaries and memory counters per device
    marks = [e for e in events if e["ph"] == "i"]
    assert len(marks) == 8 and {e["pid"] for e in marks} == {1, 2}
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == 8 and counters[0]["name"] == "memory"
    assert set(counters[0]["args"]) == {"allocated_MiB", "reserved_MiB"}
    waits = [e for e in events if e.get("cat") == "host-wait"]
    assert waits and all(e["tid"] == 0 for e in waits)
    stalls = [e for e in events if e.get("tid") == IDLE_TID and e["ph"] == "X"]
    assert stalls and all(e["cat"] in {"data_stall", "other_idle"} for e in stalls)


def test_trace_round_trips_to_the_same_summary(trace_file):
    records, path = trace_file
    original = compute_summary(records)
    loaded = load_trace(path)
    assert len(loaded.spans) == len(records.spans) and len(loaded.waits) == len(records.waits)
    assert [m.allocated for m in loaded.memory] == [m.allocated for m in records.memory]
    again = compute_summary(loaded)
    for d in (0, 1):
        for window in ("whole", "steady"):
            a, b = original["devices"][d][window], again["devices"][d][window]
            for key in ("wall_s", "busy_s", "data_stall_s", "other_idle_s", "start_s"):
                assert b[key] == pytest.approx(a[key], abs=1e-6), (d, window, key)
        assert again["devices"][d]["iterations"] == 4
        assert again["devices"][d]["memory"] == original["devices"][d]["memory"]
    assert again["transfers"] == original["transfers"]
    assert again["notes"] == ["a note"] and again["run_s"] == pytest.approx(original["run_s"], abs=1e-6)
    assert json.loads(path.read_text())["otherData"]["summary"]["devices"][0]["iterations"] == 4


def test_load_trace_rejects_other_files(tmp_path):
    with pytest.raises(TraceError, match="no trace file"):
        load_trace(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="not JSON"):
        load_trace(bad)
    bad.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(TraceError, match="not a gpemu trace"):
        load_trace(bad)
    bad.write_text(
        json.dumps(
            {
                "traceEvents": [{"ph": "X", "ts": "x", "pid": 1, "args": {"enqueued_us": 1}}],
                "otherData": {"format": "gpemu-trace/1", "gpus": ["V100"]},
            }
        )
    )
    with pytest.raises(TraceError, match="malformed"):
        load_trace(bad)

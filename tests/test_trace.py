"""The Chrome trace: valid Trace Event Format JSON, and a faithful record of the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpemu.clock import VirtualClock
from gpemu.observe import RunRecords, compute_summary
from gpemu.recorder import Recorder
from gpemu.time import TimeEngine
from gpemu.trace import IDLE_TID, write_trace
from gpemu.trace_reader import TraceError, load_trace

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
    with pytest.raises(TraceError, match="trace event 1: ts must be a number from -1e"):
        load_trace(bad)


# ---------------------------------------------------------------------------- hostile traces
def _good_doc() -> dict:
    return {
        "traceEvents": [
            {"name": "fwd", "cat": "forward", "ph": "X", "ts": 10.0, "dur": 5.0, "pid": 1, "tid": 1,
             "args": {"kind": "forward", "stream": 0, "enqueued_us": 9.0}},
            {"name": "iteration 0", "cat": "iteration", "ph": "i", "s": "p", "ts": 15.0, "pid": 1, "tid": 0,
             "args": {"index": 0}},
        ],
        "otherData": {"format": "gpemu-trace/1", "gpus": ["V100"], "ended_us": 20.0, "counters": {}, "notes": []},
    }  # fmt: skip


def _hostile_files(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Name -> the expected start of the one error line, for crafted files (JSON text or bytes)."""

    def doc(**changes) -> str:
        d = _good_doc()
        for path, value in changes.items():
            where, key = (d["otherData"], path[6:]) if path.startswith("other_") else (d, path)
            where[key] = value
        return json.dumps(d)

    def event(**fields) -> str:
        d = _good_doc()
        d["traceEvents"][0].update(fields)
        return json.dumps(d)

    huge = "1" + "0" * 400
    return {
        "inf-ts.json": (event(ts=777).replace('"ts": 777', '"ts": 1e400'), "overflow"),
        "big-int-ts.json": (event(ts=777).replace('"ts": 777', f'"ts": {huge}'), "is not JSON"),
        "nan.json": (event(ts=777).replace('"ts": 777', '"ts": NaN'), "is not JSON"),
        "nan-dur.json": (event(dur="NaN"), "dur must be a number from 0"),
        "negative-dur.json": (event(dur=-5.0), "dur must be a number from 0"),
        "deep.json": ('{"traceEvents": [' + "[" * 200_000 + "]" * 200_000 + "]}", "nested deeper"),
        "deep-ignored.json": ('{"x": ' + "[" * 200_000 + "]" * 200_000 + "}", "not a gpemu trace"),
        "events-dict.json": (doc(traceEvents={"a": 1}), "traceEvents must be a list"),
        "events-str.json": (doc(traceEvents="x"), "traceEvents must be a list"),
        "event-int.json": (doc(traceEvents=[5]), "trace event 1: must be an object"),
        "counters-list.json": (doc(other_counters=[1, 2]), "otherData.counters must map names to numbers"),
        "counters-str.json": (doc(other_counters={"a": "x"}), "otherData.counters must map names to numbers"),
        "notes-dict.json": (doc(other_notes={"a": 1}), "otherData.notes must be a list of strings"),
        "memory-stats-int.json": (doc(other_memory_stats=7), "memory_stats must be lists of objects"),
        "memory-stats-neg.json": (doc(other_memory_stats=[{"capacity": -1}]), "capacity must be a whole number"),
        "gpus-million.json": (doc(other_gpus=["V100"] * 1_000_000), "otherData.gpus: more than 64 items"),
        "gpus-none.json": (doc(other_gpus=[]), "otherData.gpus must list the emulated GPUs"),
        "pid-beyond.json": (event(pid=3), "is on GPU 2, but otherData.gpus lists 1 GPU(s)"),
        "ended-str.json": (doc(other_ended_us="soon"), "ended_us must be a number from"),
        "truncated.json": (json.dumps(_good_doc())[:-30], "is not JSON"),
        "binary.json": ("\x00\xff garbage", "is not JSON"),
        "array.json": ("[1, 2, 3]", "not a gpemu trace"),
    }


@pytest.mark.subprocess
def test_hostile_traces_are_one_line_each_never_a_traceback(tmp_path):
    """Crafted files through `gpemu report` as a user runs it: one error line each (what was
    wrong), no traceback, no NaN/Inf/negative time printed as a result."""
    cases = _hostile_files(tmp_path)
    for name, (text, _) in cases.items():
        (tmp_path / name).write_text(text)
    driver = (
        "import contextlib, io, json, sys\nfrom gpemu.cli import main\nout = []\n"
        "for f in sys.argv[1:]:\n    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        "        rc = main(['report', f])\n    out.append([rc, err.getvalue()])\nprint(json.dumps(out))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", driver, *(str(tmp_path / n) for n in cases)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (name, (_, expected)), (rc, err) in zip(cases.items(), json.loads(proc.stdout.splitlines()[-1]), strict=True):
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, err[-500:])
        assert expected in lines[0], (name, lines[0])


@pytest.mark.subprocess
def test_a_large_value_under_an_ignored_key_is_streamed_not_loaded(tmp_path):
    """100 MB under a key the report does not read (the stored summary): memory stays bounded."""
    d = _good_doc()
    path = tmp_path / "bomb.json"
    body = json.dumps(d)
    with open(path, "w") as f:
        f.write(body[:-1] + ', "bomb": [')
        chunk = ",".join(['"' + "x" * 1000 + '"'] * 1000)
        for i in range(100):
            f.write(("," if i else "") + chunk)
        f.write("]}")
    code = (
        "import resource, sys\nfrom gpemu.trace_reader import load_trace\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\nrec = load_trace(sys.argv[1])\n"
        "print(len(rec.spans), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spans, grew_mib = map(int, proc.stdout.split())
    assert spans == 1 and grew_mib < 50, f"reading grew RSS by {grew_mib} MiB"

"""Communication in the summary and the trace: per collective kind and link, and exposed (not
overlapped) communication, from a virtual-clock run's own records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpemu.commstats import by_kind_and_link, exposed_intervals
from gpemu.observe import compute_summary, format_summary, records_from_runtime
from gpemu.recorder import GpuSpan
from gpemu.trace import write_trace


def _span(kind: str, start: float, end: float, stream: int = 0) -> GpuSpan:
    return GpuSpan(0, stream, kind, kind, start, end, start)


def test_exposed_communication_is_what_no_computation_overlaps() -> None:
    spans = [
        _span("backward", 0.0, 4.0),
        _span("comm", 3.0, 6.0, stream=1),  # 3-4 hidden by the backward, 4-6 exposed
        _span("comm", 5.0, 7.0, stream=2),  # overlaps the other collective: union 4-7
        _span("forward", 6.5, 8.0),  # hides 6.5-7
    ]
    assert exposed_intervals(spans) == [(4.0, 6.5)]
    assert exposed_intervals([_span("forward", 0, 1)]) == []


def test_counters_group_by_kind_and_link() -> None:
    counters = {
        "comm_seconds/all_reduce/nvlink+ib": 2.0,
        "comm_bytes/all_reduce/nvlink+ib": 1e9,
        "comm_count/all_reduce/nvlink+ib": 4.0,
        "comm_seconds/all_gather/nvlink": 3.0,
        "comm_collectives": 9.0,  # not per kind: left out
    }
    table = by_kind_and_link(counters)
    assert list(table) == ["all_gather/nvlink", "all_reduce/nvlink+ib"]  # longest first
    assert table["all_reduce/nvlink+ib"] == {"seconds": 2.0, "bytes": 1e9, "count": 4.0}


def test_the_summary_and_trace_show_communication(tmp_path: Path) -> None:
    import gpemu
    from gpemu.clock import VirtualClock

    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    side = rt.engine.new_stream(0)
    rt.engine.default_stream(0).enqueue(1.0, "forward", "layer")
    side.enqueue(1.5, "comm", "all_gather (nvlink, ring/Simple)")  # 0.5 s past the forward
    rt.engine.end_iteration(0)
    rt.recorder.add_many(("comm_seconds/all_gather/nvlink", 1.5), ("comm_bytes/all_gather/nvlink", 2e9))
    rt.recorder.add_many(("comm_count/all_gather/nvlink", 1.0), ("comm_wait_seconds", 0.25))
    records = records_from_runtime(rt)
    summary = compute_summary(records)
    comm = summary["devices"][0]["communication"]
    assert comm["comm_s"] == pytest.approx(1.5) and comm["exposed_s"] == pytest.approx(0.5)
    assert comm["overlapped_s"] == pytest.approx(1.0)
    text = format_summary(summary)
    assert "1.500 s on the GPU, 500.00 ms exposed" in text
    assert "all_gather/nvlink 1.500 s (1 x, 1.86 GiB)" in text and "waited for slower ranks" in text
    doc = json.loads(write_trace(records, tmp_path / "t.json", summary).read_text())
    exposed = [e for e in doc["traceEvents"] if e.get("cat") == "comm_exposed"]
    assert len(exposed) == 1 and exposed[0]["dur"] == pytest.approx(0.5e6)

"""benchmarks/step_trace.py: a real GPU step split into kernels, GPU idle and launches (the script
runs on the GPU's machine; here its arithmetic, and its loop on the CPU)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def step_trace():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("step_trace")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_a_phase_is_split_into_busy_idle_and_launches(step_trace):
    span = step_trace.Interval
    window = span(0.0, 1000.0)  # a 1 ms phase (microseconds)
    # two overlapping kernels and one apart; one kernel of the next phase
    device = [span(100.0, 300.0), span(200.0, 400.0), span(600.0, 700.0), span(1100.0, 1200.0)]
    launches = [span(10.0, 15.0), span(150.0, 159.0), span(500.0, 504.0), span(1050.0, 1055.0)]
    t = step_trace.split_phase(window, device, launches)
    assert t.kernels == 3 and t.kernel_ms == pytest.approx(0.5)
    assert t.busy_ms == pytest.approx(0.4)  # (100-400 and 600-700: overlap counted once)
    assert t.idle_ms == pytest.approx(0.6)
    assert t.launches == 3 and t.launch_us == pytest.approx(6.0) and t.issue_ms == pytest.approx(0.504)


def test_the_profilers_loop_runs_and_marks_each_phase(step_trace):
    # (on the CPU: no device work, each phase its host time)
    phases = step_trace.trace_case("squeezenet1_0", 1, step_trace.torch.device("cpu"), iterations=1, warmup=1)
    assert set(phases) == set(step_trace.PHASES)
    for t in phases.values():
        assert t.ms > 0 and t.kernels == 0 and t.idle_ms == pytest.approx(t.ms)

"""The compatibility suite: ordinary training scripts and the real libraries researchers use
(transformers' Trainer, accelerate, Lightning, DDP, FSDP2, DTensor, DataParallel, AMP,
checkpointing...), unmodified, on tiny configurations (tests/compat/: the scripts and their
registry; no downloads).

Each scenario runs under ``gpemu run ... --metrics`` in real processes (one process, or
torchrun / accelerate launch / Lightning's own launcher rendezvousing over real gloo process
groups). Each asserts that the script trained (exit 0, its own step count per case), that every
rank's optimizer steps were charged as iterations with optimizer time, that communication was
charged where ranks communicate, and that the notes give the time's provenance the docs promise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "compat"))
import scenarios  # noqa: E402

pytestmark = pytest.mark.compat

pytest.importorskip("torch")

SUITE = [s for s in scenarios.SCENARIOS if s.suite]


@pytest.mark.parametrize("scenario", SUITE, ids=[s.name for s in SUITE])
def test_scenario_trains_and_is_charged(scenario: scenarios.Scenario, tmp_path: Path, _gpemu_data_dir: Path) -> None:
    result = scenarios.run(scenario, tmp_path)
    tail = result.output[-4000:]
    assert result.returncode == 0, tail
    for case in scenario.cases:
        assert result.cases.get(case.name, (None,))[0] == case.steps, f"{case.name}: {result.cases}\n{tail}"
    assert result.iterations() == [scenario.steps] * scenario.world, tail
    for rank in range(scenario.world):
        busy = result.busy_by_kind(rank)
        assert busy.get("optimizer", 0) > 0, (rank, busy)
        if scenario.comm:
            assert busy.get("comm", 0) > 0, (rank, busy)
    assert result.provenance() == scenario.provenance, [n for m in result.metrics for n in m.get("notes", [])]

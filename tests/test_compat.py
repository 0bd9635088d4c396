"""The distributed compatibility suite: real libraries' multi-GPU training, unmodified, on tiny
configurations (tests/compat/: the scripts and their registry; no downloads).

Each scenario runs under ``gpemu run ... --metrics`` in real processes (torchrun, accelerate
launch, Lightning's own launcher) that rendezvous over real gloo process groups. Each asserts
that the script trained (exit 0, its own step count per case), that every rank's optimizer
steps were charged as iterations with optimizer time, that communication was charged where
ranks communicate, and that the notes give the time's provenance the docs promise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "compat"))
import scenarios  # noqa: E402

pytest.importorskip("torch")

DISTRIBUTED = [s for s in scenarios.SCENARIOS if s.owner == "distributed" and s.suite]
LIBRARIES = {"lightning-ddp": "lightning", "accelerate-fp16": "accelerate", "hf-trainer-gpt2": "transformers"}


@pytest.mark.parametrize("scenario", DISTRIBUTED, ids=[s.name for s in DISTRIBUTED])
def test_scenario_trains_and_is_charged(scenario: scenarios.Scenario, tmp_path: Path, _gpemu_data_dir: Path) -> None:
    if scenario.name in LIBRARIES:
        pytest.importorskip(LIBRARIES[scenario.name])
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

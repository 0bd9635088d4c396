"""Every parallelism plan on torch's own APIs, four real processes over gloo (tests/parallel_plans.py
under `gpemu run ... torchrun --nproc-per-node 4`, on virtual time): DDP, FSDP2, HSDP, tensor +
sequence parallel, GPipe / 1F1B / interleaved 1F1B pipelines, context parallel, expert-parallel
all-to-all, and symmetric memory refused in one line. One run serves every test of this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORLD = 4
pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("plans") / "result"
    script = Path(__file__).with_name("parallel_plans.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPEMU_")}
    env["GPEMU_DATA_DIR"] = os.environ["GPEMU_DATA_DIR"]
    env["PLANS_TIMEOUT_S"] = "240"
    done = subprocess.run(
        ["gpemu", "run", "--gpu", "H100", "--gpus", str(WORLD), "--clock", "virtual", "--no-summary", "--"]
        + [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), str(script), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(WORLD)]


def _ok(plans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    seen = [rank[name] for rank in plans]
    assert all("error" not in s for s in seen), [s.get("error") for s in seen]
    return seen


def test_data_parallel_plans_shard_and_reduce(plans: list[dict[str, Any]]) -> None:
    for s in _ok(plans, "ddp"):
        assert s["comm"]["all_reduce"] > 0  # the gradient buckets
    for s in _ok(plans, "fsdp2"):
        assert s["local_shard"] == [256 // WORLD, 64]  # Linear(64, 256)'s weight over four ranks
        assert s["comm"]["all_gather"] > 0 and s["comm"]["reduce_scatter"] > 0
    for s in _ok(plans, "hsdp"):
        # two replicas of a two-way shard: halves, gathered and reduced in the shard group,
        # all-reduced between the replicas
        assert s["local_shard"] == [128, 64] and s["placements"] == "(Replicate(), Shard(dim=0))"
        assert s["comm"]["all_gather"] > 0 and s["comm"]["reduce_scatter"] > 0 and s["comm"]["all_reduce"] > 0


def test_tensor_and_sequence_parallel(plans: list[dict[str, Any]]) -> None:
    for s in _ok(plans, "tp_sp"):
        assert s["local_shard"] == [256 // WORLD, 64]
        # sequence parallel's all-gather before the column-wise layer, reduce-scatter after the row-wise one
        assert s["comm"]["all_gather"] > 0 and s["comm"]["reduce_scatter"] > 0


@pytest.mark.parametrize("schedule", ["pp_gpipe", "pp_1f1b", "pp_interleaved"])
def test_pipeline_schedules_send_between_stages_and_wait_in_bubbles(plans: list[dict[str, Any]], schedule: str) -> None:
    seen = _ok(plans, schedule)
    per_rank = 2 if schedule == "pp_interleaved" else 1
    assert [s["stages"] for s in seen] == [[r + k * WORLD for k in range(per_rank)] for r in range(WORLD)]
    assert all(s["comm"]["send"] > 0 for s in seen)
    # every stage after the first waits for its activations, every stage before the last for its
    # gradients: the pipeline's bubbles, in the per-rank summary's "at receives"
    assert all(s["p2p_wait_s"] > 0 for s in seen)


def test_context_parallel_shards_the_sequence(plans: list[dict[str, Any]]) -> None:
    for s in _ok(plans, "cp"):
        assert s["local_seq"] == 32  # 32 x 4 tokens over four ranks
        assert sum(s["comm"].values()) > 0  # the ring passes keys and values


def test_expert_parallel_all_to_all(plans: list[dict[str, Any]]) -> None:
    for s in _ok(plans, "ep_all_to_all"):
        assert s["tokens"] == [16 * WORLD, 64] and s["comm"]["all_to_all"] > 0


def test_symmetric_memory_is_refused_in_one_line(plans: list[dict[str, Any]]) -> None:
    for rank in plans:
        error = rank["symmetric_memory"]["error"]
        assert error.startswith("SymmetricMemoryRefused: gpemu: symmetric memory") and "\n" not in error
        assert "enable_async_tensor_parallel = false" in error

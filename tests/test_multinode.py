"""Multi-node for real: a 2-node x 2-GPU torchrun job across two network namespaces (their own
addresses on a bridge, c10d rendezvous; examples/netns_cluster.py), DDP over emulated GPUs.

* the inter-node link throttled in the cluster description (node 1's NICs at 1 Gb/s) slows every
  rank's step by the extra all-reduce time the cost model charges;
* a straggler (rank 3's host 0.8 s late every step) slows every rank, which wait at the
  gradient all-reduce (``comm_wait_seconds``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))

import cluster_job  # noqa: E402
import netns_cluster  # noqa: E402

pytestmark = pytest.mark.torchrun

CLUSTER = cluster_job.TWO_NODES
THROTTLE = "slow_links:\n  - {node: 1, nic_speed: 1Gb/s}\n"
STEPS = 4


def _job(tmp_path: Path, name: str, description: str, *args: str) -> list[dict]:
    ranks = cluster_job.run_two_nodes(tmp_path, name, description, STEPS, *args, timeout=400)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    return ranks


def _step(rank: dict) -> float:
    """A rank's mean step time after the first (warm-up) step."""
    later = rank["steps"][1:]
    return sum(later) / len(later)


def _comm(rank: dict) -> float:
    return sum(v for k, v in rank["counters"].items() if k.startswith("comm_seconds/all_reduce/"))


def test_two_namespaced_nodes_a_throttled_link_and_a_straggler(tmp_path: Path) -> None:
    reason = netns_cluster.unavailable()
    if reason:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    base = _job(tmp_path, "base", CLUSTER)
    for r in base:
        assert r["nodes"] == [0, 0, 1, 1]  # torchrun's node of each rank, learnt by every rank
        assert any(k.endswith("/nvlink+ib") for k in r["counters"])
    throttled = _job(tmp_path, "throttled", CLUSTER + THROTTLE)
    straggler = _job(tmp_path, "straggler", CLUSTER, "--sleep-rank", "3", "--sleep", "0.8")
    by_rank = {name: {r["rank"]: r for r in run} for name, run in (("b", base), ("t", throttled), ("s", straggler))}
    for rank in range(4):
        b, t, s = by_rank["b"][rank], by_rank["t"][rank], by_rank["s"][rank]
        # The all-reduce crosses node 1's slow NICs: every rank (node 0's too) pays the extra.
        extra = (_comm(t) - _comm(b)) / STEPS
        assert extra > 0.5, extra  # 1 Gb/s instead of 200 Gb/s: a much slower gradient sync
        assert _step(t) - _step(b) == pytest.approx(extra, rel=0.3), (rank, _step(t), _step(b), extra)
        # One slow host: everyone's step waits for it.
        assert _step(s) - _step(b) > 0.6, (rank, _step(s), _step(b))
        if rank != 3:
            assert s["counters"]["comm_wait_seconds"] > 0.6 * (STEPS - 1)

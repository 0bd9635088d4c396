"""A 2-node x 2-GPU job across two network namespaces: baseline, a throttled inter-node link,
a straggler rank (issue 30's "must show").

    sudo python benchmarks/multinode_netns.py [--steps 5] [--slow 1Gb/s] [--sleep 0.8]

Runs tests/cluster_job.py (DDP, 4 x Linear(4096, 4096), comm-heavy) three times through
examples/netns_cluster.py and prints each rank's mean step time (after the first), the
all-reduce seconds the cost model charged per step, and the time each rank waited for slower ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _common import REPO, machine

sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "tests"))

import netns_cluster  # noqa: E402
from cluster_job import TWO_NODES, run_two_nodes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--slow", default="1Gb/s", help="node 1's NIC speed in the throttled run")
    parser.add_argument("--sleep", type=float, default=0.8, help="rank 3's extra host seconds per step")
    args = parser.parse_args()
    reason = netns_cluster.unavailable()
    if reason:
        sys.exit(f"cannot make network namespaces here: {reason}")
    import tempfile

    slow = TWO_NODES + f"slow_links:\n  - {{node: 1, nic_speed: {args.slow}}}\n"
    sleep = ("--sleep-rank", "3", "--sleep", str(args.sleep))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            runs = {
                "baseline": run_two_nodes(Path(tmp), "base", TWO_NODES, args.steps),
                f"node 1 NICs at {args.slow}": run_two_nodes(Path(tmp), "slow", slow, args.steps),
                f"rank 3 +{args.sleep:g} s/step": run_two_nodes(Path(tmp), "straggler", TWO_NODES, args.steps, *sleep),
            }
        except RuntimeError as exc:
            sys.exit(str(exc))
    print(f"machine: {machine()}")
    print(f"{'run':26} {'rank':>4} {'node':>4} {'step (s)':>9} {'all-reduce charged/step':>24} {'waited/step':>12}")
    for name, ranks in runs.items():
        for r in ranks:
            later = r["steps"][1:]
            comm = sum(v for k, v in r["counters"].items() if k.startswith("comm_seconds/all_reduce/"))
            wait = r["counters"].get("comm_wait_seconds", 0.0)
            print(
                f"{name:26} {r['rank']:>4} {r['nodes'][r['rank']]:>4} {sum(later) / len(later):9.3f}"
                f" {comm / args.steps:24.3f} {wait / args.steps:12.3f}"
            )


if __name__ == "__main__":
    main()

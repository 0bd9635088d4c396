"""gpemu.costmodel.comm: collective times over a link, the GPU's link, DDP's bucket overlap.

The pinned values are the ring formulas worked by hand (module docstring): all-reduce
``2 (n-1)/n * b / bw + 2 (n-1) * a``, its halves half of that, point to point ``b / bw + a``,
with ``a`` = 8 us per ring step.
"""

from __future__ import annotations

import dataclasses

import pytest

from gpemu.costmodel.comm import (
    RING_STEP_LATENCY,
    Collective,
    Link,
    collective_seconds,
    gpu_link,
    gradient_buckets,
    overlapped_all_reduce_end,
)

PCIE = Link(12e9)  # 12 GB/s, 8 us per step


@pytest.mark.parametrize(
    ("kind", "nbytes", "world", "bandwidth", "seconds"),
    [
        # 100 MiB among 4 over 12 GB/s: 2*3/4 * 104,857,600 / 12e9 = 0.0131072; + 2*3 * 8e-6 = 0.000048
        (Collective.ALL_REDUCE, 100 << 20, 4, 12e9, 0.0131552),
        # 1 GB among 2 over 240 GB/s: 2*1/2 * 1e9 / 240e9 = 0.00416667; + 2 * 8e-6 = 0.000016
        (Collective.ALL_REDUCE, 10**9, 2, 240e9, 0.0041826667),
        # half of 1 GB among 8 over 240 GB/s: (2*7/8 * 1e9 / 240e9 = 0.00729167; + 14 * 8e-6) / 2
        (Collective.ALL_GATHER, 10**9, 8, 240e9, 0.0037018333),
        (Collective.REDUCE_SCATTER, 10**9, 8, 240e9, 0.0037018333),
        # half of 64 MiB among 8 over 12 GB/s: (2*7/8 * 67,108,864 / 12e9 = 0.00978671; + 0.000112) / 2
        (Collective.BROADCAST, 64 << 20, 8, 12e9, 0.0049493547),
        (Collective.REDUCE, 64 << 20, 8, 12e9, 0.0049493547),
        (Collective.SCATTER, 64 << 20, 8, 12e9, 0.0049493547),
        (Collective.GATHER, 64 << 20, 8, 12e9, 0.0049493547),
        # 1 MiB sent in all among 2 over 25.2 GB/s: 1/2 * 1,048,576 / 25.2e9 = 2.0805e-5; + 1 * 8e-6
        (Collective.ALL_TO_ALL, 1 << 20, 2, 25.2e9, 2.8805079e-5),
        # 1 MB to one other rank over 12 GB/s: 1e6 / 12e9 = 8.3333e-5; + 8e-6
        (Collective.SEND, 10**6, 8, 12e9, 9.1333333e-5),
    ],
)
def test_ring_times_by_hand(kind: Collective, nbytes: int, world: int, bandwidth: float, seconds: float) -> None:
    assert collective_seconds(kind, nbytes, world, Link(bandwidth)) == pytest.approx(seconds, rel=1e-7)


def test_nothing_to_exchange_costs_nothing_but_a_send_costs_its_latency() -> None:
    for kind in Collective:
        if kind is not Collective.SEND:
            assert collective_seconds(kind, 100 << 20, 1, PCIE) == 0.0  # one rank
            assert collective_seconds(kind, 0, 8, PCIE) == 0.0  # no bytes
    assert collective_seconds(Collective.SEND, 0, 2, PCIE) == 8e-6


def test_a_ring_all_reduce_is_a_reduce_scatter_then_an_all_gather() -> None:
    n = 100 << 20
    for world in (2, 4, 8):
        whole = collective_seconds(Collective.ALL_REDUCE, n, world, PCIE)
        halves = [collective_seconds(k, n, world, PCIE) for k in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER)]
        assert sum(halves) == pytest.approx(whole)
    # NVLink is much faster than PCIe
    fast = collective_seconds(Collective.ALL_REDUCE, n, 2, Link(230e9))
    assert fast < collective_seconds(Collective.ALL_REDUCE, n, 2, PCIE) / 10


def test_bad_input_names_what_is_valid() -> None:
    with pytest.raises(ValueError, match=r"kind must be a Collective \(ALL_REDUCE, .*SEND\), got 'all_reduce'"):
        collective_seconds("all_reduce", 1, 2, PCIE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Link.bandwidth must be a positive number of bytes/s, got 0"):
        Link(0)
    with pytest.raises(ValueError, match="Link.latency must be a number of seconds >= 0"):
        Link(12e9, -1.0)


def test_links_of_shipped_gpus_come_from_their_datasheet_rows() -> None:
    from gpemu.db.specs import SHIPPED_GPUS

    by_name = {s.short_name: s for s in SHIPPED_GPUS}
    # NVLink joining the node (SXM): 80% of the per-direction half of the datasheet's total
    assert gpu_link(by_name["A100"]).bandwidth == 0.8 * 600e9 / 2  # 240 GB/s
    assert gpu_link(by_name["H100"]).bandwidth == 0.8 * 900e9 / 2  # 360 GB/s
    # PCIe cards, and NVLink bridges that join two cards only: the host link's pinned rate
    for name in ("V100", "H100-PCIe", "RTX6000"):
        assert gpu_link(by_name[name]).bandwidth == by_name[name].host_link_bandwidth_pinned
    assert gpu_link(by_name["A100"]).latency == RING_STEP_LATENCY


def test_a_row_without_an_nvlink_figure_goes_by_its_form_factor() -> None:
    from gpemu.db.specs import SHIPPED_GPUS

    row = next(s for s in SHIPPED_GPUS if s.short_name == "V100")
    unknown = dataclasses.replace(row, nvlink_bandwidth=None)
    assert gpu_link(dataclasses.replace(unknown, name="Tesla V100-SXM2-32GB")).bandwidth == 130e9
    assert gpu_link(dataclasses.replace(unknown, name="My A100-SXM4 board")).bandwidth == 230e9
    assert gpu_link(dataclasses.replace(unknown, name="My H100 SXM5")).bandwidth == 360e9
    assert gpu_link(unknown).bandwidth == row.host_link_bandwidth_pinned  # no form factor in the name


def test_gradient_buckets_close_at_the_cap() -> None:
    mib = 1 << 20
    assert gradient_buckets([10 * mib, 10 * mib, 10 * mib, 30 * mib, mib], 25 * mib) == [30 * mib, 30 * mib, mib]
    assert gradient_buckets([], 25 * mib) == []


def test_bucket_overlap_hides_communication_behind_backward() -> None:
    buckets = [25 << 20] * 4
    each = collective_seconds(Collective.ALL_REDUCE, buckets[0], 2, PCIE)
    comm = 4 * each
    # Backward much longer than communication: only the last bucket is exposed.
    long_end = overlapped_all_reduce_end(0.0, 10 * comm, buckets, 2, PCIE)
    assert long_end - 10 * comm == pytest.approx(each, rel=1e-6)
    # Instant backward: all communication is exposed.
    assert overlapped_all_reduce_end(5.0, 5.0, buckets, 2, PCIE) - 5.0 == pytest.approx(comm, rel=1e-6)

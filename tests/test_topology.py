"""gpemu.costmodel.topology: presets, the YAML form, one-line errors for impossible clusters."""

from __future__ import annotations

import pytest

from gpemu.costmodel.topology import (
    PRESETS,
    TopologyError,
    cluster_from_mapping,
    default_cluster,
    describe,
    parse_rate,
    preset,
)


def test_rates_take_their_unit() -> None:
    assert parse_rate("400Gb/s", "x") == 50e9
    assert parse_rate("450 GB/s", "x") == 450e9
    assert parse_rate("100Gbps", "x") == 12.5e9
    for bad in ("400", 400, "fast", "0Gb/s", True):
        with pytest.raises(TopologyError, match="a rate with its unit, like 400Gb/s|above zero"):
            parse_rate(bad, "inter_node.nic_speed")


def test_every_preset_describes_its_gpus_fabric_and_network() -> None:
    for name in PRESETS:
        cluster = preset(name, nodes=2)
        assert cluster.world_size == 2 * cluster.gpus_per_node
        text = describe(cluster)
        assert "2 node(s)" in text and "between nodes" in text
    h100, a100 = preset("dgx-h100"), preset("dgx-a100")
    assert h100.fabric.nvls and not a100.fabric.nvls  # NVLS needs NVSwitch gen 3 (Hopper)
    assert h100.fabric.link_bandwidth == 450e9 and a100.fabric.link_bandwidth == 300e9  # from gpus.py
    assert h100.network is not None and h100.network.node_bandwidth == 400e9  # 8 x 400 Gb/s
    assert "NVLS" in describe(h100) and "NVLS" not in describe(a100)
    assert not preset("rtx4090-pcie").fabric.p2p
    assert preset("DGX_H100").name == "dgx-h100"  # names forgive case and underscores


def test_a_yaml_description_starts_from_a_preset_or_from_nothing() -> None:
    slow = cluster_from_mapping(
        {
            "preset": "dgx-h100",
            "nodes": 4,
            "inter_node": {"nic_speed": "200Gb/s", "oversubscription": 2, "nodes_per_leaf": 2},
            "slow_links": [{"node": 3, "nic_speed": "25Gb/s"}],
        }
    )
    assert slow.nodes == 4 and slow.gpu == "H100" and slow.fabric.nvls
    assert slow.network is not None and slow.network.nic_bandwidth == 25e9 and slow.network.oversubscription == 2
    assert slow.nic_bandwidth(3) == 25e9 / 8 and slow.nic_bandwidth(0) == 25e9
    box = cluster_from_mapping(
        {
            "gpu": "L40S",
            "gpus_per_node": 4,
            "intra_node": {"fabric": "pcie", "gpus_per_pcie_switch": 2},
            "inter_node": {"nic": "roce", "nic_speed": "100Gb/s", "nics_per_node": 2},
        },
        nodes=3,  # the command line's count wins
    )
    assert box.nodes == 3 and box.fabric.fabric == "pcie" and box.fabric.gpus_per_pcie_switch == 2
    assert box.network is not None and box.network.nic == "roce" and box.network.node_bandwidth == 25e9
    # One node of SXM GPUs with nothing said: NVSwitch; several: a 400 Gb/s NIC per GPU.
    assert default_cluster("A100", 4).fabric.fabric == "nvswitch" and default_cluster("A100", 4).network is None
    assert default_cluster("V100", 2, nodes=2).fabric.fabric == "pcie"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"preset": "dgx-h999"}, r"unknown cluster preset 'dgx-h999'; presets: a10g-pcie, .*dgx-h100"),
        ({"gpu": "H100", "nodes": 0}, r"nodes must be an integer from 1 to 100000, got 0"),
        ({"gpu": "H100", "gpus_per_node": 100}, r"gpus_per_node must be an integer from 1 to 72, got 100"),
        ({"gpu": "H100", "colour": "red"}, r"cluster: unknown key\(s\) colour; valid: name, preset, gpu"),
        ({"gpu": "Z9000"}, r"cluster gpu 'Z9000' is not a GPU gpemu knows"),
        ({"nodes": 2}, r"give its gpu"),
        ({"gpu": "V100", "intra_node": {"fabric": "nvswitch"}}, r"V100 has no NVLink, so no NVSwitch"),
        (
            {"gpu": "L40S", "intra_node": {"fabric": "pcie", "nvls": True}},
            r"nvls \(NVLink SHARP\) needs fabric: nvswitch",
        ),
        ({"gpu": "H100", "intra_node": {"fabric": "torus"}}, r"fabric must be one of nvswitch, nvlink-bridge, pcie"),
        ({"preset": "dgx-a100", "inter_node": {"nic_speed": 400}}, r"nic_speed must be a rate with its unit"),
        ({"preset": "dgx-a100", "inter_node": {"oversubscription": 0.5}}, r"oversubscription is a ratio from 1"),
        ({"preset": "dgx-a100", "nodes": 2, "slow_links": [{"node": 2, "nic_speed": "1Gb/s"}]}, r"slow_links.node"),
        ({"preset": "dgx-a100", "slow_links": [{"node": 0}]}, r"each entry is \{node: N, nic_speed: RATE\}"),
        ({"preset": "dgx-a100", "overlap_k": 0.5}, r"overlap_k must be a number from 1"),
        ("dgx-a100", r"a cluster description is a mapping"),
    ],
)
def test_impossible_clusters_are_refused_in_one_line(data: object, message: str) -> None:
    with pytest.raises(TopologyError, match=message) as info:
        cluster_from_mapping(data)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)

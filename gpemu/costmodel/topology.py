"""A GPU cluster as a run assumes it: nodes of GPUs, the fabric inside a node, the network between.

    from gpemu.costmodel.topology import preset, cluster_from_mapping
    c = preset("dgx-h100", nodes=4)          # 4 DGX H100: NVSwitch + NVLS, 8 x 400 Gb/s IB each
    c = cluster_from_mapping({"gpu": "L40S", "nodes": 2, "gpus_per_node": 8,
                              "intra_node": {"fabric": "pcie", "pcie_gen": 4, "gpus_per_pcie_switch": 4},
                              "inter_node": {"nic": "roce", "nic_speed": "200Gb/s", "nics_per_node": 4}})
    print(describe(c))

A :class:`Cluster` is ``nodes`` identical nodes (:class:`NodeFabric` inside, :class:`Network`
between) with optional slow links (:class:`SlowLink`: one node's NICs at a lower speed). Rates
are bytes/s inside; the description's text form takes units ("400Gb/s", "450GB/s"). Presets
(:data:`PRESETS`) are the systems researchers use; :func:`cluster_from_mapping` reads any other
(the YAML form, loaded by ``gpemu.config``) and refuses an impossible one with one line that says
what is valid (:class:`TopologyError`).

GPU facts (NVLink bandwidth and generation, the PCIe generation) come from :mod:`.gpus`; this
module adds only what a system adds: which switch joins the GPUs, how many NICs, what network.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .gpus import NVLS_FROM_NVLINK, GpuSheet, find_gpu, nvlink_generation, nvlink_per_direction, pcie_link_rate

__all__ = [
    "TopologyError",
    "NodeFabric",
    "Network",
    "SlowLink",
    "Cluster",
    "FABRICS",
    "NIC_KINDS",
    "PRESETS",
    "preset",
    "preset_names",
    "cluster_from_mapping",
    "default_cluster",
    "parse_rate",
    "format_rate",
    "describe",
]

FABRICS = ("nvswitch", "nvlink-bridge", "pcie")
NIC_KINDS = ("ib", "roce", "efa", "ethernet")
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 72  # an NVL72 rack is the largest NVLink domain sold


class TopologyError(ValueError):
    """A cluster description gpemu cannot use; the message says what is valid."""


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)([bB])(?:/s|ps)\s*$")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: Any, what: str) -> float:
    """``"400Gb/s"`` / ``"50GB/s"`` / ``"100Gbps"`` -> bytes/s (b: bits, B: bytes)."""
    if isinstance(text, bool) or not isinstance(text, str):
        raise TopologyError(f"{what} must be a rate with its unit, like 400Gb/s or 50GB/s, got {text!r}")
    match = _RATE.match(text)
    if match is None:
        raise TopologyError(f"{what} must be a rate with its unit, like 400Gb/s or 50GB/s, got {text!r}")
    number, prefix, unit = match.groups()
    rate = float(number) * _SCALE[prefix.lower()] / (8.0 if unit == "b" else 1.0)
    if not rate > 0:
        raise TopologyError(f"{what} must be above zero, got {text!r}")
    return rate


def format_rate(rate: float, bits: bool = False) -> str:
    """bytes/s as the description writes it: ``400 Gb/s`` (bits=True) or ``450 GB/s``."""
    value, unit = (rate * 8, "b") if bits else (rate, "B")
    return f"{value / 1e9:g} G{unit}/s"


@dataclass(frozen=True)
class NodeFabric:
    """How the GPUs of one node reach each other.

    ``fabric``: ``nvswitch`` (every GPU to every GPU at its full NVLink rate), ``nvlink-bridge``
    (pairs joined by a bridge; the rest over PCIe) or ``pcie``. ``link_bandwidth``: one GPU's rate
    into the fabric per direction (NVLink: half the datasheet's total; PCIe: the x16 link's).
    ``nvls``: the NVSwitch reduces and multicasts (NVLink SHARP). ``gpus_per_pcie_switch``: GPUs
    sharing one PCIe switch's uplink to the CPU (a ring through the CPU crosses it); ``p2p``: GPUs
    read each other's memory directly (GeForce cards cannot: their traffic goes through host
    memory)."""

    fabric: str
    link_bandwidth: float
    nvls: bool = False
    gpus_per_pcie_switch: int = 0
    p2p: bool = True
    nvlink_generation: int = 0

    @property
    def over_nvlink(self) -> bool:
        return self.fabric == "nvswitch"


@dataclass(frozen=True)
class Network:
    """The network between nodes: ``nics_per_node`` NICs of ``nic_bandwidth`` (bytes/s) each, of
    kind ``nic``; ``rails``: NIC i of every node on switch i (rail-optimised); a two-level fat
    tree whose leaves hold ``nodes_per_leaf`` nodes, oversubscribed ``oversubscription``:1 towards
    the spine (1: non-blocking)."""

    nic: str = "ib"
    nic_bandwidth: float = 50e9
    nics_per_node: int = 8
    rails: bool = True
    oversubscription: float = 1.0
    nodes_per_leaf: int = 32

    @property
    def node_bandwidth(self) -> float:
        return self.nic_bandwidth * self.nics_per_node


@dataclass(frozen=True)
class SlowLink:
    """One node whose NICs run at ``nic_bandwidth`` instead of the network's speed (a straggler
    link: a degraded cable, a NIC in a slower mode)."""

    node: int
    nic_bandwidth: float


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs of model ``gpu`` (a name of :mod:`.gpus`).

    ``overlap_k``: the exponent of the overlap of communication with computation on other
    streams (:func:`gpemu.costmodel.comm.overlapped_seconds`)."""

    name: str
    gpu: str
    nodes: int
    gpus_per_node: int
    fabric: NodeFabric
    network: Network | None
    slow_links: tuple[SlowLink, ...] = ()
    overlap_k: float = 4.0
    note: str = field(default="", compare=False)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        """The node of global rank ``rank`` when ranks fill nodes in order (torchrun's layout)."""
        return min(rank // self.gpus_per_node, self.nodes - 1)

    def nic_bandwidth(self, node: int) -> float:
        """One NIC's rate on ``node`` (a slow link's when one is described there)."""
        if self.network is None:
            return 0.0
        for slow in self.slow_links:
            if slow.node == node:
                return slow.nic_bandwidth
        return self.network.nic_bandwidth

    def with_nodes(self, nodes: int) -> Cluster:
        _check_int("nodes", nodes, 1, MAX_NODES)
        return _checked(dataclasses.replace(self, nodes=nodes))


# ------------------------------------------------------------------------------------- presets
def _sheet(gpu: str | GpuSheet) -> GpuSheet:
    if isinstance(gpu, GpuSheet):
        return gpu
    sheet = find_gpu(gpu)
    if sheet is None:
        raise TopologyError(f"cluster gpu {gpu!r} is not a GPU gpemu knows (see `gpemu gpus`)")
    return sheet


def _nvswitch(gpu: str | GpuSheet) -> NodeFabric:
    sheet = _sheet(gpu)
    gen = nvlink_generation(sheet)
    return NodeFabric("nvswitch", nvlink_per_direction(sheet), nvls=gen >= NVLS_FROM_NVLINK, nvlink_generation=gen)


def _pcie(gpu: str | GpuSheet, per_switch: int, p2p: bool = True) -> NodeFabric:
    sheet = _sheet(gpu)
    return NodeFabric("pcie", pcie_link_rate(sheet.pcie_gen), gpus_per_pcie_switch=per_switch, p2p=p2p)


def _bridged(gpu: str | GpuSheet, per_switch: int) -> NodeFabric:
    sheet = _sheet(gpu)
    return NodeFabric(
        "nvlink-bridge",
        pcie_link_rate(sheet.pcie_gen),
        gpus_per_pcie_switch=per_switch,
        nvlink_generation=nvlink_generation(sheet),
    )


def _gbit(gbits: float) -> float:
    return gbits * 1e9 / 8


_Maker = Callable[[], Cluster]
# name -> (what it is, a maker of its one-node form). Network figures: the vendors' system pages.
PRESETS: dict[str, tuple[str, _Maker]] = {
    "dgx-a100": (
        "NVIDIA DGX A100: 8 x A100-SXM4 on NVSwitch (NVLink 3), 8 x 200 Gb/s HDR InfiniBand, rails",
        lambda: Cluster("dgx-a100", "A100", 1, 8, _nvswitch("A100"), Network("ib", _gbit(200), 8)),
    ),
    "hgx-a100": (
        "HGX A100 8-GPU server (A100-SXM4-80GB): as DGX A100",
        lambda: Cluster("hgx-a100", "A100-80GB", 1, 8, _nvswitch("A100-80GB"), Network("ib", _gbit(200), 8)),
    ),
    "dgx-h100": (
        "NVIDIA DGX H100: 8 x H100-SXM5 on NVSwitch gen 3 (NVLink 4, NVLS), 8 x 400 Gb/s NDR InfiniBand, rails",
        lambda: Cluster("dgx-h100", "H100", 1, 8, _nvswitch("H100"), Network("ib", _gbit(400), 8)),
    ),
    "hgx-h100": (
        "HGX H100 8-GPU server: as DGX H100",
        lambda: Cluster("hgx-h100", "H100", 1, 8, _nvswitch("H100"), Network("ib", _gbit(400), 8)),
    ),
    "dgx-h200": (
        "NVIDIA DGX H200: 8 x H200 on NVSwitch gen 3 (NVLink 4, NVLS), 8 x 400 Gb/s NDR InfiniBand, rails",
        lambda: Cluster("dgx-h200", "H200", 1, 8, _nvswitch("H200"), Network("ib", _gbit(400), 8)),
    ),
    "dgx-b200": (
        "NVIDIA DGX B200: 8 x B200 on NVSwitch gen 4 (NVLink 5, NVLS), 8 x 400 Gb/s InfiniBand, rails",
        lambda: Cluster("dgx-b200", "B200", 1, 8, _nvswitch("B200"), Network("ib", _gbit(400), 8)),
    ),
    "cloud-a100-40gb": (
        "cloud 8 x A100 40GB (AWS p4d.24xlarge): NVSwitch, 4 x 100 Gb/s EFA",
        lambda: Cluster("cloud-a100-40gb", "A100", 1, 8, _nvswitch("A100"), Network("efa", _gbit(100), 4)),
    ),
    "h100-pcie": (
        "8 x H100 PCIe (NVLink bridges join pairs), PCIe Gen5, 2 PCIe switches, 4 x 400 Gb/s RoCE",
        lambda: Cluster("h100-pcie", "H100-PCIe", 1, 8, _bridged("H100-PCIe", 4), Network("roce", _gbit(400), 4)),
    ),
    "l40s-pcie": (
        "8 x L40S PCIe Gen4 box, 2 PCIe switches, 4 x 200 Gb/s RoCE",
        lambda: Cluster("l40s-pcie", "L40S", 1, 8, _pcie("L40S", 4), Network("roce", _gbit(200), 4)),
    ),
    "rtx4090-pcie": (
        "8 x GeForce RTX 4090 PCIe Gen4 box (no peer-to-peer: through host memory), 1 x 100 Gb/s Ethernet",
        lambda: Cluster(
            "rtx4090-pcie", "RTX4090", 1, 8, _pcie("RTX4090", 4, p2p=False), Network("ethernet", _gbit(100), 1)
        ),
    ),
    "a10g-pcie": (
        "cloud 8 x A10G (AWS g5.48xlarge): PCIe Gen4, 1 x 100 Gb/s Ethernet",
        lambda: Cluster("a10g-pcie", "A10G", 1, 8, _pcie("A10G", 4), Network("ethernet", _gbit(100), 1)),
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset(name: str, nodes: int = 1) -> Cluster:
    """Preset ``name`` (case and ``_``/``-`` insensitive) with ``nodes`` nodes."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise TopologyError(f"unknown cluster preset {name!r}; presets: {', '.join(preset_names())} (or a YAML file)")
    return PRESETS[key][1]().with_nodes(nodes)


def default_cluster(gpu: str | GpuSheet, gpus_per_node: int, nodes: int = 1) -> Cluster:
    """The node a run assumes when no cluster is described: its GPUs on NVSwitch where their
    NVLink joins a whole node (SXM boards), bridged pairs or PCIe otherwise; between nodes (when
    there are several) one 400 Gb/s InfiniBand NIC per GPU. ``gpu``: a name, or the sheet of a GPU
    the table does not have (``gpus.gpu_sheet`` of a database row)."""
    sheet = _sheet(gpu)
    if nvlink_generation(sheet) and not sheet.nvlink_bridge:
        fabric = _nvswitch(sheet)
    elif sheet.nvlink_bridge:
        fabric = _bridged(sheet, max(1, gpus_per_node // 2))
    else:
        fabric = _pcie(sheet, max(1, gpus_per_node // 2))
    network = Network("ib", _gbit(400), gpus_per_node) if nodes > 1 else None
    name = f"{nodes} x {gpus_per_node} {sheet.short_name}"
    return _checked(Cluster(name, sheet.name, nodes, gpus_per_node, fabric, network))


# ------------------------------------------------------------------------------------- the YAML form
_TOP_KEYS = ("name", "preset", "gpu", "nodes", "gpus_per_node", "intra_node", "inter_node", "slow_links", "overlap_k")
_INTRA_KEYS = ("fabric", "nvls", "link_speed", "pcie_gen", "gpus_per_pcie_switch", "p2p")
_INTER_KEYS = ("nic", "nic_speed", "nics_per_node", "rails", "oversubscription", "nodes_per_leaf")


def cluster_from_mapping(data: Mapping[str, Any], nodes: int | None = None) -> Cluster:
    """A cluster from its description (the YAML form; README of ``docs/clusters.md``). A
    ``preset:`` key starts from that preset and the other keys change it. ``nodes`` (the command
    line's) wins over the description's."""
    if not isinstance(data, Mapping):
        raise TopologyError(f"a cluster description is a mapping of {', '.join(_TOP_KEYS)}; got {type(data).__name__}")
    _only(data, _TOP_KEYS, "cluster")
    base = preset(data["preset"]) if "preset" in data else None
    gpu = str(data.get("gpu", base.gpu if base else "")).strip()
    if not gpu:
        raise TopologyError("cluster: give its gpu (e.g. gpu: H100) or start from a preset (preset: dgx-h100)")
    sheet = _sheet(gpu)
    per_node = data.get("gpus_per_node", base.gpus_per_node if base else 8)
    _check_int("gpus_per_node", per_node, 1, MAX_GPUS_PER_NODE)
    count = nodes if nodes is not None else data.get("nodes", 1)
    _check_int("nodes", count, 1, MAX_NODES)
    fabric = _fabric(data.get("intra_node", {}), sheet, per_node, base.fabric if base else None)
    network = _network(data.get("inter_node"), per_node, base.network if base else None, count)
    k = data.get("overlap_k", base.overlap_k if base else 4.0)
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not 1.0 <= float(k) <= 64.0:
        raise TopologyError(f"cluster: overlap_k must be a number from 1 (no overlap) to 64, got {k!r}")
    name = str(data.get("name", base.name if base else f"{count} x {per_node} {sheet.short_name}"))
    cluster = Cluster(name, gpu, count, per_node, fabric, network, (), float(k))
    slow = tuple(_slow_link(item, cluster) for item in _listed(data.get("slow_links", []), "slow_links"))
    return _checked(dataclasses.replace(cluster, slow_links=slow))


def _fabric(data: Any, sheet: GpuSheet, per_node: int, base: NodeFabric | None) -> NodeFabric:
    if not isinstance(data, Mapping):
        raise TopologyError(f"cluster: intra_node is a mapping of {', '.join(_INTRA_KEYS)}; got {data!r}")
    _only(data, _INTRA_KEYS, "intra_node")
    kind = str(data.get("fabric", base.fabric if base else "")).strip().lower()
    if not kind:
        kind = default_cluster(sheet.name, per_node).fabric.fabric
    if kind not in FABRICS:
        raise TopologyError(f"intra_node: fabric must be one of {', '.join(FABRICS)}, got {kind!r}")
    gen = data.get("pcie_gen", sheet.pcie_gen)
    _check_int("intra_node.pcie_gen", gen, 1, 7)
    if kind == "nvswitch":
        made = _nvswitch(sheet.name)
        if not made.nvlink_generation:
            raise TopologyError(f"intra_node: {sheet.short_name} has no NVLink, so no NVSwitch; use fabric: pcie")
    elif kind == "nvlink-bridge":
        made = dataclasses.replace(_bridged(sheet.name, max(1, per_node // 2)), link_bandwidth=pcie_link_rate(gen))
    else:
        made = dataclasses.replace(_pcie(sheet.name, max(1, per_node // 2)), link_bandwidth=pcie_link_rate(gen))
    if base is not None and base.fabric == kind:
        made = base
    changes: dict[str, Any] = {}
    if "link_speed" in data:
        changes["link_bandwidth"] = parse_rate(data["link_speed"], "intra_node.link_speed")
    if "nvls" in data:
        changes["nvls"] = _bool(data["nvls"], "intra_node.nvls")
        if changes["nvls"] and kind != "nvswitch":
            raise TopologyError("intra_node: nvls (NVLink SHARP) needs fabric: nvswitch")
    if "gpus_per_pcie_switch" in data:
        _check_int("intra_node.gpus_per_pcie_switch", data["gpus_per_pcie_switch"], 1, per_node)
        changes["gpus_per_pcie_switch"] = data["gpus_per_pcie_switch"]
    if "p2p" in data:
        changes["p2p"] = _bool(data["p2p"], "intra_node.p2p")
    return dataclasses.replace(made, **changes)


def _network(data: Any, per_node: int, base: Network | None, nodes: int) -> Network | None:
    if data is None:
        return base if base is not None or nodes == 1 else Network("ib", _gbit(400), per_node)
    if not isinstance(data, Mapping):
        raise TopologyError(f"cluster: inter_node is a mapping of {', '.join(_INTER_KEYS)}; got {data!r}")
    _only(data, _INTER_KEYS, "inter_node")
    made = base if base is not None else Network("ib", _gbit(400), per_node)
    changes: dict[str, Any] = {}
    if "nic" in data:
        kind = str(data["nic"]).strip().lower()
        if kind not in NIC_KINDS:
            raise TopologyError(f"inter_node: nic must be one of {', '.join(NIC_KINDS)}, got {data['nic']!r}")
        changes["nic"] = kind
    if "nic_speed" in data:
        changes["nic_bandwidth"] = parse_rate(data["nic_speed"], "inter_node.nic_speed")
    if "nics_per_node" in data:
        _check_int("inter_node.nics_per_node", data["nics_per_node"], 1, 64)
        changes["nics_per_node"] = data["nics_per_node"]
    if "rails" in data:
        changes["rails"] = _bool(data["rails"], "inter_node.rails")
    if "oversubscription" in data:
        ratio = data["oversubscription"]
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1.0 <= float(ratio) <= 64.0:
            raise TopologyError(f"inter_node: oversubscription is a ratio from 1 (non-blocking) to 64, got {ratio!r}")
        changes["oversubscription"] = float(ratio)
    if "nodes_per_leaf" in data:
        _check_int("inter_node.nodes_per_leaf", data["nodes_per_leaf"], 1, MAX_NODES)
        changes["nodes_per_leaf"] = data["nodes_per_leaf"]
    return dataclasses.replace(made, **changes)


def _slow_link(item: Any, cluster: Cluster) -> SlowLink:
    if not isinstance(item, Mapping) or set(item) != {"node", "nic_speed"}:
        raise TopologyError(f"slow_links: each entry is {{node: N, nic_speed: RATE}}, got {item!r}")
    _check_int("slow_links.node", item["node"], 0, cluster.nodes - 1)
    if cluster.network is None:
        raise TopologyError("slow_links: a one-node cluster has no network link to slow down")
    return SlowLink(item["node"], parse_rate(item["nic_speed"], "slow_links.nic_speed"))


def _checked(cluster: Cluster) -> Cluster:
    """Refuse what cannot be: several nodes without a network, NVLS without NVSwitch."""
    if cluster.nodes > 1 and cluster.network is None:
        raise TopologyError(f"cluster {cluster.name!r}: {cluster.nodes} nodes need an inter_node network")
    if cluster.fabric.nvls and cluster.fabric.fabric != "nvswitch":
        raise TopologyError("intra_node: nvls (NVLink SHARP) needs fabric: nvswitch")
    for slow in cluster.slow_links:
        if slow.node >= cluster.nodes:
            raise TopologyError(f"slow_links: node {slow.node} is not one of the {cluster.nodes} nodes (0-based)")
    return cluster


def _only(data: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = [k for k in data if k not in keys]
    if unknown:
        raise TopologyError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; valid: {', '.join(keys)}")


def _listed(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise TopologyError(f"{where} must be a list, got {value!r}")
    return value


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise TopologyError(f"cluster: {name} must be an integer from {low} to {high}, got {value!r}")


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TopologyError(f"{name} must be true or false, got {value!r}")
    return value


# ------------------------------------------------------------------------------------- text
def describe(cluster: Cluster) -> str:
    """What a run assumes, as ``gpemu topo`` prints it."""
    f, net = cluster.fabric, cluster.network
    sheet = find_gpu(cluster.gpu)
    gpu = sheet.name if sheet is not None else cluster.gpu
    size = f"{cluster.nodes} node(s) x {cluster.gpus_per_node} {gpu} = {cluster.world_size} GPUs"
    lines = [f"cluster {cluster.name}: {size}"]
    if f.fabric == "nvswitch":
        inside = f"NVSwitch, NVLink {f.nvlink_generation} at {format_rate(f.link_bandwidth)} per GPU and direction"
        inside += ", NVLS (in-switch reduction)" if f.nvls else ""
    else:
        how = "peer to peer" if f.p2p else "no peer to peer: through host memory"
        bridge = "NVLink bridges join pairs; " if f.fabric == "nvlink-bridge" else ""
        inside = (
            f"{bridge}PCIe at {format_rate(f.link_bandwidth)} per GPU and direction, "
            f"{f.gpus_per_pcie_switch} GPUs per PCIe switch ({how})"
        )
    lines.append(f"  inside a node   {inside}")
    if net is not None:
        tree = (
            "non-blocking"
            if net.oversubscription == 1.0
            else f"{net.oversubscription:g}:1 oversubscribed above {net.nodes_per_leaf} nodes per leaf"
        )
        lines.append(
            f"  between nodes   {net.nics_per_node} x {format_rate(net.nic_bandwidth, bits=True)} {net.nic.upper()}"
            f" per node ({format_rate(net.node_bandwidth)} per node), {'rails, ' if net.rails else ''}{tree}"
        )
    for slow in cluster.slow_links:
        lines.append(f"  slow link       node {slow.node}: NICs at {format_rate(slow.nic_bandwidth, bits=True)}")
    lines.append(f"  overlap         communication beside computation: exponent k = {cluster.overlap_k:g}")
    return "\n".join(lines)

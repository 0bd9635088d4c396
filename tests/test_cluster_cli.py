"""The cluster's ways in: `gpemu topo`, `gpemu comm-bench`, `gpemu run --cluster/--nodes`, the
configuration (a YAML file or a preset; the GPUs it has; the node this process is on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpemu.cli import main
from gpemu.config import ConfigError, EmuConfig
from gpemu.launcher import build_config, child_env


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_topo_prints_the_cluster_and_what_an_all_reduce_costs(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["topo", "--cluster", "dgx-h100", "--nodes", "2"], capsys)
    assert rc == 0
    assert "2 node(s) x 8 NVIDIA H100 80GB HBM3 = 16 GPUs" in out and "NVLS" in out
    assert "8 x 400 Gb/s IB per node" in out and "every GPU" in out and "nvls_tree/Simple" in out
    rc, out, _ = _run(["topo", "--gpu", "V100", "--gpus-per-node", "4"], capsys)
    assert rc == 0 and "PCIe" in out and "presets: a10g-pcie" in out


def test_comm_bench_prints_nccl_tests_columns(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(
        ["comm-bench", "--cluster", "dgx-a100", "-b", "1M", "-e", "8M", "--op", "all_reduce,all_gather"], capsys
    )
    assert rc == 0
    header = next(line for line in out.splitlines() if "busbw" in line).split()
    assert header[1:9] == ["size", "count", "type", "redop", "root", "time", "algbw", "busbw"]
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert [r[0] for r in rows] == ["1048576", "2097152", "4194304", "8388608"] * 2
    reduce_rows, gather_rows = rows[:4], rows[4:]
    assert reduce_rows[0][1] == str((1 << 20) // 4) and gather_rows[0][1] == str((1 << 20) // 4 // 8)  # per rank
    for r in reduce_rows:  # busbw = algbw x 2(n-1)/n for an all-reduce over 8 ranks
        assert float(r[7]) == pytest.approx(float(r[6]) * 2 * 7 / 8, rel=0.01)
    assert float(reduce_rows[-1][7]) > float(reduce_rows[0][7])  # bandwidth ramps with the size
    assert out.count("# Avg bus bandwidth") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["comm-bench", "--op", "allreduce"], "--op must name nccl-tests operations (all_reduce"),
        (["comm-bench", "-b", "1X"], "-b/--minbytes must be a byte count like 8, 64K, 1M or 8G"),
        (["comm-bench", "-b", "8G", "-e", "1M"], "sizes must grow"),
        (["comm-bench", "--cluster", "dgx-a100", "--ranks", "9"], "--ranks must be from 1 to the cluster's 8 GPUs"),
        (["topo", "--cluster", "dgx-h999"], "unknown cluster preset 'dgx-h999'"),
        (["topo", "--cluster", "dgx-a100", "--gpu", "A100"], "--gpu and --gpus-per-node describe a cluster"),
        (["topo", "--nodes", "0"], "--nodes must be an integer >= 1"),
    ],
)
def test_bad_cluster_input_is_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_yaml_cluster_configures_the_run(tmp_path: Path) -> None:
    described = tmp_path / "lab.yaml"
    described.write_text(
        "name: lab\ngpu: A100\ngpus_per_node: 4\nnodes: 2\n"
        "inter_node: {nic: roce, nic_speed: 100Gb/s, nics_per_node: 2}\n"
        "slow_links:\n  - {node: 1, nic_speed: 10Gb/s}\n"
    )
    config = build_config(cluster=str(described))
    cluster = config.described_cluster()
    assert cluster is not None and cluster.name == "lab" and cluster.nodes == 2
    assert config.gpu == "A100" and config.num_gpus == 4  # the cluster's GPUs, a node's worth per process
    env = child_env(config, base={})
    assert env["GPEMU_CLUSTER"] == str(described) and env["GPEMU_GPU"] == "A100"
    assert EmuConfig.from_env(env).described_cluster() == cluster  # children describe the same cluster
    assert build_config(cluster=str(described), nodes=3).described_cluster().nodes == 3  # type: ignore[union-attr]
    # torchrun tells its workers their node (GROUP_RANK); GPEMU_NODE_RANK wins over it
    assert EmuConfig.from_env({**env, "GROUP_RANK": "1"}).node_rank == 1
    assert EmuConfig.from_env({**env, "GROUP_RANK": "1", "GPEMU_NODE_RANK": "0"}).node_rank == 0


@pytest.mark.parametrize(
    ("text", "settings", "message"),
    [
        ("gpu: A100\nnodes: [1\n", {}, "is not valid YAML at line 3"),
        ("gpu: A100\nintra_node: {fabric: pcie, nvls: true}\n", {}, "lab.yaml: intra_node: nvls"),
        ("preset: dgx-h100\n", {"gpu": "A100"}, "has H100 GPUs but gpu is 'A100'"),
        ("preset: dgx-h100\nnodes: 2\n", {"node_rank": 2}, "node_rank 2 is not one of the cluster's 2 node(s)"),
    ],
)
def test_bad_cluster_files_say_what_is_wrong(tmp_path: Path, text: str, settings: dict, message: str) -> None:
    described = tmp_path / "lab.yaml"
    described.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config(cluster=str(described), **settings)
    with pytest.raises(ConfigError, match="cannot be read"):
        build_config(cluster=str(tmp_path / "missing.yaml"))

"""k8s/*.yaml against the Kubernetes OpenAPI schemas (offline, kubernetes-validate), the
manifests' gpemu commands against the real CLI, and a structural lint of k8s/Dockerfile."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import yaml

K8S = Path(__file__).resolve().parent.parent / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
# Oldest and newest Kubernetes minor versions the manifests are meant for.
VERSIONS = ("1.28.0", "1.33.0")


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def _pod_specs() -> list[tuple[str, dict]]:
    out = []
    for name, doc in _docs():
        if doc["kind"] in ("DaemonSet", "Job", "Deployment"):
            out.append((f"{name}:{doc['metadata']['name']}", doc["spec"]["template"]["spec"]))
    return out


def test_expected_manifests_exist():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in _docs()}
    for needed in [("DaemonSet", "gpemu-device-plugin"), ("DaemonSet", "gpemu-sharing"),
                   ("ConfigMap", "gpemu-device-plugin-config"), ("Job", "emugpu-train"),
                   ("ServiceAccount", "gpemu-device-plugin"), ("Namespace", "gpemu-system")]:
        assert needed in kinds


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version):
    import kubernetes_validate

    docs = _docs()
    assert len(docs) >= 8
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']} invalid for {version}: {exc.message}")


def test_validator_rejects_a_broken_manifest():
    # Guards against a validator that accepts anything.
    import kubernetes_validate

    name, ds = next((n, d) for n, d in _docs() if d["kind"] == "DaemonSet")
    broken = yaml.safe_load(yaml.safe_dump(ds))
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] = 42
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_device_plugin_daemonset_mounts_kubelet_and_emugpu_dirs():
    ds = next(d for _, d in _docs() if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpemu-device-plugin")
    spec = ds["spec"]["template"]["spec"]
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert {"/var/lib/kubelet/device-plugins", "/var/lib/gpemu/devices"} <= host_paths
    init = spec["initContainers"][0]["command"]
    assert init[:5] == ["gpemu", "k8s", "devices", "create", "--replace"]


def test_config_map_is_a_valid_plugin_config(tmp_path):
    from gpemu.k8s.plugin import load_plugin_config

    cm = next(d for _, d in _docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpemu-device-plugin-config")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    opts = load_plugin_config(path)
    assert opts.resource_name == "gpemu.io/emugpu" and opts.replicas >= 1
    assert int(cm["data"]["EMUGPU_COUNT"]) >= 1


def test_example_job_requests_two_emugpus():
    job = next(d for _, d in _docs() if d["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"gpemu.io/emugpu": 2}
    assert container["command"][:3] == ["gpemu", "run", "--"]


def test_referenced_config_maps_and_secrets_exist():
    defined = {(d["kind"], d["metadata"].get("namespace", "default"), d["metadata"]["name"]): d for _, d in _docs()}
    namespaces = {d["metadata"]["name"] for _, d in _docs() if d["kind"] == "Namespace"}
    for name, doc in _docs():
        if doc["kind"] not in ("DaemonSet", "Job"):
            continue
        ns = doc["metadata"].get("namespace", "default")
        assert ns == "default" or ns in namespaces, name
        spec = doc["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {})
                for key, kind, field in (("configMapKeyRef", "ConfigMap", "data"), ("secretKeyRef", "Secret", "stringData")):
                    if key in ref:
                        target = defined.get((kind, ns, ref[key]["name"]))
                        assert target is not None, f"{name}: {kind} {ref[key]['name']} not defined in {ns}"
                        assert ref[key]["key"] in target[field], f"{name}: key {ref[key]['key']} missing"
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                assert ("ConfigMap", ns, vol["configMap"]["name"]) in defined
        if "serviceAccountName" in spec:
            assert ("ServiceAccount", ns, spec["serviceAccountName"]) in defined


def test_gpemu_commands_in_manifests_parse_with_the_real_cli():
    """Every `gpemu ...` container command must be accepted by the CLI's option parser."""
    from gpemu.cli import cli

    checked = 0
    for name, spec in _pod_specs():
        for c in spec.get("initContainers", []) + spec["containers"]:
            cmd = c.get("command", [])
            if not cmd or cmd[0] != "gpemu":
                continue
            # $(VAR) is expanded by Kubernetes; give plausible values.
            args = [a.replace("$(EMUGPU_COUNT)", "8").replace("$(EMUGPU_MODEL)", "V100") for a in cmd[1:]]
            cmd_obj: click.Command = cli
            ctx = click.Context(cli, info_name="gpemu", obj={})
            while isinstance(cmd_obj, click.Group):
                sub, args = args[0], args[1:]
                found = cmd_obj.get_command(ctx, sub)
                assert found is not None, f"{name}: no command {sub!r} in {' '.join(cmd)}"
                cmd_obj, ctx = found, click.Context(found, info_name=sub, parent=ctx, obj={})
            cmd_obj.make_context(ctx.info_name, args, parent=ctx.parent)  # raises click.UsageError on bad options
            checked += 1
    assert checked >= 3


def test_dockerfile_structure():
    from dockerfile_parse import DockerfileParser

    df = DockerfileParser(path=str(K8S / "Dockerfile"))
    assert df.baseimage == "python:3.11-slim"
    known = {"FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "CMD", "ENTRYPOINT", "LABEL", "ARG", "COMMENT"}
    instructions = [item["instruction"] for item in df.structure]
    assert set(instructions) <= known, set(instructions) - known
    runs = " ".join(item["value"] for item in df.structure if item["instruction"] == "RUN")
    assert "torch==2.13.0" in runs and "download.pytorch.org/whl/cpu" in runs
    assert "pip install /src" in runs
    assert "apt-get install" not in runs or "--no-install-recommends" in runs
    copy_at = instructions.index("COPY")
    torch_at = next(i for i, item in enumerate(df.structure) if "torch==" in item["value"])
    assert torch_at < copy_at, "install torch before COPY so source edits keep the torch layer cached"
    users = [item["value"] for item in df.structure if item["instruction"] == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image should not run as root by default"
    assert "CMD" in instructions or "ENTRYPOINT" in instructions

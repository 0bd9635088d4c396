"""k8s/*.yaml against the Kubernetes OpenAPI schemas (offline, kubernetes-validate), the
manifests' gpemu commands against the real CLI, and a structural lint of k8s/Dockerfile."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import yaml

K8S = Path(__file__).resolve().parent.parent / "k8s"
# Kubernetes objects; kustomization.yaml is kustomize's own file (checked on its own below).
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
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
    for needed in [
        ("DaemonSet", "gpemu-device-plugin"),
        ("DaemonSet", "gpemu-sharing"),
        ("ConfigMap", "gpemu-device-plugin-config"),
        ("Job", "emugpu-train"),
        ("ServiceAccount", "gpemu-device-plugin"),
        ("Namespace", "gpemu-system"),
    ]:
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
    assert {
        "/var/lib/kubelet/device-plugins",
        "/var/lib/gpemu/devices",
        "/var/lib/gpemu/secrets",
        "/var/lib/gpemu/credentials",
    } <= host_paths
    inits = [c["command"] for c in spec["initContainers"]]
    assert inits[0][:3] == ["gpemu", "k8s", "secrets"]
    assert inits[1][:5] == ["gpemu", "k8s", "devices", "create", "--replace"]


def test_config_map_is_a_valid_plugin_config(tmp_path):
    from gpemu.k8s.plugin import load_plugin_config

    cm = next(
        d for _, d in _docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpemu-device-plugin-config"
    )
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
                for key, kind, field in (
                    ("configMapKeyRef", "ConfigMap", "data"),
                    ("secretKeyRef", "Secret", "stringData"),
                ):
                    if key in ref:
                        target = defined.get((kind, ns, ref[key]["name"]))
                        assert target is not None, f"{name}: {kind} {ref[key]['name']} not defined in {ns}"
                        assert ref[key]["key"] in target[field], f"{name}: key {ref[key]['key']} missing"
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                assert ("ConfigMap", ns, vol["configMap"]["name"]) in defined
        if "serviceAccountName" in spec:
            assert ("ServiceAccount", ns, spec["serviceAccountName"]) in defined


def _commands(c: dict) -> list[list[str]]:
    """A container's command and its probes' commands."""
    out = [c.get("command", [])]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        out.append(c.get(probe, {}).get("exec", {}).get("command", []))
    return [cmd for cmd in out if cmd]


def test_gpemu_commands_in_manifests_parse_with_the_real_cli():
    """Every `gpemu ...` container and probe command must be accepted by the CLI's option parser."""
    from gpemu.cli import cli

    checked = 0
    for name, spec in _pod_specs():
        for cmd in [cmd for c in spec.get("initContainers", []) + spec["containers"] for cmd in _commands(c)]:
            if cmd[0] != "gpemu":
                continue
            # $(VAR) is expanded by Kubernetes; give plausible values.
            args = [
                a.replace("$(EMUGPU_COUNT)", "8").replace("$(EMUGPU_MODEL)", "V100").replace("$(NODE_IP)", "10.0.0.5")
                for a in cmd[1:]
            ]
            cmd_obj: click.Command = cli
            ctx = click.Context(cli, info_name="gpemu", obj={})
            while isinstance(cmd_obj, click.Group):
                sub, args = args[0], args[1:]
                found = cmd_obj.get_command(ctx, sub)
                assert found is not None, f"{name}: no command {sub!r} in {' '.join(cmd)}"
                cmd_obj, ctx = found, click.Context(found, info_name=sub, parent=ctx, obj={})
            cmd_obj.make_context(ctx.info_name, args, parent=ctx.parent)  # raises click.UsageError on bad options
            checked += 1
    assert checked >= 7


def test_long_running_containers_have_liveness_probes():
    for name, spec in _pod_specs():
        if name.startswith("example-training-job"):
            continue
        for c in spec["containers"]:
            probe = c.get("livenessProbe")
            assert probe and probe.get("exec", {}).get("command"), f"{name}/{c['name']} has no liveness probe"
            assert probe["timeoutSeconds"] < probe["periodSeconds"]


def test_no_secret_is_committed_or_put_on_a_command_line():
    import re

    for name, doc in _docs():
        assert doc["kind"] != "Secret", f"{name} commits a Secret ({doc['metadata']['name']})"
    text = "\n".join(p.read_text() for p in K8S.glob("*.yaml"))
    assert "change-me" not in text and "RABBITMQ_DEFAULT_PASS" not in text
    for url in re.findall(r"amqps?://[^\s\"']+", text):
        assert not re.match(r"amqps?://[^/@]*:[^/@]*@", url), f"a password in {url}"
    assert "--amqp-password-file" in text and "--sharing-password-file" in text and "--job-secret-file" in text


def _images() -> list[tuple[str, str]]:
    return [
        (name, c["image"]) for name, spec in _pod_specs() for c in spec.get("initContainers", []) + spec["containers"]
    ]


def test_images_are_pinned_to_full_versions_and_listed_for_kustomize():
    import re

    for name, image in _images():
        repo, _, tag = image.partition("@")[0].rpartition(":")
        assert "@sha256:" in image or re.fullmatch(r"\d+\.\d+\.\d+", tag), f"{name}: {image} is a mutable tag"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    pinned = {entry["name"]: entry for entry in kustomization["images"]}
    for name, image in _images():
        repo, tag = image.rsplit(":", 1)
        if name.startswith("example-training-job"):
            continue
        assert repo in pinned and pinned[repo].get("newTag", tag) == tag, f"{image} not pinned in kustomization.yaml"
    node_files = {p.name for p in MANIFESTS if p.name != "example-training-job.yaml"}
    assert set(kustomization["resources"]) == node_files


def test_dockerfile_structure():
    import re

    from dockerfile_parse import DockerfileParser

    df = DockerfileParser(path=str(K8S / "Dockerfile"))
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", df.baseimage), df.baseimage  # a full version
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
    # Nothing world-writable: no chmod granting "other" write, no 777/666 modes.
    assert not re.search(r"chmod\s+(-R\s+)?(a\+[rwxX]*w|o\+[rwxX]*w|[0-7]?[0-7][0-7][2367]\b)", runs), runs


def test_no_plain_amqp_on_a_host_port_and_every_container_is_confined():
    """The broker is reached through a node-local Service, not a hostPort; every container drops
    every capability and cannot gain privileges; the broker does not run as root."""
    for name, spec in _pod_specs():
        assert not spec.get("hostNetwork"), name
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert all("hostPort" not in port for port in c.get("ports", [])), (name, c["name"])
            sc = c.get("securityContext") or {}
            assert sc.get("allowPrivilegeEscalation") is False and sc.get("capabilities") == {"drop": ["ALL"]}, (
                name,
                c["name"],
            )
            assert not sc.get("privileged"), (name, c["name"])
            if c["name"] == "rabbitmq":
                assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0
    services = [d for _, d in _docs() if d["kind"] == "Service"]
    broker = next(d for d in services if d["metadata"]["name"] == "gpemu-sharing")
    assert broker["spec"]["internalTrafficPolicy"] == "Local" and broker["spec"].get("type", "ClusterIP") == "ClusterIP"

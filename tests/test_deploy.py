"""The deploy/ manifests: every overlay builds with kustomize, validates against the Kubernetes schema
offline, and its DaemonSet mounts, probes, flags and security context are what deploy/README.md says;
and the least-privilege claim itself (UID 0, no capabilities) is proven on this machine."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from densedev import cli
from densedev.model import Config, PoolApi
from densedev.ops.metrics import parse_addr
from densedev.pools import config

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
TARGETS = ["base", *(f"overlays/{name}" for name in OVERLAYS)]
# recursiveReadOnly (on the /sys mount) needs Kubernetes 1.30; validate there and on the newest schema.
K8S_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
# The DRA overlay's DeviceClass is resource.k8s.io/v1, served from Kubernetes 1.34.
OLDEST = {"overlays/dra": "1.34"}

KUBELET_DIR = "/var/lib/kubelet/device-plugins"
CDI_DIR = "/var/run/cdi"
DEVINFO_DIR = "/var/run/k8s.cni.cncf.io/devinfo/dp"
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"
PLUGINS_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DRA_PLUGIN_DIR = "/var/lib/kubelet/plugins/net.densedev.io"  # the kubelet's plugins dir / draDriverName

# What each target must mount: container path → (host path, read-only).  Nothing else may appear.
BASE_MOUNTS = {
    KUBELET_DIR: (KUBELET_DIR, False),  # sockets are created here
    POD_RESOURCES_DIR: (POD_RESOURCES_DIR, True),  # the PodResources socket is only connected to
    "/sys": ("/sys", True),
}
EXTRA_MOUNTS: dict[str, dict[str, tuple[str, bool]]] = {
    "cdi": {CDI_DIR: (CDI_DIR, False)},
    "devinfo": {DEVINFO_DIR: (DEVINFO_DIR, False)},
    "metrics": {},
    "rdma": {"/dev/infiniband": ("/dev/infiniband", True), DEVINFO_DIR: (DEVINFO_DIR, False)},
    "vfio": {"/dev/vfio": ("/dev/vfio", True)},
    "full": {CDI_DIR: (CDI_DIR, False), DEVINFO_DIR: (DEVINFO_DIR, False), "/host/dev": ("/dev", True)},
    "dra": {
        CDI_DIR: (CDI_DIR, False),
        PLUGINS_REGISTRY_DIR: (PLUGINS_REGISTRY_DIR, False),  # <driver>-reg.sock is created here
        DRA_PLUGIN_DIR: (DRA_PLUGIN_DIR, False),  # dra.sock and the claims checkpoint
    },
}
# Directories densedev may create on the host (its own); the kubelet's must exist, or the node is wrong.
CREATED_DIRS = (CDI_DIR, DEVINFO_DIR, DRA_PLUGIN_DIR)


@cache
def build(target: str) -> tuple[dict[str, Any], ...]:
    """Run ``kubectl kustomize`` on a deploy/ directory and return its objects."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot build the kustomizations (install kubectl >= 1.27)")
    proc = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / target)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"kubectl kustomize {target} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def one(objs: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_spec(objs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return one(objs, "DaemonSet")["spec"]["template"]["spec"]


def container(objs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    [c] = pod_spec(objs)["containers"]
    return c


def overlay_name(target: str) -> str:
    return target.rsplit("/", 1)[-1]


def expected_mounts(target: str) -> dict[str, tuple[str, bool]]:
    return {**BASE_MOUNTS, **EXTRA_MOUNTS.get(overlay_name(target), {})}


def host_mounts(objs: tuple[dict[str, Any], ...]) -> dict[str, tuple[str, bool]]:
    """Return container path → (host path, read-only) for every hostPath volume mount."""
    spec = pod_spec(objs)
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    out: dict[str, tuple[str, bool]] = {}
    for m in container(objs)["volumeMounts"]:
        if m["name"] in host:
            out[m["mountPath"]] = (host[m["name"]], bool(m.get("readOnly", False)))
    return out


def run_args(objs: tuple[dict[str, Any], ...]) -> Any:
    """Parse the container's command line with the daemon's real argument parser."""
    c = container(objs)
    assert c["command"] == ["densedev"]
    return cli.build_parser().parse_args(c["args"])


def test_every_overlay_is_tested() -> None:
    assert set(OVERLAYS) == set(EXTRA_MOUNTS), "add the new overlay's mounts to EXTRA_MOUNTS"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_validate_against_the_kubernetes_schema(target: str, version: str) -> None:
    objs = build(target)
    if version == K8S_VERSIONS[0]:
        version = OLDEST.get(target, version)
    assert {o["kind"] for o in objs} >= {"DaemonSet", "ServiceAccount", "ConfigMap"}
    for obj in objs:
        # strict: unknown fields are errors, as `kubectl apply --validate=strict` makes them.
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_catches_mistakes() -> None:
    ds = one(build("base"), "DaemonSet")
    typo = copy.deepcopy(ds)
    typo["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountpath"] = "/x"
    wrong_type = copy.deepcopy(ds)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["drop"] = "ALL"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.ValidationError, match="recursiveReadOnly"):
        kubernetes_validate.validate(ds, "1.29", strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_mounts_are_exactly_what_is_needed(target: str) -> None:
    objs = build(target)
    assert host_mounts(objs) == expected_mounts(target)
    spec = pod_spec(objs)
    mounted = {m["name"] for m in container(objs)["volumeMounts"]}
    assert mounted == {v["name"] for v in spec["volumes"]}, "a volume is declared but not mounted"
    by_path = {m["mountPath"]: m for m in container(objs)["volumeMounts"]}
    assert by_path["/sys"].get("recursiveReadOnly") == "IfPossible"
    if "/host/dev" in by_path:
        assert by_path["/host/dev"].get("recursiveReadOnly") == "IfPossible"
    cfg = by_path["/etc/densedev"]
    assert cfg["readOnly"] is True
    assert "subPath" not in cfg, "a subPath mount never sees ConfigMap updates: config reload would break"
    types = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in spec["volumes"] if "hostPath" in v}
    # The kubelet's dirs and /sys must already exist (a missing one means a wrong node, not ours to
    # make); the CDI and device-info dirs and the DRA driver's own dir are ours to create.
    for path, kind in types.items():
        assert kind == ("DirectoryOrCreate" if path in CREATED_DIRS else "Directory"), path


@pytest.mark.parametrize("target", TARGETS)
def test_flags_agree_with_mounts(target: str) -> None:
    objs = build(target)
    args = run_args(objs)
    mounts = host_mounts(objs)
    name = overlay_name(target)
    assert args.command == "run"
    assert str(args.sysfs_root) == "/sys" and mounts["/sys"] == ("/sys", True)
    assert str(args.kubelet_dir) == KUBELET_DIR and mounts[KUBELET_DIR] == (KUBELET_DIR, False)
    assert args.pod_resources_socket == Path(POD_RESOURCES_DIR) / "kubelet.sock"
    assert mounts[POD_RESOURCES_DIR] == (POD_RESOURCES_DIR, True)
    # CDI and device-info are off unless their component is applied; when on, the dir is the host's.
    wants_cdi = name in ("cdi", "full", "dra")  # DRA hands claims to the runtime as CDI devices
    assert args.cdi_dir == (Path(CDI_DIR) if wants_cdi else None)
    wants_devinfo = name in ("devinfo", "rdma", "full")
    assert str(args.devinfo_dir) == (DEVINFO_DIR if wants_devinfo else ".")
    if wants_cdi:
        assert mounts[CDI_DIR] == (CDI_DIR, False)
    if wants_devinfo:
        assert mounts[DEVINFO_DIR] == (DEVINFO_DIR, False)
    # dev-root is where densedev checks device nodes exist; it must show the host's nodes it checks.
    if name == "full":
        assert str(args.dev_root) == "/host/dev" and mounts["/host/dev"] == ("/dev", True)
    else:
        assert str(args.dev_root) == "/dev"
    assert args.log_format == "kv" and args.log_level == "info"
    host, port = parse_addr(args.metrics_addr)
    assert port == 9477
    # Never every address of the node (the pod is on the host network): loopback, or with the metrics
    # component the pod IP, which on the host network is the node's address in the cluster.
    assert host == ("$(POD_IP)" if name in ("metrics", "full") else "127.0.0.1")


def env_var(objs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    [var] = [v for v in container(objs).get("env", []) if v["name"] == name]
    return var


@pytest.mark.parametrize("target", TARGETS)
def test_variables_in_args_are_the_containers_own(target: str) -> None:
    # The kubelet expands $(NAME) in args only for a NAME in the container's env; any other is passed
    # on verbatim, and --metrics-addr=[$(POD_IP)]:9477 would then fail to bind.
    objs = build(target)
    names = {v["name"] for v in container(objs).get("env", [])}
    for arg in container(objs)["args"]:
        for part in arg.split("$(")[1:]:
            assert part.split(")", 1)[0] in names, arg


@pytest.mark.parametrize("target", ["overlays/metrics", "overlays/full"])
@pytest.mark.parametrize("pod_ip", ["10.0.0.5", "fd00:10::5"])
def test_metrics_bind_the_pod_ip_of_either_family(target: str, pod_ip: str) -> None:
    objs = build(target)
    assert env_var(objs, "POD_IP")["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    expanded = run_args(objs).metrics_addr.replace("$(POD_IP)", pod_ip)
    assert parse_addr(expanded) == (pod_ip, 9477)


@pytest.mark.parametrize("target", TARGETS)
def test_probes_hit_the_health_endpoints(target: str) -> None:
    objs = build(target)
    c = container(objs)
    host, port = parse_addr(run_args(objs).metrics_addr)
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        # The pod is on the host network: 127.0.0.1 is the node's loopback, where the base binds; with
        # the metrics component the daemon binds the pod IP, which the kubelet probes when no host is set.
        assert (get.get("host", "$(POD_IP)"), get["port"]) == (host, port), probe
        paths[probe] = get["path"]
    assert paths == {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}


@pytest.mark.parametrize("target", TARGETS)
def test_security_context_is_least_privilege(target: str) -> None:
    objs = build(target)
    spec = pod_spec(objs)
    c = container(objs)
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}, (
        "add back a capability only with proof in deploy/README.md"
    )
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc.get("privileged", False) is False
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["securityContext"]["runAsUser"] == 0  # see test_root_without_capabilities_is_enough
    assert spec["hostNetwork"] is True
    assert not spec.get("hostPID") and not spec.get("hostIPC")
    assert spec["priorityClassName"] == "system-node-critical"
    # API-server credentials only where DRA publishes ResourceSlices, and then with the RBAC for it.
    api = overlay_name(target) == "dra"
    assert spec["automountServiceAccountToken"] is api
    sa = one(objs, "ServiceAccount")
    assert spec["serviceAccountName"] == sa["metadata"]["name"]
    assert sa["automountServiceAccountToken"] is api
    assert bool([o for o in objs if o["kind"] == "ClusterRoleBinding"]) is api
    res = c["resources"]
    assert set(res["requests"]) == set(res["limits"]) == {"cpu", "memory"}


@pytest.mark.parametrize("target", TARGETS)
def test_config_map_holds_a_valid_config_where_the_daemon_reads_it(target: str) -> None:
    objs = build(target)
    cm = one(objs, "ConfigMap")
    spec = pod_spec(objs)
    [vol] = [v for v in spec["volumes"] if "configMap" in v]
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    # A hash-suffixed name would restart every pod on a config edit instead of letting it reload.
    assert cm["metadata"]["name"] == "densedev-config"
    [mount] = [m for m in container(objs)["volumeMounts"] if m["name"] == vol["name"]]
    cfg_path = run_args(objs).config
    assert cfg_path.parent == Path(mount["mountPath"])
    text = cm["data"][cfg_path.name]
    parsed = config.parse(text, source=f"{target}/config.json")
    assert parsed.pools
    rdma = [p for p in parsed.pools if any(s.is_rdma for s in p.selectors) or p.rdma_shared]
    vfio = [p for p in parsed.pools if any("vfio-pci" in s.drivers for s in p.selectors)]
    mounts = host_mounts(objs)
    # Pools whose devices need nodes under /dev only in overlays that let densedev see them.
    if rdma:
        assert "/dev/infiniband" in mounts or "/host/dev" in mounts, target
    if vfio:
        assert "/dev/vfio" in mounts or "/host/dev" in mounts, target
    # DRA pools only where the pod can reach the kubelet's plugin watcher and the API server.
    if any(p.api is PoolApi.DRA for p in parsed.pools):
        assert PLUGINS_REGISTRY_DIR in mounts and spec["automountServiceAccountToken"] is True, target


CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "DeviceClass"}


def test_namespace_is_left_to_the_user() -> None:
    for target in TARGETS:
        objs = build(target)
        namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] not in CLUSTER_SCOPED}
        wanted = "kube-system" if overlay_name(target) in ("full", "dra") else None
        assert namespaces == {wanted}, target
        # kustomize stamps `namespace:` even on kinds it does not know are cluster-scoped (DeviceClass).
        assert all("namespace" not in o["metadata"] for o in objs if o["kind"] in CLUSTER_SCOPED), target


@pytest.mark.parametrize("target", ["overlays/metrics", "overlays/full"])
def test_metrics_component_exposes_the_port(target: str) -> None:
    objs = build(target)
    c = container(objs)
    assert {"name": "metrics", "containerPort": 9477, "protocol": "TCP"} in c["ports"]
    svc = one(objs, "Service")
    labels = one(objs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"


def test_base_does_not_expose_metrics_beyond_loopback() -> None:
    objs = build("base")
    assert "ports" not in container(objs)
    assert not [o for o in objs if o["kind"] == "Service"]


# ------------------------------------------------------------------------------------- DRA


def dra_config(objs: tuple[dict[str, Any], ...]) -> Config:
    """Return the config the DRA overlay's ConfigMap holds, parsed by densedev's loader."""
    text = one(objs, "ConfigMap")["data"][run_args(objs).config.name]
    return config.parse(text, source="overlays/dra/config.json")


def test_dra_overlay_serves_the_kubelet_where_it_looks() -> None:
    objs = build("overlays/dra")
    cfg = dra_config(objs)
    assert [p.full_name for p in cfg.pools if p.api is PoolApi.DRA] == ["intel.com/intel_sriov_netdevice"]
    assert any(p.api is PoolApi.DEVICE_PLUGIN for p in cfg.pools), "the overlay shows both APIs side by side"
    args = run_args(objs)
    mounts = host_mounts(objs)
    # The kubelet dials the DRA socket at the path the plugin names in GetInfo, a path of the
    # container: the driver's directory must be mounted at its host path, under the flag's dir.
    plugin_dir = args.kubelet_plugins_dir / cfg.dra_driver_name
    assert mounts[str(plugin_dir)] == (str(plugin_dir), False)
    assert str(plugin_dir) == DRA_PLUGIN_DIR
    # Only the driver's own directory: the rest of the plugins dir holds other drivers' sockets.
    assert str(args.kubelet_plugins_dir) not in mounts
    # The plugin watcher finds <driver>-reg.sock by inotify in its registry, which must be the host's.
    registry = str(args.kubelet_registry_dir)
    assert registry == PLUGINS_REGISTRY_DIR and mounts[registry] == (registry, False)
    assert mounts[str(args.cdi_dir)] == (str(args.cdi_dir), False)
    # --node-name defaults to $NODE_NAME: the node the pod runs on, from the downward API.
    env = {e["name"]: e for e in container(objs)["env"]}
    assert env["NODE_NAME"] == {
        "name": "NODE_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
    }
    assert "--node-name" not in " ".join(container(objs)["args"])
    assert args.kubeconfig is None, "in-cluster credentials: the ServiceAccount token the kubelet mounts"


def kind_and_name(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def test_dra_overlay_agrees_with_dra_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The DeviceClasses and the RBAC in the overlay are what `densedev dra-manifests` prints for the
    # overlay's own config, bound to the DaemonSet's ServiceAccount in the DaemonSet's namespace.
    objs = build("overlays/dra")
    ds = one(objs, "DaemonSet")
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(one(objs, "ConfigMap")["data"]["config.json"])
    argv = ["dra-manifests", "--config", str(cfg_file), "--namespace", ds["metadata"]["namespace"]]
    argv += ["--service-account", pod_spec(objs)["serviceAccountName"]]
    capsys.readouterr()
    assert cli.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)["items"]
    kinds = {"DeviceClass", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    in_overlay = [o for o in objs if o["kind"] in kinds]
    assert sorted(in_overlay, key=kind_and_name) == sorted(printed, key=kind_and_name)
    assert {o["kind"] for o in printed} == {"DeviceClass", "ClusterRole", "ClusterRoleBinding"}


# ------------------------------------------------------------------------------------- image


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_is_multi_stage_and_runs_the_daemon() -> None:
    text = dockerfile()
    stages = [line.split() for line in text.splitlines() if line.upper().startswith("FROM ")]
    assert len(stages) == 2 and stages[0][-2:] == ["AS", "build"]
    assert "pip wheel" in text and "--no-index" in text
    # The build proves the wheel carries the extension instead of silently falling back to the twin.
    assert "IMPLEMENTATION" in text
    entry = next(line for line in text.splitlines() if line.startswith("ENTRYPOINT"))
    cmd = next(line for line in text.splitlines() if line.startswith("CMD"))
    assert json.loads(entry.split(None, 1)[1]) == ["densedev"]
    assert json.loads(cmd.split(None, 1)[1]) == ["run"]  # the config is found (cli.DEFAULT_CONFIGS)
    assert str(run_args(build("base")).config) == "/etc/densedev/config.json"


def test_dockerignore_keeps_build_outputs_out_of_the_context() -> None:
    patterns = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"
    }
    # A stale in-place .so or generated .c copied in would skip or confuse the wheel's real build.
    assert {".git", "**/*.so", "**/*.c", "build", "**/__pycache__"} <= patterns
    assert "src" not in patterns and "pyproject.toml" not in patterns


def stage_text(text: str) -> list[str]:
    """Return the Dockerfile's stages, each from its FROM line to the next."""
    stages: list[str] = []
    for line in text.splitlines():
        if line.upper().startswith("FROM "):
            stages.append("")
        if stages:
            stages[-1] += line + "\n"
    return stages


def test_build_and_runtime_stages_take_separate_bases() -> None:
    # The runtime needs no compiler or headers: a base without them can be given to that stage alone.
    build_stage, runtime_stage = stage_text(dockerfile())
    assert build_stage.startswith("FROM ${BUILD_IMAGE} AS build")
    assert runtime_stage.startswith("FROM ${RUNTIME_IMAGE}\n")
    assert "gcc" in build_stage and "gcc" not in runtime_stage
    assert "apt-get" not in runtime_stage


def test_image_carries_oci_labels_with_the_project_version() -> None:
    import tomllib

    text = dockerfile()
    _, runtime_stage = stage_text(text)
    for key in ("source", "version", "revision", "title", "licenses"):
        assert f"org.opencontainers.image.{key}=" in runtime_stage, key
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    # The default a plain `docker build` uses must be the version it builds.
    assert f"ARG VERSION={version}\n" in runtime_stage


@cache
def load_image_check() -> Any:
    """Import .ci/image_check.py, the container run CI performs (not a package: loaded by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("densedev_ci_image_check", ROOT / ".ci" / "image_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses resolve their annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def base_pod() -> dict[str, Any]:
    """Return the pod template of deploy/base/daemonset.yaml as the image check reads it."""
    pod: dict[str, Any] = load_image_check().daemonset_pod(DEPLOY / "base" / "daemonset.yaml")
    return pod


def image_run_args(pod: dict[str, Any], **kw: Any) -> list[str]:
    """Return the podman options and command the image check derives from ``pod``."""
    ic = load_image_check()
    names = ("device-plugins", "pod-resources", "sys", "config")
    volumes = {name: ic.Volume(Path(f"/node/{name}")) for name in names}
    args: list[str] = ic.container_args(
        pod,
        volumes,
        network="ns:/run/netns/node",
        mount_paths={"/sys": "/host/sys"},
        extra_args=["--sysfs-root=/host/sys"],
        **kw,
    )
    return args


def test_ci_runs_the_container_with_the_daemonsets_security_context() -> None:
    # CI's image run (.ci/image.sh -> .ci/image_check.py) derives podman's options from the manifest;
    # this pins the translation, so the run CI performs is the one the DaemonSet asks for.
    args = image_run_args(base_pod())
    split = args.index("--entrypoint=densedev") + 1
    options, command = args[:split], args[split:]
    assert set(options) == {
        "--network=ns:/run/netns/node",
        "--user=0:0",
        "--security-opt=no-new-privileges",
        "--read-only",
        "--read-only-tmpfs=false",  # podman's default tmpfs on /tmp, /run, /var/tmp: a pod has none
        "--cap-drop=ALL",
        "--env=PYTHONDONTWRITEBYTECODE=1",
        f"--memory={384 * 2**20}",
        "--cpus=1",
        f"--volume=/node/device-plugins:{KUBELET_DIR}:rw",
        "--volume=/node/pod-resources:/var/lib/kubelet/pod-resources:ro",
        "--volume=/node/sys:/host/sys:ro",
        "--volume=/node/config:/etc/densedev:ro",
        "--entrypoint=densedev",
    }
    # The manifest's own arguments, then the one override; the daemon's parser takes the last one.
    assert command[:-1] == container(build("base"))["args"]
    assert command[-1] == "--sysfs-root=/host/sys"
    # The parser checks that a sysfs root exists, and /host/sys exists only inside the container.
    parsed = cli.build_parser().parse_args(command[:-1])
    assert str(parsed.kubelet_dir) == KUBELET_DIR
    assert not parsed.no_netlink


@pytest.mark.parametrize(
    "change",
    [
        lambda pod: pod["containers"][0]["securityContext"].update(seLinuxOptions={"type": "spc_t"}),
        lambda pod: pod["securityContext"].update(seccompProfile={"type": "Unconfined"}),
        lambda pod: pod["securityContext"].update(sysctls=[]),
        lambda pod: pod.update(hostNetwork=False),
        lambda pod: pod.update(hostPID=True),
        lambda pod: pod["containers"][0]["volumeMounts"][2].update(subPath="config.json"),
        lambda pod: pod["containers"][0].update(lifecycle={}),
        lambda pod: pod["containers"][0].pop("command"),
    ],
    ids=["selinux", "seccomp", "sysctls", "pod-network", "host-pid", "subpath", "lifecycle", "no-command"],
)
def test_ci_refuses_a_manifest_it_cannot_reproduce(change: Any) -> None:
    # A DaemonSet field the container run would silently drop must fail CI instead.
    pod = copy.deepcopy(base_pod())
    change(pod)
    with pytest.raises(load_image_check().CheckFailed):
        image_run_args(pod)


def test_ci_expects_the_pools_the_daemon_builds(tmp_path: Path) -> None:
    # The container run's expectation is written from the simulated layout, not from densedev's
    # selectors; here both must agree, with the variable an Allocate answers with.
    from densedev.node import scanner as discovery
    from densedev.pools import select as selectors
    from densedev.testing import simnode

    ic = load_image_check()
    layout = simnode.build_node(tmp_path / "sys", pfs=6, vfs_per_pf=3)
    simnode.write_config(tmp_path / "config.json", layout, prefix=ic.PREFIX)
    cfg = config.load(tmp_path / "config.json")
    pools = selectors.build_pools(cfg, discovery.scan(tmp_path / "sys").devices)
    built = {p.config.full_name: {m.id for m in p.members} for p in pools}
    assert built == ic.expected_pools(layout)
    assert all(len(ids) == 9 if "mellanox" in name else len(ids) == 3 for name, ids in built.items())
    for pool in pools:
        assert ic.env_name(pool.config.full_name) == config.env_var_name(pool.config.full_name)


def test_ci_builds_and_runs_the_image() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    assert 'bash .ci/image.sh "$VENV/bin/python"' in run
    script = (ROOT / ".ci" / "image.sh").read_text()
    # Always from scratch (podman 4.3 reuses stale layers) with the CA bundle mounted, never copied.
    assert "--no-cache" in script and "ca-certificates.crt:ro" in script
    assert "BUILD_IMAGE=" in script and "RUNTIME_IMAGE=" in script
    # The DRA mode runs the overlay's DaemonSet as kustomize renders it.
    assert 'kubectl kustomize deploy/overlays/dra > "$WORK/dra.yaml"' in script
    assert '--dra-manifest "$WORK/dra.yaml"' in script


def dra_image_run_args(pod: dict[str, Any], **kw: Any) -> list[str]:
    """Return the podman options and command the image check derives for the DRA overlay's pod."""
    ic = load_image_check()
    names = ("device-plugins", "pod-resources", "sys", "config", "cdi", "plugins-registry", "dra-plugin")
    volumes = {name: ic.Volume(Path(f"/node/{name}")) for name in names}
    options: dict[str, Any] = {
        "network": "ns:/run/netns/node",
        "mount_paths": {"/sys": "/host/sys", DRA_PLUGIN_DIR: "/node/plugins/net.densedev.io"},
        "extra_args": ["--sysfs-root=/host/sys", "--kubelet-plugins-dir=/node/plugins"],
        "field_refs": {"spec.nodeName": "node-a"},
        "kubeconfig": Path("/node/kube/kubeconfig"),
    }
    args: list[str] = ic.container_args(pod, volumes, **(options | kw))
    return args


def test_ci_runs_the_dra_container_as_the_overlay_asks() -> None:
    objs = build("overlays/dra")
    args = dra_image_run_args(pod_spec(objs))
    split = args.index("--entrypoint=densedev") + 1
    options, command = args[:split], args[split:]
    base = set(image_run_args(base_pod())[: image_run_args(base_pod()).index("--entrypoint=densedev") + 1])
    # The base container's options, plus what the overlay adds; the DRA plugin directory at its host
    # path, as on a node (the kubelet dials the socket at the path the plugin names).
    assert set(options) - base == {
        "--env=NODE_NAME=node-a",  # the downward API's spec.nodeName
        f"--volume=/node/cdi:{CDI_DIR}:rw",
        f"--volume=/node/plugins-registry:{PLUGINS_REGISTRY_DIR}:rw",
        "--volume=/node/dra-plugin:/node/plugins/net.densedev.io:rw",
        # In-cluster credentials cannot reach the stand-in: a kubeconfig naming it, read-only.
        "--volume=/node/kube:/etc/densedev-kubeconfig:ro",
    }
    assert command[: len(container(objs)["args"])] == container(objs)["args"]
    assert command[len(container(objs)["args"]) :] == [
        "--sysfs-root=/host/sys",
        "--kubelet-plugins-dir=/node/plugins",
        "--kubeconfig=/etc/densedev-kubeconfig/kubeconfig",
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"kubeconfig": None},  # the pod mounts a token the check cannot give
        {"field_refs": {}},  # NODE_NAME from a field the check was not told
        {"field_refs": {"status.podIP": "10.0.0.1"}},
    ],
    ids=["no-kubeconfig", "no-node-name", "other-field"],
)
def test_ci_refuses_a_dra_run_it_cannot_reproduce(change: dict[str, Any]) -> None:
    with pytest.raises(load_image_check().CheckFailed):
        dra_image_run_args(pod_spec(build("overlays/dra")), **change)


def test_ci_gives_api_credentials_only_to_a_pod_that_has_them() -> None:
    with pytest.raises(load_image_check().CheckFailed, match="no API-server credentials"):
        image_run_args(base_pod(), kubeconfig=Path("/node/kube/kubeconfig"))


def test_ci_dra_run_expects_what_the_daemon_publishes(tmp_path: Path) -> None:
    # The DRA run's expectations (which pools move, the device names in the slices) are written from
    # the layout and docs/dra.md; here they must match what the daemon builds and publishes.
    from densedev.dra import slices
    from densedev.node import scanner as discovery
    from densedev.pools import select as selectors
    from densedev.testing import simnode

    ic = load_image_check()
    layout = simnode.build_node(tmp_path / "sys", pfs=6, vfs_per_pf=3)
    (tmp_path / "config").mkdir()
    simnode.write_config(tmp_path / "config" / "config.json", layout, prefix=ic.PREFIX)
    kubelet_dir = tmp_path / "kubelet-dra" / "device-plugins"
    kubelet_dir.mkdir(parents=True)
    node = ic.Node(tmp_path / "sys", tmp_path / "config", kubelet_dir, "ns", layout)
    dp_pools, dra_pools = ic.split_apis(layout)
    node = ic.write_dra_config(node, dra_pools)
    cfg = config.load(node.config_dir / "config.json")
    assert cfg.dra_driver_name == ic.DRA_DRIVER
    assert {p.full_name for p in cfg.pools if p.api is PoolApi.DEVICE_PLUGIN} == set(dp_pools)
    pools = selectors.build_pools(cfg, discovery.scan(tmp_path / "sys").devices)
    published = slices.build_slices(ic.DRA_NODE, cfg.dra_driver_name, slices.dra_pools(pools))
    names = {d["name"] for s in published for d in s["spec"]["devices"]}
    assert names == {ic.dra_device_name(a) for ids in dra_pools.values() for a in ids}
    assert len(names) == 15  # 5 of the 6 PFs' VFs: the first PF's pool stays on the device plugin API


def test_api_server_stand_in_runs_as_the_image_check_runs_it(tmp_path: Path) -> None:
    # The DRA run starts the stand-in as a process holding a Node, a claim and a token.
    import urllib.error
    import urllib.request

    from densedev.testing.dra_kubelet import allocated_claim

    result = {"request": "nic", "driver": "net.densedev.io", "pool": "n1", "device": "pci-0000-19-00-2"}
    claim = allocated_claim("default", "c1", "0f0f0f0f-0000-4000-8000-000000000001", [result])
    (tmp_path / "claim.json").write_text(json.dumps(claim))
    command = [sys.executable, "-m", "densedev.testing.apiserver", "--node", "n1", "--token", "s3cret"]
    command += ["--claim", str(tmp_path / "claim.json"), "--no-validate"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            path = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c1"
            with pytest.raises(urllib.error.HTTPError, match="401"):
                urllib.request.urlopen(url + path, timeout=10)
            request = urllib.request.Request(url + path, headers={"Authorization": "Bearer s3cret"})
            with urllib.request.urlopen(request, timeout=10) as response:
                got = json.load(response)
            # Stored as the server stores it: with a resourceVersion and generation (status writes use them).
            assert got["metadata"].pop("resourceVersion") and got["metadata"].pop("generation") == 1
            assert got == claim
            request = urllib.request.Request(url + "/api/v1/nodes/n1", headers=request.headers)
            with urllib.request.urlopen(request, timeout=10) as response:
                assert json.load(response)["metadata"]["name"] == "n1"
        finally:
            proc.send_signal(signal.SIGINT)  # its way out
            assert proc.wait(timeout=30) == 0


# ------------------------------------------------------------------------------------- privilege

PROBE = textwrap.dedent(
    """
    import json, os, socket, struct, sys

    kubelet_dir, cdi_dir, secret = sys.argv[1:4]
    out = {}

    def step(name, fn):
        try:
            fn()
            out[name] = "ok"
        except OSError as exc:
            out[name] = f"errno {exc.errno}"

    def caps():
        status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
        out["uid"] = os.getuid()
        out["CapEff"] = status["CapEff"].strip()
        out["CapBnd"] = status["CapBnd"].strip()

    def plugin_socket():
        stale = os.path.join(kubelet_dir, "densedev-a.sock")
        if os.path.exists(stale):
            os.unlink(stale)  # a previous run's socket: the plugin removes it before binding again
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(stale)
        s.listen()
        s.close()

    def register():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(os.path.join(kubelet_dir, "kubelet.sock"))
        s.close()

    def atomic_write():
        tmp = os.path.join(cdi_dir, ".densedev-pool.json.tmp")
        with open(tmp, "w") as f:
            f.write("{}")
        os.replace(tmp, os.path.join(cdi_dir, "densedev-pool.json"))

    def rtnetlink():
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
        s.bind((0, 1))  # RTMGRP_LINK: link changes
        # struct nlmsghdr + struct ifinfomsg: RTM_GETLINK (18), NLM_F_REQUEST|NLM_F_DUMP (0x301)
        s.send(struct.pack("=IHHII", 32, 18, 0x301, 1, 0) + bytes(16))
        data = s.recv(65536)
        assert struct.unpack_from("=IH", data)[1] == 16, "no RTM_NEWLINK in the dump"
        s.close()

    def uevents():
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)  # NETLINK_KOBJECT_UEVENT
        s.bind((0, 1))  # the kernel's uevent group
        s.close()

    def metrics_port():
        s = socket.socket()
        s.bind(("127.0.0.1", 9477))
        s.listen()
        s.close()

    def read_owner_only():
        open(secret).read()

    caps()
    step("plugin_socket", plugin_socket)
    step("register", register)
    step("atomic_write", atomic_write)
    step("rtnetlink", rtnetlink)
    step("uevents", uevents)
    step("metrics_port", metrics_port)
    step("read_owner_only", read_owner_only)
    print(json.dumps(out))
    """
)


@pytest.fixture
def kubelet_like() -> Iterator[tuple[Path, Path, Path]]:
    """Root-owned dirs and a listening kubelet.sock with the kubelet's modes, plus a 0400 root file."""
    # Not pytest's tmp_path: its parents are 0700, which would refuse another UID for the wrong reason.
    tmp_path = Path(tempfile.mkdtemp(prefix="densedev-priv-", dir="/tmp"))
    kubelet_dir = tmp_path / "device-plugins"
    kubelet_dir.mkdir(mode=0o750)
    os.chmod(kubelet_dir, 0o750)  # the kubelet creates its device-plugin dir 0750
    (kubelet_dir / "densedev-a.sock").write_text("")  # stale leftover
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    os.chmod(cdi_dir, 0o755)
    secret = tmp_path / "owner-only"
    secret.write_text("x")
    os.chmod(secret, 0o400)
    os.chmod(tmp_path, 0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(kubelet_dir / "kubelet.sock"))
    os.chmod(kubelet_dir / "kubelet.sock", 0o755)  # grpc-go's listener under the kubelet's umask 022
    listener.listen(8)
    try:
        yield kubelet_dir, cdi_dir, secret
    finally:
        listener.close()
        shutil.rmtree(tmp_path)


def run_probe(uid: int, dirs: tuple[Path, Path, Path]) -> dict[str, str]:
    """Run PROBE in a fresh network namespace as ``uid`` with every capability set emptied."""
    for tool in ("unshare", "setpriv", "ip"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    # setpriv empties the bounding, inheritable and ambient sets before exec, so even UID 0 starts with
    # no capability at all — what a container with `drop: [ALL]` gets from runc.
    inner = [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        sys.executable,
        "-c",
        PROBE,
        *map(str, dirs),
    ]
    proc = subprocess.run(
        ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *inner],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, str] = json.loads(proc.stdout)
    return result


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to make namespaces and drop capabilities"
)


@needs_root
@pytest.mark.netns
def test_root_without_capabilities_is_enough(kubelet_like: tuple[Path, Path, Path]) -> None:
    got = run_probe(0, kubelet_like)
    assert (got.pop("uid"), got.pop("CapEff"), got.pop("CapBnd")) == (0, "0" * 16, "0" * 16)
    assert got == {
        "plugin_socket": "ok",
        "register": "ok",
        "atomic_write": "ok",
        "rtnetlink": "ok",
        "uevents": "ok",
        "metrics_port": "ok",
        "read_owner_only": "ok",
    }
    kubelet_dir, cdi_dir, _ = kubelet_like
    assert (kubelet_dir / "densedev-a.sock").is_socket()
    assert (cdi_dir / "densedev-pool.json").read_text() == "{}"


@needs_root
@pytest.mark.netns
def test_a_non_root_uid_cannot_use_the_kubelet_dir(kubelet_like: tuple[Path, Path, Path]) -> None:
    # Why runAsNonRoot is not set: another UID is refused by the root-owned dirs and kubelet.sock,
    # and only CAP_DAC_OVERRIDE (far broader than running as root without capabilities) would help.
    got = run_probe(65534, kubelet_like)
    assert got["uid"] == 65534
    assert got["plugin_socket"] == got["register"] == got["atomic_write"] == "errno 13"  # EACCES
    # netlink and the metrics port never needed root.
    assert got["rtnetlink"] == got["uevents"] == got["metrics_port"] == "ok"


GO_PLUGIN_DAEMONSETS = sorted((ROOT / ".ci" / "daemonsets").glob("*.yaml"))


@pytest.mark.parametrize("manifest", GO_PLUGIN_DAEMONSETS, ids=lambda p: p.stem)
def test_ci_runs_the_go_plugins_daemonsets_with_the_images_entrypoint(manifest: Path) -> None:
    """The SR-IOV network device plugin's DaemonSets set no command and no user: the run takes the
    image's ENTRYPOINT and USER (and refuses without them), expands $(NODE_NAME) as the kubelet does,
    and densedev's parser reads what comes out as a run of the manifest's config file."""
    from densedev.argv import go_plugin_argv

    ic = load_image_check()
    pod = ic.daemonset_pod(manifest)
    volumes = {v["name"]: ic.Volume(Path(f"/node/{v['name']}")) for v in pod["volumes"]}
    kw: dict[str, Any] = {
        "network": "ns:/run/netns/node",
        "field_refs": {"spec.nodeName": "node-a"},
        "token_unused": True,  # a device plugin never reads the token these pods mount
    }
    with pytest.raises(ic.CheckFailed, match="runAsUser"):
        ic.container_args(pod, volumes, **kw)
    args = ic.container_args(pod, volumes, image=ic.ImageDefaults(("densedev",), ""), **kw)
    split = args.index("--entrypoint=densedev") + 1
    options, command = args[:split], args[split:]
    assert {"--user=0:0", "--privileged", "--env=NODE_NAME=node-a"} <= set(options)
    assert all("$(" not in a for a in command)
    parsed = cli.build_parser("run").parse_args(go_plugin_argv(command)[0])
    assert parsed.command == "run"
    assert parsed.config == Path("/etc/pcidp/node-a")
    assert parsed.log_level == "10"


def test_ci_expands_container_variables_as_the_kubelet_does() -> None:
    expand = load_image_check()._expand
    env = {"NODE_NAME": "node-a"}
    assert expand("--config-file=/etc/pcidp/$(NODE_NAME)", env) == "--config-file=/etc/pcidp/node-a"
    assert expand("$(UNSET) $$(NODE_NAME) $$", env) == "$(UNSET) $(NODE_NAME) $"

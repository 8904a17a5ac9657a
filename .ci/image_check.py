"""Run densedev's image as deploy/base/daemonset.yaml runs it, against a simulated node and the kubelet
emulator on this host, and check what a node would see (issue 15).

The container's command line, user, capabilities, privilege flags, read-only root, env, mounts and
limits are translated from the DaemonSet manifest itself (``container_args``), and a field of the
manifest this translation does not know fails the check, so the run cannot drift from the manifest.
Two deviations, both forced by the simulation and named where they are made: the node's sysfs is a
simulated tree mounted at ``/host/sys`` with ``--sysfs-root=/host/sys`` (podman mounts cgroups under
``/sys/fs/cgroup``, so nothing can be mounted over ``/sys``), and the "host network" is a network
namespace made here that holds the simulated PFs' netdevs as veth links (``hostNetwork: true`` means
the node's namespace; this namespace is the simulated node's).

Each run checks: every pool registers, the kubelet emulator holds each pool's full device list (derived
from the simulated layout, not from densedev's selectors), ``/healthz`` and ``/readyz`` answer 200 on the
metrics address, an Allocate returns the devices' ``PCIDEVICE_*`` variable, SIGTERM ends the container
with exit code 0 and removes its sockets, and its log holds no traceback.  The first run passes
``--no-netlink``; the second runs the manifest's own arguments (netlink on) and also takes a PF link
down and up, which the emulator must see as that PF's VFs turning Unhealthy and Healthy again.

With ``--dra-manifest`` (deploy/overlays/dra rendered by kustomize) a third run serves the same node
in DRA mode: the first pool stays on the device plugin API, every other moves to ``"api": "dra"``.
Beside the kubelet emulator run the DRA kubelet emulator (``densedev.testing.dra_kubelet``, watching
the registry directory) and the API-server stand-in (``python -m densedev.testing.apiserver``, in the
node's network namespace, where the pod's host network reaches it).  It checks: the device-plugin pool
registered with its list, the DRA plugin registered, the node's ResourceSlices hold exactly the DRA
pools' devices (named from docs/dra.md, not by densedev's function), the health stream holds them
Healthy, a claim allocated one device is prepared through the emulator into a CDI spec on the host that
gives the device's ``PCIDEVICE_*`` variable and is gone after NodeUnprepareResources, and the same
probes, confinement and SIGTERM checks.  Two more deviations, named where they are made: the
ServiceAccount token becomes a kubeconfig naming the stand-in (mounted read-only), and the driver's
directory is mounted at its host path here too, under a simulated kubelet directory, with
``--kubelet-plugins-dir`` naming it (the kubelet dials the DRA socket at the path the plugin names).

With ``--rdma-plugin-manifest`` (.ci/daemonsets/rdma-shared-dev-plugin.yaml) the image runs in the RDMA
shared device plugin's DaemonSet against a node of RDMA HCAs, its config in that plugin's shape in the
``rdma-devices`` ConfigMap: each pool registers as ``rdma/<name>`` (or its ``resourcePrefix``) listing
``rdmaHcaMax`` IDs, and an Allocate gives the selected HCAs' char devices (``run_rdma_plugin_container``).

    python .ci/image_check.py --image REF [--engine podman] [--manifest deploy/base/daemonset.yaml]
        [--dra-manifest RENDERED-OVERLAY] [--go-plugin-manifest M]... [--rdma-plugin-manifest M]
        --work DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import uvloop
import yaml

from densedev import cli
from densedev.ops.metrics import parse_addr
from densedev.testing import netns, simnode
from densedev.testing.dra_kubelet import DraKubelet, allocated_claim
from densedev.testing.kubelet import HEALTHY, UNHEALTHY, KubeletEmulator

PREFIX = "intel.com"  # simnode.write_config's resourcePrefix
GUARD_S = 60.0  # turns a hang into a failure; nothing here asserts speed
NS_PREFIX = "densedev-ci"
SYSFS_IN_CONTAINER = "/host/sys"
KUBECONFIG_IN_CONTAINER = Path("/etc/densedev-kubeconfig/kubeconfig")
DRA_DRIVER = "net.densedev.io"  # the DRA overlay's draDriverName (its config and the driver's mount)
DRA_NODE = "densedev-ci-node"
DRA_PLUGINS_DIR = "/var/lib/kubelet/plugins"


class CheckFailed(Exception):
    """One check of the container run failed; the message says which and what was seen."""


class Volume(NamedTuple):
    """What a pod volume is on this host: a directory to bind-mount."""

    host_path: Path


class ImageDefaults(NamedTuple):
    """What a node takes from the image where the pod says nothing: its ENTRYPOINT and its USER.

    The SR-IOV network device plugin's DaemonSets set neither (its image's entrypoint takes their
    ``args``), so those runs read the image's own; densedev's manifests set both, and a run of them
    without the two fails instead.
    """

    entrypoint: tuple[str, ...]
    user: str
    cmd: tuple[str, ...] = ()  # the arguments of a pod that sets neither command nor args


@dataclass(frozen=True)
class Node:
    """The simulated node a container runs against: its directories, network namespace and layout.

    ``kubelet_dir`` is the node's work directory until ``fresh_kubelet_dir`` gives a run its own.
    """

    sysfs: Path
    config_dir: Path
    kubelet_dir: Path
    netns: str
    layout: simnode.NodeLayout


# Container securityContext fields and pod securityContext fields this translation reproduces; any
# other field in the manifest fails the check instead of being silently dropped.
_CONTAINER_SC = {"privileged", "allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities"}
_POD_SC = {"runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile"}
# Container fields that do not change how the process runs on a node (probes are exercised by the
# check itself against the same address; imagePullPolicy and name are the kubelet's business).
_CONTAINER_IGNORED = {"name", "image", "imagePullPolicy", "startupProbe", "livenessProbe", "readinessProbe"}
_CONTAINER_KNOWN = {"command", "args", "env", "resources", "securityContext", "volumeMounts"}


def _quantity_bytes(text: str) -> int:
    """Return a Kubernetes memory quantity (``384Mi``, ``1G``, ``512``) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def _quantity_cpus(text: str) -> str:
    """Return a Kubernetes CPU quantity (``1``, ``500m``) as podman's ``--cpus`` value."""
    return str(int(text[:-1]) / 1000) if text.endswith("m") else text


def daemonset_pod(manifest: Path) -> dict[str, Any]:
    """Return the pod template spec of the only DaemonSet in a manifest file."""
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    [ds] = [d for d in docs if d.get("kind") == "DaemonSet"]
    spec: dict[str, Any] = ds["spec"]["template"]["spec"]
    return spec


def container_args(
    pod: Mapping[str, Any],
    volumes: Mapping[str, Volume],
    *,
    network: str,
    mount_paths: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    field_refs: Mapping[str, str] | None = None,
    kubeconfig: Path | None = None,
    extra_volumes: Mapping[str, Path] | None = None,
    image: ImageDefaults | None = None,
    token_unused: bool = False,
) -> list[str]:
    """Return the ``podman run`` options and command that run the pod's only container as a node would.

    ``volumes`` gives each pod volume's host directory here; ``mount_paths`` moves a mount to another
    container path; ``extra_args`` are appended to the container's arguments, where argparse lets the
    last occurrence of a flag win (as the kustomize components do); ``field_refs`` gives the value of
    each downward-API field an env var takes (``spec.nodeName``); ``kubeconfig`` stands in for the
    ServiceAccount token of a pod that mounts one; ``extra_volumes`` (container path → host directory)
    are mounted read-only beyond the pod's own; ``image`` gives the ENTRYPOINT and USER a pod without
    ``command`` or ``runAsUser`` runs with; ``token_unused`` says the daemon will not read the pod's
    ServiceAccount token (no DRA pool).  ``$(VAR)`` in the arguments is expanded from the
    container's env, as the kubelet does.  Raises ``CheckFailed`` on any field of the manifest it cannot
    reproduce.
    """
    [c] = pod["containers"]
    unknown = set(c) - _CONTAINER_KNOWN - _CONTAINER_IGNORED
    if unknown:
        raise CheckFailed(f"container fields the image check does not reproduce: {sorted(unknown)}")
    if pod.get("hostNetwork") is not True or pod.get("hostPID") or pod.get("hostIPC"):
        raise CheckFailed("the check reproduces hostNetwork: true without hostPID/hostIPC only")
    out = [f"--network={network}"]

    psc = pod.get("securityContext", {})
    if set(psc) - _POD_SC:
        raise CheckFailed(f"pod securityContext fields not reproduced: {sorted(set(psc) - _POD_SC)}")
    if psc.get("seccompProfile", {"type": "RuntimeDefault"}) != {"type": "RuntimeDefault"}:
        raise CheckFailed("only seccompProfile RuntimeDefault is reproduced (podman's default profile)")
    uid, gid = psc.get("runAsUser"), psc.get("runAsGroup")
    if uid is not None and gid is not None:
        out.append(f"--user={uid}:{gid}")
    elif image is not None and uid is None and gid is None:
        out.append(f"--user={image.user or '0:0'}")  # an image without USER runs as root
    else:
        raise CheckFailed("the pod must set runAsUser and runAsGroup (the image's USER is not assumed)")

    sc = c.get("securityContext", {})
    if set(sc) - _CONTAINER_SC:
        raise CheckFailed(
            f"container securityContext fields not reproduced: {sorted(set(sc) - _CONTAINER_SC)}"
        )
    if sc.get("privileged"):
        out.append("--privileged")
    # allowPrivilegeEscalation: false is the kubelet's no_new_privs (runc: process.noNewPrivileges).
    if sc.get("allowPrivilegeEscalation") is False:
        out.append("--security-opt=no-new-privileges")
    if sc.get("readOnlyRootFilesystem"):
        # podman would mount writable tmpfs on /tmp, /run and /var/tmp; a pod gets none of them.
        out += ["--read-only", "--read-only-tmpfs=false"]
    caps = sc.get("capabilities", {})
    out += [f"--cap-drop={cap}" for cap in caps.get("drop", [])]
    out += [f"--cap-add={cap}" for cap in caps.get("add", [])]

    env = {e["name"]: _env_value(e, field_refs or {}) for e in c.get("env", [])}
    out += [f"--env={name}={value}" for name, value in env.items()]
    # In-cluster credentials (the token the kubelet mounts, KUBERNETES_SERVICE_HOST) cannot point at a
    # stand-in on this host: a kubeconfig naming it is mounted read-only and given with --kubeconfig.
    # The Go plugin's DaemonSets leave the token mounted but never use it (a device plugin talks to the
    # kubelet only): their runs, whose configs have no DRA pool, pass token_unused and get none.
    automount = pod.get("automountServiceAccountToken", True) and not token_unused
    if automount and kubeconfig is None:
        raise CheckFailed("the pod mounts a ServiceAccount token: give the check a kubeconfig instead")
    if not automount and kubeconfig is not None:
        raise CheckFailed("the pod has no API-server credentials, yet the check was given a kubeconfig")
    if kubeconfig is not None:
        out.append(f"--volume={kubeconfig.parent}:{KUBECONFIG_IN_CONTAINER.parent}:ro")
        extra_args = [*extra_args, f"--kubeconfig={KUBECONFIG_IN_CONTAINER}"]
    limits = c.get("resources", {}).get("limits", {})
    if "memory" in limits:
        out.append(f"--memory={_quantity_bytes(limits['memory'])}")
    if "cpu" in limits:
        out.append(f"--cpus={_quantity_cpus(limits['cpu'])}")

    declared = {v["name"] for v in pod.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        name = m["name"]
        if name not in declared or name not in volumes:
            raise CheckFailed(f"volume {name!r}: not declared in the pod, or not provided by the check")
        if set(m) - {"name", "mountPath", "readOnly", "recursiveReadOnly"}:
            raise CheckFailed(f"volumeMount {name!r}: fields not reproduced: {sorted(m)}")
        target = (mount_paths or {}).get(m["mountPath"], m["mountPath"])
        mode = "ro" if m.get("readOnly") else "rw"
        # recursiveReadOnly has nothing to act on here: the simulated trees have no sub-mounts.
        out.append(f"--volume={volumes[name].host_path}:{target}:{mode}")
    out += [f"--volume={host}:{target}:ro" for target, host in (extra_volumes or {}).items()]

    command = [_expand(a, env) for a in c.get("command", [])]
    # As the kubelet: with neither command nor args the image's ENTRYPOINT runs with its CMD, with args
    # only the ENTRYPOINT runs with them (the RDMA shared plugin's DaemonSet sets neither).
    args = [_expand(a, env) for a in c.get("args", [])]
    if not command and not args and image is not None:
        args = list(image.cmd)
    if not command and image is not None:
        command = list(image.entrypoint)
    if not command:
        raise CheckFailed("the container must set command (the image's ENTRYPOINT is not assumed)")
    out += [f"--entrypoint={command[0]}"]
    return [*out, *command[1:], *args, *extra_args]


def _expand(arg: str, env: Mapping[str, str]) -> str:
    """Expand ``$(VAR)`` from the container's env as the kubelet does: an unknown name stays as written,
    and ``$$`` is a literal ``$``."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]),
        arg,
    )


def _env_value(env: Mapping[str, Any], field_refs: Mapping[str, str]) -> str:
    """Return an env var's value: a literal, or a downward-API field the check was given."""
    if set(env) == {"name", "value"}:
        return str(env["value"])
    ref = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if set(env) != {"name", "valueFrom"} or ref not in field_refs:
        raise CheckFailed(f"env {env.get('name')!r}: not reproduced (a literal or a given fieldRef only)")
    return field_refs[ref]


def expected_pools(layout: simnode.NodeLayout, prefix: str = PREFIX) -> dict[str, set[str]]:
    """Return resource → device IDs as ``simnode.write_config``'s pools select them from the layout.

    One pool per PF of the first half (``pfNames``), then one for every other VF of the vendor: written
    from the layout, not from densedev's selectors, so a wrong selection in the image shows.
    """
    half = max(1, len(layout.pfs) // 2)
    pools = {f"{prefix}/sriov_{pf.netdev}": set(pf.vf_addresses) for pf in layout.pfs[:half]}
    pools[f"{prefix}/{layout.vendor}_vfs"] = {a for pf in layout.pfs[half:] for a in pf.vf_addresses}
    return pools


def env_name(resource: str) -> str:
    """Return the SR-IOV device plugin's variable for a resource (``PCIDEVICE_INTEL_COM_X``; a "-" stays)."""
    return "PCIDEVICE_" + "".join("_" if ch in "./" else ch for ch in resource).upper()


class Engine:
    """A container engine CLI (podman or docker), driven with plain subprocess calls."""

    def __init__(self, path: str, label: str) -> None:
        self.path = path
        self.label = label

    def call(self, *args: str, check: bool = True, timeout: float = GUARD_S) -> str:
        """Run the engine with ``args`` and return its stdout; raise CheckFailed with stderr on failure."""
        done = subprocess.run([self.path, *args], capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise CheckFailed(f"{self.path} {args[0]}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def logs(self, name: str) -> str:
        """Return a container's log: what it wrote to stdout and to stderr (podman keeps them apart)."""
        done = subprocess.run([self.path, "logs", name], capture_output=True, text=True, timeout=GUARD_S)
        return done.stdout + done.stderr

    async def acall(self, *args: str, check: bool = True, timeout: float = GUARD_S) -> str:
        """``call`` in a worker thread, so the kubelet emulator keeps serving meanwhile."""
        return await asyncio.to_thread(self.call, *args, check=check, timeout=timeout)


def http_status(ns: str, port: int, path: str, token: str | None = None) -> tuple[int, str]:
    """GET ``http://127.0.0.1:port/path`` from inside network namespace ``ns``: (status, body).

    ``token`` is sent as a bearer token (the API-server stand-in asks for one).
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    probe = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        f"    q = urllib.request.Request('http://127.0.0.1:{port}{path}', headers={headers!r})\n"
        "    r = urllib.request.urlopen(q, timeout=5)\n"
        "    print(r.status); print(r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code); print(e.read().decode())\n"
        "except OSError as e:\n"
        "    print(0); print(e)\n"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True, text=True, timeout=30
    )
    status, _, body = done.stdout.partition("\n")
    return int(status or 0), body.strip() or done.stderr.strip()


async def wait_http_ok(ns: str, port: int, path: str) -> str:
    """Poll an endpoint as a kubelet probe does until it answers 200; return the body."""
    deadline = time.monotonic() + GUARD_S
    status, body = 0, ""
    while time.monotonic() < deadline:
        status, body = await asyncio.to_thread(http_status, ns, port, path)
        if status == 200:
            return body
        await asyncio.sleep(0.5)
    raise CheckFailed(f"{path} on 127.0.0.1:{port} never answered 200 (last: {status} {body[:200]})")


def build_node(work: Path, ns: str) -> Node:
    """Write a simulated node under ``work`` and give each of its PFs a veth netdev in ``ns``."""
    sysfs = work / "sys"
    layout = simnode.build_node(sysfs, pfs=16, vfs_per_pf=256, numa_nodes=2)
    config_dir = work / "config"
    config_dir.mkdir(mode=0o755)
    simnode.write_config(config_dir / "config.json", layout, prefix=PREFIX)
    netns.ip(ns, "link", "set", "lo", "up")
    batch = "".join(
        f"link add {pf.netdev} type veth peer name peer{i}\nlink set peer{i} up\nlink set {pf.netdev} up\n"
        for i, pf in enumerate(layout.pfs)
    )
    done = subprocess.run(["ip", "-n", ns, "-batch", "-"], input=batch, capture_output=True, text=True)
    if done.returncode != 0:
        raise CheckFailed(f"ip -batch in {ns}: {done.stderr.strip()}")
    return Node(sysfs, config_dir, work, ns, layout)


def fresh_kubelet_dir(node: Node, run: str) -> Node:
    """Return ``node`` with an empty kubelet device-plugin directory of its own for one container run."""
    kubelet_dir = node.kubelet_dir / f"kubelet-{run}" / "device-plugins"
    kubelet_dir.mkdir(parents=True)
    os.chmod(kubelet_dir, 0o750)  # as the kubelet creates it: root's, no access for others
    # The kubelet's PodResources socket lives in a sibling directory (mounted read-only by the pod).
    (kubelet_dir.parent / "pod-resources").mkdir(mode=0o750)
    return dataclasses.replace(node, kubelet_dir=kubelet_dir)


async def wait_for(kubelet: KubeletEmulator | DraKubelet, what: str, predicate: Any) -> None:
    """Wait for the emulator's state to satisfy ``predicate``; CheckFailed names ``what`` on expiry."""
    try:
        await kubelet.wait_for(predicate, GUARD_S)
    except TimeoutError:
        raise CheckFailed(f"{what}: not seen within {GUARD_S:.0f} s") from None


def probe_port(args: Sequence[str]) -> int:
    """Return the port of the daemon's health endpoints, read from its command line by its own parser."""
    # The last flag wins, as for the daemon; the parser checks that --sysfs-root exists, and the
    # container's mount point does not on the host.
    command = [a for a in args[_entrypoint(args) + 1 :] if not a.startswith("--sysfs-root=")]
    host, port = parse_addr(cli.build_parser().parse_args(command).metrics_addr)
    if host not in ("", "127.0.0.1"):
        raise CheckFailed(f"metrics address {host}:{port}: the probes reach 127.0.0.1 only")
    return port


@contextlib.asynccontextmanager
async def container(engine: Engine, image: str, args: Sequence[str], mode: str) -> AsyncIterator[str]:
    """Run the container detached for the block's checks; yield its name; remove it afterwards.

    Whatever goes wrong inside (a refused call, an engine call that hung), the container's own account
    is printed first, then one CheckFailed line says which check failed.
    """
    name = f"{NS_PREFIX}-{mode}-{os.getpid()}"
    started = False
    try:
        await engine.acall(
            "run", "--detach", f"--name={name}", f"--label={engine.label}", *_split(args, image)
        )
        started = True
        yield name
    except Exception as exc:
        if started:
            tail = "\n".join((await asyncio.to_thread(engine.logs, name)).splitlines()[-30:])
            print(f"--- last log lines of {name}:\n{tail}", file=sys.stderr)
        if isinstance(exc, CheckFailed):
            raise
        raise CheckFailed(f"{mode}: {type(exc).__name__}: {exc}") from exc
    finally:
        await engine.acall("rm", "--force", "--time=0", name, check=False)


async def check_probes(
    engine: Engine,
    name: str,
    pod: Mapping[str, Any],
    node: Node,
    port: int,
    mode: str,
    read_only: Sequence[str] = (),
) -> list[str]:
    """Check the process's confinement from the host and the health endpoints; return what they showed.

    ``read_only`` names container paths mounted read-only beyond the root, sysfs and config.
    """
    pid = int((await engine.acall("inspect", "--format={{.State.Pid}}", name)).strip())
    summary = confined(pid, memory_limit(pod), read_only)
    await wait_http_ok(node.netns, port, "/healthz")
    body = await wait_http_ok(node.netns, port, "/readyz")
    return [
        f"{mode}: {summary}",
        f"{mode}: /healthz 200, /readyz 200 on 127.0.0.1:{port} ({body.splitlines()[0][:60]})",
    ]


async def terminate(
    engine: Engine, name: str, pod: Mapping[str, Any], mode: str, socket_dirs: Sequence[Path]
) -> str:
    """SIGTERM the container as the kubelet does; check exit 0, its sockets removed, no traceback."""
    await engine.acall("kill", "--signal=TERM", name)
    grace = float(pod.get("terminationGracePeriodSeconds", 30))
    code = (await engine.acall("wait", name, timeout=grace + 10)).strip()
    if code != "0":
        raise CheckFailed(f"{mode}: exit code {code} after SIGTERM (want 0)")
    left = sorted(
        str(p)
        for d in socket_dirs
        for p in d.rglob("*")
        if p.is_socket() and p.name != "kubelet.sock"  # the kubelet's own, not the daemon's
    )
    if left:
        raise CheckFailed(f"{mode}: sockets left after SIGTERM: {left}")
    logs = await asyncio.to_thread(engine.logs, name)
    if "Traceback" in logs:
        raise CheckFailed(f"{mode}: the daemon's log holds a traceback:\n{logs[-3000:]}")
    return f"{mode}: SIGTERM -> exit 0, sockets removed, no traceback in the log"


def node_volumes(node: Node) -> dict[str, Volume]:
    """Return the base DaemonSet's volumes as the simulated node's directories."""
    return {
        "device-plugins": Volume(node.kubelet_dir),
        "pod-resources": Volume(node.kubelet_dir.parent / "pod-resources"),
        "sys": Volume(node.sysfs),
        "config": Volume(node.config_dir),
    }


async def wait_registered(kubelet: KubeletEmulator, expected: Mapping[str, set[str]], mode: str) -> str:
    """Wait until every expected pool is registered with its full list, all Healthy; return a summary."""
    await wait_for(
        kubelet,
        f"{mode}: every pool registered with its full device list, all Healthy",
        lambda: all(
            kubelet.devices(r).keys() == ids and set(kubelet.devices(r).values()) == {HEALTHY}
            for r, ids in expected.items()
        ),
    )
    registered = set(kubelet.resources())
    if registered != set(expected) or kubelet.refusals:
        raise CheckFailed(f"{mode}: registered {sorted(registered)}, refusals {kubelet.refusals}")
    total = sum(len(ids) for ids in expected.values())
    return f"{mode}: {len(expected)} pools registered, {total} devices listed, all Healthy"


async def check_allocate(kubelet: KubeletEmulator, expected: Mapping[str, set[str]], mode: str) -> str:
    """Allocate two devices of the first pool; the answer must name them in its PCIDEVICE_ variable."""
    resource = next(iter(expected))
    ids = sorted(expected[resource])[:2]
    response = await kubelet.allocate(resource, ids)
    got = response.envs.get(env_name(resource), "")
    if sorted(got.split(",")) != ids:
        raise CheckFailed(f"{mode}: Allocate {resource} {ids}: {env_name(resource)}={got!r}")
    return f"{mode}: Allocate {resource} {ids} -> {env_name(resource)}={got}"


def _kubelet(node: Node) -> KubeletEmulator:
    return KubeletEmulator(
        node.kubelet_dir, pod_resources_socket=node.kubelet_dir.parent / "pod-resources" / "kubelet.sock"
    )


async def run_container(
    engine: Engine, image: str, pod: Mapping[str, Any], node: Node, *, netlink: bool, log: list[str]
) -> None:
    """Run the DaemonSet's container once against ``node`` and check what the kubelet emulator sees."""
    mode = "netlink" if netlink else "no-netlink"
    args = container_args(
        pod,
        node_volumes(node),
        network=f"ns:/run/netns/{node.netns}",
        mount_paths={"/sys": SYSFS_IN_CONTAINER},
        extra_args=[f"--sysfs-root={SYSFS_IN_CONTAINER}", *(() if netlink else ("--no-netlink",))],
    )
    port = probe_port(args)
    expected = expected_pools(node.layout)
    kubelet = _kubelet(node)
    await kubelet.start()
    try:
        async with container(engine, image, args, mode) as name:
            log.append(await wait_registered(kubelet, expected, mode))
            log += await check_probes(engine, name, pod, node, port, mode)
            log.append(await check_allocate(kubelet, expected, mode))
            if netlink:
                await flip_pf(kubelet, node, mode, log)
            log.append(await terminate(engine, name, pod, mode, [node.kubelet_dir]))
    finally:
        await kubelet.stop()


# Where the SR-IOV network device plugin's DaemonSets mount the node: each hostPath they name, as a
# directory of the run (relative to the run's root, the parent of its kubelet device-plugin dir).
GO_PLUGIN_HOST_PATHS = {
    "/var/lib/kubelet/device-plugins": "device-plugins",
    "/var/lib/kubelet/": ".",
    "/var/lib/kubelet": ".",
    "/var/run/k8s.cni.cncf.io/devinfo/dp": "devinfo",
    "/var/run/cdi": "cdi",
    "/var/log": "log",
}
GO_PLUGIN_NODE = "densedev-ci-node"  # spec.nodeName: the ConfigMap's key for this node


def image_defaults(engine: Engine, image: str) -> ImageDefaults:
    """Read the image's ENTRYPOINT and USER, which a pod without command or runAsUser runs with."""
    fmt = "{{json .Config.Entrypoint}}\n{{json .Config.Cmd}}\n{{.Config.User}}"
    entrypoint, cmd, user = (
        engine.call("image", "inspect", f"--format={fmt}", image).strip() + "\n\n"
    ).split("\n")[:3]
    return ImageDefaults(tuple(json.loads(entrypoint) or ()), user.strip(), tuple(json.loads(cmd) or ()))


def configmap_volume(root: Path, key: str, text: str) -> Path:
    """Lay out a ConfigMap volume as the kubelet does (``key -> ..data/key``, ``..data -> ..<stamp>``)."""
    root.mkdir(mode=0o755)
    stamp = root / "..2026_12_04_00_00_00.000000001"
    stamp.mkdir(mode=0o755)
    (stamp / key).write_text(text)
    os.symlink(stamp.name, root / "..data")
    os.symlink(f"..data/{key}", root / key)
    return root


def go_plugin_volumes(pod: Mapping[str, Any], node: Node) -> dict[str, Volume]:
    """Return the Go plugin DaemonSet's volumes as the run's directories; its ConfigMap holds this
    node's config under the node's name, with no resourcePrefix (the command line's applies)."""
    root = node.kubelet_dir.parent
    doc = json.loads((node.config_dir / "config.json").read_text())
    for pool in doc["resourceList"]:
        pool.pop("resourcePrefix", None)
    volumes = {}
    for volume in pod["volumes"]:
        if "configMap" in volume:
            path = configmap_volume(root / volume["name"], GO_PLUGIN_NODE, json.dumps(doc, indent=1))
        elif volume.get("hostPath", {}).get("path") in GO_PLUGIN_HOST_PATHS:
            path = root / GO_PLUGIN_HOST_PATHS[volume["hostPath"]["path"]]
            path.mkdir(mode=0o755, exist_ok=True)
        else:
            raise CheckFailed(f"volume {volume['name']!r}: not one the check provides")
        volumes[volume["name"]] = Volume(path)
    return volumes


def _flag(args: Sequence[str], name: str) -> str | None:
    """Return the last ``--name=value`` among the container's arguments (the manifests use that form)."""
    values = [a.partition("=")[2] for a in args if a.startswith(f"{name}=")]
    return values[-1] if values else None


async def run_go_plugin_container(
    engine: Engine, image: str, manifest: Path, node: Node, *, log: list[str]
) -> None:
    """Run densedev's image in the SR-IOV network device plugin's DaemonSet, unchanged but for the image.

    The only deviation is the simulated sysfs, mounted read-only at ``/host/sys`` with ``--sysfs-root``
    after the manifest's arguments (as for densedev's own manifests).  The pools must register under the
    command line's resource prefix with their full lists, an Allocate must answer with the devices'
    variable (and CDI devices whose spec is on the host, with ``--use-cdi``), a PF's link must drive
    its pool's health, and SIGTERM must end the container cleanly.
    """
    mode = manifest.stem
    pod = daemonset_pod(manifest)
    args = container_args(
        pod,
        go_plugin_volumes(pod, node),
        network=f"ns:/run/netns/{node.netns}",
        extra_volumes={SYSFS_IN_CONTAINER: node.sysfs},
        extra_args=[f"--sysfs-root={SYSFS_IN_CONTAINER}"],
        field_refs={"spec.nodeName": GO_PLUGIN_NODE},
        image=await asyncio.to_thread(image_defaults, engine, image),
        token_unused=True,
    )
    prefix = _flag(args, "--resource-prefix") or PREFIX  # the Go plugin's default: intel.com
    expected = expected_pools(node.layout, prefix)
    kubelet = _kubelet(node)
    await kubelet.start()
    try:
        async with container(engine, image, args, mode) as name:
            log.append(await wait_registered(kubelet, expected, mode))
            log.append(await check_allocate(kubelet, expected, mode))
            if "--use-cdi" in args:
                log.append(await check_cdi(kubelet, expected, node.kubelet_dir.parent / "cdi", mode))
            await flip_pf(kubelet, node, mode, log, prefix)
            log.append(await terminate(engine, name, pod, mode, [node.kubelet_dir]))
            said = await asyncio.to_thread(engine.logs, name)
            notes = [line for line in said.splitlines() if "glog" in line or "--log-dir" in line]
            log += [f"{mode}: {line.partition('msg=')[2] or line}" for line in notes]
    finally:
        await kubelet.stop()


async def check_cdi(
    kubelet: KubeletEmulator, expected: Mapping[str, set[str]], cdi_dir: Path, mode: str
) -> str:
    """Allocate one more device of the first pool: the answer names CDI devices a spec on the host has."""
    resource = next(iter(expected))
    one = sorted(expected[resource])[2:3]  # check_allocate took the first two
    response = await kubelet.allocate(resource, one)
    names = [d.name for d in response.cdi_devices]
    specs = sorted(p.name for p in cdi_dir.iterdir()) if cdi_dir.is_dir() else []
    known = {
        f"{doc['kind']}={dev['name']}"
        for spec in specs
        for doc in [json.loads((cdi_dir / spec).read_text())]
        for dev in doc.get("devices", [])
    }
    if not names or not set(names) <= known:
        raise CheckFailed(f"{mode}: Allocate {resource} {one}: CDI devices {names}, specs {specs}")
    return f"{mode}: --use-cdi: Allocate -> CDI devices {names}, spec {specs[0]} on the host's {cdi_dir.name}"


@dataclass(frozen=True)
class DraSide:
    """The DRA run's host side: the kubelet's plugin directories, the CDI dir and the API-server access."""

    registry_dir: Path  # the kubelet's plugins_registry: the plugin watcher walks it
    plugins_dir: Path  # the kubelet's plugins dir; the driver's own directory is mounted from it
    cdi_dir: Path
    kubeconfig: Path  # names the API-server stand-in, with a bearer token
    token: str


def split_apis(layout: simnode.NodeLayout) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Return the DRA run's pools: (device-plugin API, DRA). The first pool stays, every other moves."""
    pools = expected_pools(layout)
    first = next(iter(pools))
    return {first: pools.pop(first)}, pools


def dra_device_name(address: str) -> str:
    """Return the ResourceSlice device name of a PCI address (``0000:19:00.2`` -> ``pci-0000-19-00-2``).

    Written from docs/dra.md, not with the daemon's function, so that a wrong name in the image shows.
    """
    return "pci-" + address.replace(":", "-").replace(".", "-")


def write_dra_config(node: Node, dra_pools: Mapping[str, set[str]]) -> Node:
    """Return ``node`` with a config of its own: the same pools, those of ``dra_pools`` with api dra."""
    doc = json.loads((node.config_dir / "config.json").read_text())
    for pool in doc["resourceList"]:
        if f"{pool['resourcePrefix']}/{pool['resourceName']}" in dra_pools:
            pool["api"] = "dra"
    doc["draDriverName"] = DRA_DRIVER
    config_dir = node.kubelet_dir.parent / "config"
    config_dir.mkdir(mode=0o755)
    (config_dir / "config.json").write_text(json.dumps(doc, indent=1))
    return dataclasses.replace(node, config_dir=config_dir)


def dra_side(node: Node) -> DraSide:
    """Make the kubelet's DRA directories and the CDI dir beside the run's kubelet directory."""
    root = node.kubelet_dir.parent
    registry = root / "plugins_registry"
    registry.mkdir(mode=0o750)  # as the kubelet's plugin manager creates it
    plugins = root / "plugins"
    (plugins / DRA_DRIVER).mkdir(mode=0o755, parents=True)  # hostPath DirectoryOrCreate: 0755
    cdi_dir = root / "cdi"
    cdi_dir.mkdir(mode=0o755)
    kube = root / "kube"
    kube.mkdir(mode=0o700)
    return DraSide(registry, plugins, cdi_dir, kube / "kubeconfig", secrets.token_hex(16))


@contextlib.asynccontextmanager
async def api_server(ns: str, side: DraSide, claim: Mapping[str, Any], stderr: Path) -> AsyncIterator[int]:
    """Run ``python -m densedev.testing.apiserver`` in the node's network namespace; yield its port.

    It holds the Node and an allocated claim (as the scheduler leaves it) and asks for the token; the
    kubeconfig naming it is written once it listens.  Every write it takes is schema-checked.
    """
    claim_file = side.kubeconfig.parent / "claim.json"
    claim_file.write_text(json.dumps(claim))
    # subprocess (vfork + exec), not the loop's spawn: a fork() while gRPC's threads run makes gRPC log
    # "skipping fork() handlers" into the check's output.
    command = [
        *("ip", "netns", "exec", ns, sys.executable, "-m", "densedev.testing.apiserver"),
        *("--node", DRA_NODE, "--token", side.token, "--claim", str(claim_file)),
    ]
    with stderr.open("wb") as err, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err) as proc:
        try:
            assert proc.stdout is not None
            # Its first line is its URL; the read returns empty if it exits first.
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), GUARD_S)
            url = line.decode().strip()
            if not url.startswith("http://127.0.0.1:"):
                raise CheckFailed(f"the API-server stand-in did not start: {stderr.read_text()[-2000:]}")
            kubeconfig = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "ci", "cluster": {"server": url}}],
                "users": [{"name": "densedev", "user": {"token": side.token}}],
                "contexts": [{"name": "ci", "context": {"cluster": "ci", "user": "densedev"}}],
                "current-context": "ci",
            }
            side.kubeconfig.write_text(json.dumps(kubeconfig))
            os.chmod(side.kubeconfig, 0o600)
            yield int(url.rsplit(":", 1)[1])
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # its own way out (KeyboardInterrupt)
                try:
                    await asyncio.to_thread(proc.wait, 10)
                except subprocess.TimeoutExpired:
                    proc.kill()


async def wait_slices(ns: str, port: int, side: DraSide, expected: set[str], mode: str) -> str:
    """Poll the stand-in until the node's ResourceSlices hold exactly the expected devices, once each."""
    path = f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{DRA_NODE}"
    deadline = time.monotonic() + GUARD_S
    seen = f"nothing listed ({path})"
    while time.monotonic() < deadline:
        status, body = await asyncio.to_thread(http_status, ns, port, path, side.token)
        if status == 200:
            items = json.loads(body)["items"]
            names = [d["name"] for s in items for d in s["spec"].get("devices") or ()]
            if len(names) == len(set(names)) and set(names) == expected:
                pools = {(s["spec"]["driver"], s["spec"]["pool"]["name"]) for s in items}
                counts = {s["spec"]["pool"]["resourceSliceCount"] for s in items}
                generations = {s["spec"]["pool"]["generation"] for s in items}
                if pools != {(DRA_DRIVER, DRA_NODE)} or counts != {len(items)} or len(generations) != 1:
                    raise CheckFailed(
                        f"{mode}: slices of pools {pools}, slice counts {counts}, generations {generations}"
                    )
                return f"{mode}: {len(names)} devices published in {len(items)} ResourceSlices of one pool"
            seen = f"{len(items)} slices, {len(names)} devices ({len(set(names) & expected)} expected)"
        else:
            seen = f"{status} {body[:200]}"
        await asyncio.sleep(0.5)
    raise CheckFailed(f"{mode}: the node's ResourceSlices never held the {len(expected)} devices: {seen}")


def cdi_entries(cdi_dir: Path) -> dict[str, dict[str, Any]]:
    """Return every device entry of the CDI specs in a directory by qualified name (``kind=name``)."""
    out: dict[str, dict[str, Any]] = {}
    for spec_file in cdi_dir.glob("*.json"):
        spec = json.loads(spec_file.read_text())
        for device in spec.get("devices", ()):
            out[f"{spec['kind']}={device['name']}"] = {**device, "file": spec_file.name}
    return out


async def prepare_claim(
    kubelet: DraKubelet, side: DraSide, claim: Mapping[str, Any], resource: str, address: str, mode: str
) -> list[str]:
    """Prepare the claim through the DRA kubelet emulator, check its CDI spec on the host, unprepare it."""
    meta = claim["metadata"]
    ref = (meta["namespace"], meta["name"], meta["uid"])
    answer = (await kubelet.prepare(DRA_DRIVER, [ref]))[meta["uid"]]
    if answer.error or [(d["pool"], d["device"]) for d in answer.devices] != [
        (DRA_NODE, dra_device_name(address))
    ]:
        raise CheckFailed(f"{mode}: NodePrepareResources answered {answer}")
    ids = [cdi_id for d in answer.devices for cdi_id in d["cdi"]]
    entries = cdi_entries(side.cdi_dir)
    if not ids or not set(ids) <= set(entries):
        raise CheckFailed(f"{mode}: CDI IDs {ids} not all in the specs on the host ({sorted(entries)[:5]})")
    # What the runtime gives the container: the env of every CDI device the kubelet was told about.
    env = {e for cdi_id in ids for e in entries[cdi_id]["containerEdits"].get("env", ())}
    want = f"{env_name(resource)}={address}"
    if want not in env:
        raise CheckFailed(f"{mode}: the claim's CDI devices give {sorted(env)}, not {want}")
    spec_files = sorted({entries[cdi_id]["file"] for cdi_id in ids})
    errors = await kubelet.unprepare(DRA_DRIVER, [ref])
    left = set(ids) & set(cdi_entries(side.cdi_dir))
    if errors != {meta["uid"]: ""} or left:
        raise CheckFailed(f"{mode}: NodeUnprepareResources answered {errors}; CDI devices left: {left}")
    return [
        f"{mode}: NodePrepareResources {meta['namespace']}/{meta['name']} -> {ids} in "
        f"{side.cdi_dir.name}/{', '.join(spec_files)} on the host, giving {want}",
        f"{mode}: NodeUnprepareResources -> its CDI devices removed",
    ]


async def run_dra_container(
    engine: Engine, image: str, pod: Mapping[str, Any], node: Node, *, log: list[str]
) -> None:
    """Run the DRA overlay's container against ``node``, with the stand-in and both kubelet emulators.

    The first pool stays on the device plugin API and every other moves to DRA, as a migration does.
    """
    mode = "dra"
    dp_pools, dra_pools = split_apis(node.layout)
    node = write_dra_config(node, dra_pools)
    side = dra_side(node)
    [container_spec] = pod["containers"]
    by_volume = {m["name"]: m["mountPath"] for m in container_spec["volumeMounts"]}
    plugin_mount = by_volume.get("dra-plugin")
    if plugin_mount != f"{DRA_PLUGINS_DIR}/{DRA_DRIVER}":
        raise CheckFailed(f"{mode}: the manifest mounts the driver's directory at {plugin_mount}")
    # The kubelet dials the DRA socket at the path GetInfo names, the container's: a node mounts the
    # driver's directory at its own host path (tests/test_deploy.py holds the overlay to it), so the
    # simulated node's is mounted at its host path too, and --kubelet-plugins-dir names its parent.
    args = container_args(
        pod,
        {
            **node_volumes(node),
            "cdi": Volume(side.cdi_dir),
            "plugins-registry": Volume(side.registry_dir),
            "dra-plugin": Volume(side.plugins_dir / DRA_DRIVER),
        },
        network=f"ns:/run/netns/{node.netns}",
        mount_paths={"/sys": SYSFS_IN_CONTAINER, plugin_mount: str(side.plugins_dir / DRA_DRIVER)},
        extra_args=[
            f"--sysfs-root={SYSFS_IN_CONTAINER}",
            f"--kubelet-plugins-dir={side.plugins_dir}",
        ],
        field_refs={"spec.nodeName": DRA_NODE},
        kubeconfig=side.kubeconfig,
    )
    port = probe_port(args)
    resource = next(iter(dra_pools))
    address = sorted(dra_pools[resource])[0]
    uid = str(uuid.uuid4())
    result = {"request": "nic", "driver": DRA_DRIVER, "pool": DRA_NODE, "device": dra_device_name(address)}
    claim = allocated_claim("default", "ci-claim", uid, [result])
    expected = {dra_device_name(a) for ids in dra_pools.values() for a in ids}
    kubelet = _kubelet(node)
    dra_kubelet = DraKubelet(side.registry_dir)
    try:
        await kubelet.start()
        await dra_kubelet.start()
        stand_in = api_server(node.netns, side, claim, node.kubelet_dir.parent / "apiserver.log")
        async with stand_in as api, container(engine, image, args, mode) as name:
            log.append(await wait_registered(kubelet, dp_pools, mode))
            await wait_for(
                dra_kubelet, f"{mode}: the DRA plugin registered", lambda: DRA_DRIVER in dra_kubelet.plugins
            )
            record = dra_kubelet.plugins[DRA_DRIVER]
            # A refused GetInfo is retried with backoff, as the kubelet's plugin manager does; the
            # check only says how many there were (the socket may appear before it listens).
            retried = f" after {len(dra_kubelet.errors)} refused GetInfo" if dra_kubelet.errors else ""
            log.append(
                f"{mode}: DRA plugin {DRA_DRIVER} registered through {side.registry_dir.name}/{retried}, "
                f"{record.version} at {record.endpoint}"
            )
            log.append(await wait_slices(node.netns, api, side, expected, mode))
            await wait_for(
                dra_kubelet,
                f"{mode}: the health stream holds every DRA device Healthy",
                lambda: dra_kubelet.health(DRA_DRIVER) == {(DRA_NODE, d): "HEALTHY" for d in expected},
            )
            log.append(f"{mode}: health stream: {len(expected)} devices HEALTHY at the kubelet")
            log += await prepare_claim(dra_kubelet, side, claim, resource, address, mode)
            kubeconfig_dir = str(KUBECONFIG_IN_CONTAINER.parent)
            log += await check_probes(engine, name, pod, node, port, mode, [kubeconfig_dir])
            log.append(
                await terminate(
                    engine, name, pod, mode, [node.kubelet_dir, side.registry_dir, side.plugins_dir]
                )
            )
    finally:
        await dra_kubelet.stop()
        await kubelet.stop()


def _entrypoint(args: Sequence[str]) -> int:
    """Return the index of ``--entrypoint=``, the last podman option; the daemon's arguments follow."""
    return next(n for n, a in enumerate(args) if a.startswith("--entrypoint="))


def _split(args: Sequence[str], image: str) -> list[str]:
    """Put the image between podman's options and the container's arguments."""
    i = _entrypoint(args) + 1
    return [*args[:i], image, *args[i:]]


async def flip_pf(
    kubelet: KubeletEmulator, node: Node, mode: str, log: list[str], prefix: str = PREFIX
) -> None:
    """Take the first PF's link down and up in the node's namespace; its pool must follow."""
    pf = node.layout.pfs[0]
    resource = f"{prefix}/sriov_{pf.netdev}"
    other = f"{prefix}/{node.layout.vendor}_vfs"
    await netns.aip(node.netns, "link", "set", pf.netdev, "down")
    await wait_for(
        kubelet,
        f"{mode}: {pf.netdev} down -> {resource} Unhealthy",
        lambda: set(kubelet.devices(resource).values()) == {UNHEALTHY},
    )
    if set(kubelet.devices(other).values()) != {HEALTHY}:
        raise CheckFailed(f"{mode}: {pf.netdev} down also changed {other}")
    await netns.aip(node.netns, "link", "set", pf.netdev, "up")
    await wait_for(
        kubelet,
        f"{mode}: {pf.netdev} up -> {resource} Healthy",
        lambda: set(kubelet.devices(resource).values()) == {HEALTHY},
    )
    n = len(pf.vf_addresses)
    log.append(
        f"{mode}: rtnetlink in the container: {pf.netdev} down -> its {n} VFs Unhealthy, up -> Healthy"
    )


def memory_limit(pod: Mapping[str, Any]) -> int | None:
    """Return the container's memory limit in bytes from the manifest (None when it sets none)."""
    limit = pod["containers"][0].get("resources", {}).get("limits", {}).get("memory")
    return None if limit is None else _quantity_bytes(limit)


def _cgroup_memory_limit(pid: int) -> int | None:
    """Return the memory limit of a process's cgroup (v1 memory controller or v2), None if unlimited."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            text = Path(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes").read_text().strip()
            return None if int(text) >= 2**62 else int(text)
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            text = Path(f"/sys/fs/cgroup{line[3:]}/memory.max").read_text().strip()
            return None if text == "max" else int(text)
    raise CheckFailed(f"no memory cgroup for pid {pid}")


def confined(pid: int, limit: int | None, read_only: Sequence[str] = ()) -> str:
    """Check from the host what the kernel holds for the container's process; return a summary line.

    UID 0 with every capability set empty (``drop: [ALL]``), no_new_privs, a seccomp filter
    (RuntimeDefault), a read-only root, read-only sysfs and config mounts (and ``read_only``), and the
    memory limit.
    """
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    want = {"Uid": "0 0 0 0", "NoNewPrivs": "1", "Seccomp": "2"}
    want |= dict.fromkeys(("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), "0" * 16)
    got = {key: " ".join(status[key].split()) for key in want}
    if got != want:
        raise CheckFailed(f"the daemon's process is not confined as the DaemonSet asks: {got}")
    # /proc/<pid>/mountinfo: field 5 is the mount point, field 6 its per-mount options.
    options = {
        f[4]: set(f[5].split(","))
        for f in map(str.split, Path(f"/proc/{pid}/mountinfo").read_text().splitlines())
    }
    for target in ("/", SYSFS_IN_CONTAINER, "/etc/densedev", *read_only):
        if "ro" not in options.get(target, set()):
            raise CheckFailed(f"{target} is not mounted read-only in the container: {options.get(target)}")
    cgroup_limit = _cgroup_memory_limit(pid)
    if cgroup_limit != limit:
        raise CheckFailed(f"memory limit of the container's cgroup is {cgroup_limit}, the manifest's {limit}")
    rss = int(status["VmRSS"].split()[0]) / 1024
    return (
        f"pid {pid}: uid 0, no capabilities, no_new_privs, seccomp filter, read-only root/sysfs/config"
        f"{''.join(f', {path}' for path in read_only)}, "
        f"memory limit {limit} bytes; resident {rss:.0f} MiB"
    )


# Where the RDMA shared device plugin's DaemonSet mounts the node: each hostPath it names, as a directory
# of the run (relative to the run's root, the parent of its kubelet device-plugin dir).
RDMA_PLUGIN_HOST_PATHS = {
    "/var/lib/kubelet/device-plugins": "device-plugins",
    "/var/lib/kubelet/plugins_registry": "plugins_registry",
    "/dev/": "dev",
}
RDMA_CONFIG_DIR = "/k8s-rdma-shared-dev-plugin"  # where that plugin reads config.json (its ConfigMap)
RDMA_PREFIX = "rdma"  # its default resourcePrefix
RDMA_CM = "/dev/infiniband/rdma_cm"
# name -> (major, minor), as drivers/char/mem.c and tty_io.c number them.
BASIC_DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}


def build_rdma_node(work: Path, ns: str) -> Node:
    """A node of four RDMA PFs (two VFs each) under ``work``, its PFs' netdevs veth links in ``ns``."""
    sysfs = work / "sys"
    layout = simnode.build_node(sysfs, pfs=4, vfs_per_pf=2, rdma=True, numa_nodes=1)
    config_dir = work / "config"
    config_dir.mkdir(mode=0o755)
    netns.ip(ns, "link", "set", "lo", "up")
    for i, pf in enumerate(layout.pfs):
        netns.ip(ns, "link", "add", pf.netdev, "type", "veth", "peer", "name", f"rpeer{i}")
        netns.ip(ns, "link", "set", f"rpeer{i}", "up")
        netns.ip(ns, "link", "set", pf.netdev, "up")
    return Node(sysfs, config_dir, work, ns, layout)


def rdma_plugin_config(layout: simnode.NodeLayout) -> dict[str, Any]:
    """The node's config in the RDMA shared plugin's shape (its README's): one pool by netdev names
    (the older ``devices`` list), one by selectors with its own prefix."""
    pfs = layout.pfs
    return {
        "periodicUpdateInterval": 300,
        "configList": [
            {"resourceName": "hca_shared_a", "rdmaHcaMax": 5, "devices": [pfs[0].netdev, pfs[1].netdev]},
            {
                "resourceName": "hca_shared_b",
                "resourcePrefix": "nvidia.com",
                "rdmaHcaMax": 3,
                "selectors": {"vendors": ["15b3"], "ifNames": [pfs[2].netdev]},
            },
        ],
    }


def rdma_expected(layout: simnode.NodeLayout) -> dict[str, tuple[set[str], tuple[str, ...]]]:
    """Each pool of ``rdma_plugin_config``: its ``rdmaHcaMax`` IDs ("0" … "N-1", as that plugin lists
    them) and the PF addresses of the HCAs it selects."""
    pfs = layout.pfs
    return {
        f"{RDMA_PREFIX}/hca_shared_a": ({str(i) for i in range(5)}, (pfs[0].address, pfs[1].address)),
        "nvidia.com/hca_shared_b": ({str(i) for i in range(3)}, (pfs[2].address,)),
    }


def hca_char_devices(sysfs: Path, address: str) -> set[str]:
    """The /dev paths of a function's RDMA char devices, read from its sysfs class directories."""
    fn = os.path.realpath(sysfs / "bus" / "pci" / "devices" / address)
    out: set[str] = set()
    for cls in ("infiniband_verbs", "infiniband_mad", "infiniband_cm"):
        d = os.path.join(fn, cls)
        out.update(f"/dev/infiniband/{n}" for n in (os.listdir(d) if os.path.isdir(d) else ()))
    return out


def rdma_plugin_volumes(pod: Mapping[str, Any], node: Node) -> dict[str, Volume]:
    """Return the RDMA shared plugin DaemonSet's volumes as the run's directories: its ConfigMap holds
    this node's config.json; its /dev is a directory holding the basic devices and the node's RDMA char
    devices as udev names them (stand-in files: densedev gives a container the nodes that exist, as
    that plugin does).  Makes device nodes: root only, as the whole check."""
    root = node.kubelet_dir.parent
    volumes = {}
    for volume in pod["volumes"]:
        if "configMap" in volume:
            [item] = volume["configMap"].get("items", [{"key": "config.json", "path": "config.json"}])
            text = json.dumps(rdma_plugin_config(node.layout), indent=1)
            path = configmap_volume(root / volume["name"], item["path"], text)
        elif volume.get("hostPath", {}).get("path") in RDMA_PLUGIN_HOST_PATHS:
            path = root / RDMA_PLUGIN_HOST_PATHS[volume["hostPath"]["path"]]
            path.mkdir(mode=0o755, exist_ok=True)
        else:
            raise CheckFailed(f"volume {volume['name']!r}: not one the check provides")
        volumes[volume["name"]] = Volume(path)
    # The node's /dev as a container runtime needs it (runc opens /dev/null to set the user up): the
    # character devices every OCI container gets (runtime-spec config-linux.md, "Default Devices").
    for name, (major, minor) in BASIC_DEVICES.items():
        node_path = volumes["devs"].host_path / name
        if not node_path.exists():
            os.mknod(node_path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
            os.chmod(node_path, 0o666)  # mknod's mode is masked by the umask
    dev = volumes["devs"].host_path / "infiniband"
    dev.mkdir(mode=0o755, exist_ok=True)
    for pf in node.layout.pfs:
        for char_device in hca_char_devices(node.sysfs, pf.address):
            (dev / char_device.rsplit("/", 1)[1]).touch()
    (dev / "rdma_cm").touch()
    return volumes


async def run_rdma_plugin_container(
    engine: Engine, image: str, manifest: Path, node: Node, *, log: list[str]
) -> None:
    """Run densedev's image in the RDMA shared device plugin's DaemonSet, unchanged but for the image.

    The only deviation is the simulated sysfs (read-only at ``/host/sys``, ``--sysfs-root`` after the
    image's CMD).  Each pool must register as ``<prefix>/<resourceName>`` listing its ``rdmaHcaMax``
    IDs, all Healthy; an Allocate must give the container ``rdma_cm`` and the char devices of every HCA
    the pool selects, at the same path; SIGTERM must end the container cleanly.
    """
    mode = manifest.stem
    pod = daemonset_pod(manifest)
    args = container_args(
        pod,
        rdma_plugin_volumes(pod, node),
        network=f"ns:/run/netns/{node.netns}",
        extra_volumes={SYSFS_IN_CONTAINER: node.sysfs},
        extra_args=[f"--sysfs-root={SYSFS_IN_CONTAINER}"],
        image=await asyncio.to_thread(image_defaults, engine, image),
        token_unused=True,
    )
    expected = rdma_expected(node.layout)
    kubelet = _kubelet(node)
    await kubelet.start()
    try:
        async with container(engine, image, args, mode) as name:
            log.append(await wait_registered(kubelet, {r: ids for r, (ids, _) in expected.items()}, mode))
            for resource, (ids, hcas) in expected.items():
                want = {RDMA_CM}.union(*(hca_char_devices(node.sysfs, a) for a in hcas))
                if want == {RDMA_CM}:
                    raise CheckFailed(f"{mode}: the simulated HCAs {hcas} have no char devices")
                asked = sorted(ids)[:2]
                response = await kubelet.allocate(resource, asked)
                got = {(d.container_path, d.host_path, d.permissions) for d in response.devices}
                if got != {(p, p, "rw") for p in want}:
                    raise CheckFailed(
                        f"{mode}: Allocate {resource} {asked}: devices {sorted(got)}, want {want}"
                    )
                log.append(
                    f"{mode}: Allocate {resource} {asked} -> {len(got)} char devices of {len(hcas)} HCAs"
                )
            log.append(await terminate(engine, name, pod, mode, [node.kubelet_dir]))
    finally:
        await kubelet.stop()


def stale_namespaces() -> Iterator[str]:
    """Yield this check's network namespaces left by a killed earlier run."""
    done = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, check=False)
    for entry in json.loads(done.stdout or "[]"):
        if entry.get("name", "").startswith(f"{NS_PREFIX}-"):
            yield entry["name"]


async def check(args: argparse.Namespace) -> list[str]:
    """Run the container runs; return one line per proven fact."""
    engine = Engine(args.engine, args.label)
    pod = daemonset_pod(args.manifest)
    dra_pod = daemonset_pod(args.dra_manifest) if args.dra_manifest else None
    log: list[str] = []
    # As the test suite's `run` fixture: an exception the loop saw but nobody awaited (the kubelet
    # emulator's stream tasks) fails the check instead of passing unnoticed.
    loop_errors: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(str(ctx)))
    # One simulated node for every run: the container only reads its sysfs, and each run gets its own
    # kubelet directory (the DRA run its own config too).
    with netns.namespace(NS_PREFIX) as ns:
        node = await asyncio.to_thread(build_node, args.work, ns)
        for netlink in (False, True):
            run = "netlink" if netlink else "no-netlink"
            t = time.monotonic()
            await run_container(
                engine, args.image, pod, fresh_kubelet_dir(node, run), netlink=netlink, log=log
            )
            log.append(f"{run}: the run took {time.monotonic() - t:.1f} s")
        for i, manifest in enumerate(args.go_plugin_manifest):
            t = time.monotonic()
            # A short name: the kubelet dials the plugin's socket under this path (sun_path: 107 bytes).
            run_node = fresh_kubelet_dir(node, f"go{i}")
            await run_go_plugin_container(engine, args.image, manifest, run_node, log=log)
            log.append(f"{manifest.stem}: the run took {time.monotonic() - t:.1f} s")
        if args.rdma_plugin_manifest is not None:
            # Its own node (RDMA HCAs) in its own namespace: the PFs' netdev names are the first node's.
            t = time.monotonic()
            with netns.namespace(NS_PREFIX) as rdma_ns:
                rdma_node = await asyncio.to_thread(build_rdma_node, args.work / "rdma", rdma_ns)
                run_node = fresh_kubelet_dir(rdma_node, "rdma")
                await run_rdma_plugin_container(
                    engine, args.image, args.rdma_plugin_manifest, run_node, log=log
                )
            log.append(f"{args.rdma_plugin_manifest.stem}: the run took {time.monotonic() - t:.1f} s")
        if dra_pod is not None:
            t = time.monotonic()
            await run_dra_container(engine, args.image, dra_pod, fresh_kubelet_dir(node, "dra"), log=log)
            log.append(f"dra: the run took {time.monotonic() - t:.1f} s")
    if loop_errors:
        raise CheckFailed(f"unhandled exceptions in the host's event loop: {loop_errors[:3]}")
    return log


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run the checks, print what they proved, exit 1 with one line on a failed check."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--engine", default="podman")
    parser.add_argument("--label", default="io.densedev.ci=image", help="label put on every container")
    parser.add_argument("--manifest", type=Path, default=Path("deploy/base/daemonset.yaml"))
    parser.add_argument(
        "--dra-manifest",
        type=Path,
        default=None,
        help="deploy/overlays/dra rendered by `kubectl kustomize`: also run its container (DRA mode)",
    )
    parser.add_argument(
        "--go-plugin-manifest",
        type=Path,
        action="append",
        default=[],
        help="a DaemonSet that runs the SR-IOV network device plugin's image: run densedev's in its place",
    )
    parser.add_argument(
        "--rdma-plugin-manifest",
        type=Path,
        default=None,
        help="a DaemonSet that runs the RDMA shared device plugin's image: run densedev's in its place",
    )
    parser.add_argument("--work", type=Path, required=True, help="an empty directory for the nodes")
    args = parser.parse_args(argv)
    for ns in stale_namespaces():
        # A killed run's API-server stand-in still serves in its namespace (its containers are removed
        # by label in image.sh): end what runs there before the name goes.
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], check=False)
    try:
        for line in uvloop.run(check(args)):
            print(f"image check: {line}")
    except CheckFailed as exc:
        print(f"image check FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

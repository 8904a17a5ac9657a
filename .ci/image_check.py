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

    python .ci/image_check.py --image REF [--engine podman] [--manifest deploy/base/daemonset.yaml]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import uvloop
import yaml

from densedev import cli
from densedev.model import HEALTHY, UNHEALTHY
from densedev.ops.metrics import parse_addr
from densedev.testing import netns, simnode
from densedev.testing.kubelet import KubeletEmulator

PREFIX = "intel.com"  # simnode.write_config's resourcePrefix
GUARD_S = 60.0  # turns a hang into a failure; nothing here asserts speed
NS_PREFIX = "densedev-ci"
SYSFS_IN_CONTAINER = "/host/sys"


class CheckFailed(Exception):
    """One check of the container run failed; the message says which and what was seen."""


class Volume(NamedTuple):
    """What a pod volume is on this host: a directory to bind-mount."""

    host_path: Path


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
) -> list[str]:
    """Return the ``podman run`` options and command that run the pod's only container as a node would.

    ``volumes`` gives each pod volume's host directory here; ``mount_paths`` moves a mount to another
    container path; ``extra_args`` are appended to the container's arguments, where argparse lets the
    last occurrence of a flag win (as the kustomize components do).  Raises ``CheckFailed`` on any
    field of the manifest it cannot reproduce.
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
    if uid is None or gid is None:
        raise CheckFailed("the pod must set runAsUser and runAsGroup (the image's USER is not assumed)")
    out.append(f"--user={uid}:{gid}")

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

    out += [f"--env={e['name']}={e['value']}" for e in c.get("env", [])]
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

    command = c.get("command")
    if not command:
        raise CheckFailed("the container must set command (the image's ENTRYPOINT is not assumed)")
    out += [f"--entrypoint={command[0]}"]
    return [*out, *command[1:], *c.get("args", []), *extra_args]


def expected_pools(layout: simnode.NodeLayout) -> dict[str, set[str]]:
    """Return resource → device IDs as ``simnode.write_config``'s pools select them from the layout.

    One pool per PF of the first half (``pfNames``), then one for every other VF of the vendor: written
    from the layout, not from densedev's selectors, so a wrong selection in the image shows.
    """
    half = max(1, len(layout.pfs) // 2)
    pools = {f"{PREFIX}/sriov_{pf.netdev}": set(pf.vf_addresses) for pf in layout.pfs[:half]}
    pools[f"{PREFIX}/{layout.vendor}_vfs"] = {a for pf in layout.pfs[half:] for a in pf.vf_addresses}
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


def http_status(ns: str, port: int, path: str) -> tuple[int, str]:
    """GET ``http://127.0.0.1:port/path`` from inside network namespace ``ns``: (status, body)."""
    probe = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        f"    r = urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=5)\n"
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


async def wait_for(kubelet: KubeletEmulator, what: str, predicate: Any) -> None:
    """Wait for the emulator's state to satisfy ``predicate``; CheckFailed names ``what`` on expiry."""
    try:
        await kubelet.wait_for(predicate, GUARD_S)
    except TimeoutError:
        raise CheckFailed(f"{what}: not seen within {GUARD_S:.0f} s") from None


async def run_container(
    engine: Engine, image: str, pod: Mapping[str, Any], node: Node, *, netlink: bool, log: list[str]
) -> None:
    """Run the DaemonSet's container once against ``node`` and check what the kubelet emulator sees."""
    mode = "netlink" if netlink else "no-netlink"
    name = f"{NS_PREFIX}-{mode}-{os.getpid()}"
    args = container_args(
        pod,
        {
            "device-plugins": Volume(node.kubelet_dir),
            "pod-resources": Volume(node.kubelet_dir.parent / "pod-resources"),
            "sys": Volume(node.sysfs),
            "config": Volume(node.config_dir),
        },
        network=f"ns:/run/netns/{node.netns}",
        mount_paths={"/sys": SYSFS_IN_CONTAINER},
        extra_args=[f"--sysfs-root={SYSFS_IN_CONTAINER}", *(() if netlink else ("--no-netlink",))],
    )
    # Where the probes go: the daemon's own parser reads the command line (the last flag wins).
    # (The parser checks that --sysfs-root exists: the container's mount point does not on the host.)
    command = [a for a in args[_entrypoint(args) + 1 :] if not a.startswith("--sysfs-root=")]
    host, port = parse_addr(cli.build_parser().parse_args(command).metrics_addr)
    if host not in ("", "127.0.0.1"):
        raise CheckFailed(f"metrics address {host}:{port}: the probes reach 127.0.0.1 only")
    expected = expected_pools(node.layout)
    kubelet = KubeletEmulator(
        node.kubelet_dir, pod_resources_socket=node.kubelet_dir.parent / "pod-resources" / "kubelet.sock"
    )
    await kubelet.start()
    started = False
    try:
        await engine.acall(
            "run", "--detach", f"--name={name}", f"--label={engine.label}", *_split(args, image)
        )
        started = True
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
        log.append(f"{mode}: {len(expected)} pools registered, {total} devices listed, all Healthy")

        pid = int((await engine.acall("inspect", "--format={{.State.Pid}}", name)).strip())
        log.append(f"{mode}: {confined(pid, memory_limit(pod))}")

        await wait_http_ok(node.netns, port, "/healthz")
        body = await wait_http_ok(node.netns, port, "/readyz")
        log.append(f"{mode}: /healthz 200, /readyz 200 on 127.0.0.1:{port} ({body.splitlines()[0][:60]})")

        resource = next(iter(expected))
        ids = sorted(expected[resource])[:2]
        response = await kubelet.allocate(resource, ids)
        got = response.envs.get(env_name(resource), "")
        if sorted(got.split(",")) != ids:
            raise CheckFailed(f"{mode}: Allocate {resource} {ids}: {env_name(resource)}={got!r}")
        log.append(f"{mode}: Allocate {resource} {ids} -> {env_name(resource)}={got}")

        if netlink:
            await flip_pf(kubelet, node, mode, log)

        await engine.acall("kill", "--signal=TERM", name)
        grace = float(pod.get("terminationGracePeriodSeconds", 30))
        code = (await engine.acall("wait", name, timeout=grace + 10)).strip()
        if code != "0":
            raise CheckFailed(f"{mode}: exit code {code} after SIGTERM (want 0)")
        left = sorted(
            p.name for p in node.kubelet_dir.iterdir() if p.is_socket() and p.name != "kubelet.sock"
        )
        if left:
            raise CheckFailed(f"{mode}: sockets left in the kubelet dir after SIGTERM: {left}")
        logs = await asyncio.to_thread(engine.logs, name)
        if "Traceback" in logs:
            raise CheckFailed(f"{mode}: the daemon's log holds a traceback:\n{logs[-3000:]}")
        log.append(f"{mode}: SIGTERM -> exit 0, sockets removed, no traceback in the log")
    except Exception as exc:
        # Whatever went wrong (a refused Allocate, an engine call that hung), the container's own
        # account comes first, then one line saying which check failed.
        if started:
            tail = "\n".join((await asyncio.to_thread(engine.logs, name)).splitlines()[-30:])
            print(f"--- last log lines of {name}:\n{tail}", file=sys.stderr)
        if isinstance(exc, CheckFailed):
            raise
        raise CheckFailed(f"{mode}: {type(exc).__name__}: {exc}") from exc
    finally:
        await kubelet.stop()
        await engine.acall("rm", "--force", "--time=0", name, check=False)


def _entrypoint(args: Sequence[str]) -> int:
    """Return the index of ``--entrypoint=``, the last podman option; the daemon's arguments follow."""
    return next(n for n, a in enumerate(args) if a.startswith("--entrypoint="))


def _split(args: Sequence[str], image: str) -> list[str]:
    """Put the image between podman's options and the container's arguments."""
    i = _entrypoint(args) + 1
    return [*args[:i], image, *args[i:]]


async def flip_pf(kubelet: KubeletEmulator, node: Node, mode: str, log: list[str]) -> None:
    """Take the first PF's link down and up in the node's namespace; its pool must follow."""
    pf = node.layout.pfs[0]
    resource = f"{PREFIX}/sriov_{pf.netdev}"
    other = f"{PREFIX}/{node.layout.vendor}_vfs"
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


def confined(pid: int, limit: int | None) -> str:
    """Check from the host what the kernel holds for the container's process; return a summary line.

    UID 0 with every capability set empty (``drop: [ALL]``), no_new_privs, a seccomp filter
    (RuntimeDefault), a read-only root and read-only sysfs and config mounts, and the memory limit.
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
    for target, mode in (("/", "ro"), (SYSFS_IN_CONTAINER, "ro"), ("/etc/densedev", "ro")):
        if mode not in options.get(target, set()):
            raise CheckFailed(f"{target} is not mounted {mode} in the container: {options.get(target)}")
    cgroup_limit = _cgroup_memory_limit(pid)
    if cgroup_limit != limit:
        raise CheckFailed(f"memory limit of the container's cgroup is {cgroup_limit}, the manifest's {limit}")
    rss = int(status["VmRSS"].split()[0]) / 1024
    return (
        f"pid {pid}: uid 0, no capabilities, no_new_privs, seccomp filter, read-only root/sysfs/config, "
        f"memory limit {limit} bytes; resident {rss:.0f} MiB"
    )


def stale_namespaces() -> Iterator[str]:
    """Yield this check's network namespaces left by a killed earlier run."""
    done = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, check=False)
    for entry in json.loads(done.stdout or "[]"):
        if entry.get("name", "").startswith(f"{NS_PREFIX}-"):
            yield entry["name"]


async def check(args: argparse.Namespace) -> list[str]:
    """Run both container runs; return one line per proven fact."""
    engine = Engine(args.engine, args.label)
    pod = daemonset_pod(args.manifest)
    log: list[str] = []
    # As the test suite's `run` fixture: an exception the loop saw but nobody awaited (the kubelet
    # emulator's stream tasks) fails the check instead of passing unnoticed.
    loop_errors: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(str(ctx)))
    # One simulated node for both runs: the container only reads its sysfs and config, and each run
    # gets its own kubelet directory.
    with netns.namespace(NS_PREFIX) as ns:
        node = await asyncio.to_thread(build_node, args.work, ns)
        for netlink in (False, True):
            run = "netlink" if netlink else "no-netlink"
            await run_container(
                engine, args.image, pod, fresh_kubelet_dir(node, run), netlink=netlink, log=log
            )
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
    parser.add_argument("--work", type=Path, required=True, help="an empty directory for the nodes")
    args = parser.parse_args(argv)
    for ns in stale_namespaces():
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

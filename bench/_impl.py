"""Which implementation a benchmark measures, said loudly before any figure (shared by bench_*.py).

The scripts import densedev from ``src/``, which holds the Cython extension only after an in-place build;
without one, ``accel`` silently picks the plain-Python twin and every "extension" figure is the twin's.
So a benchmark refuses to run without the extension unless the twin was asked for explicitly
(``DENSEDEV_NO_EXTENSIONS=1``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from densedev import accel  # noqa: E402
from densedev.model import Device, Role  # noqa: E402

# A ConnectX VF bound to mlx5_core with every per-device field blank: benches _replace() what they vary.
MLX5_VF = Device(
    id="", role=Role.VF, vendor="15b3", device="101e", pci_class="020000", subsystem_vendor="15b3",
    subsystem_device="0000", driver="mlx5_core", numa_node=0, iommu_group=-1, noiommu=False,
    acpi_index=-1, total_vfs=0, num_vfs=0, pf="", vf_index=0, pf_netdev="", netdevs=(),
    link_type="ether", rdma_device="", rdma_nodes=(), uio="", vdpa="", vdpa_driver="", pcie_root="",
    aux_type="",
)  # fmt: skip


BUILD = f"{sys.executable} -m pip install 'cython>=3.0' && {sys.executable} setup.py build_ext --inplace"


def announce(script: str) -> None:
    """Print which implementation ``script`` measures; exit 2 if the extension is missing unasked."""
    name = Path(script).name
    if {"--child", "--tracker-only"} & set(sys.argv[1:]):
        return  # a script's own helper process: its parent announced, and its stdout is data
    if accel.IMPLEMENTATION == "cython":
        where = getattr(accel.impl, "__file__", "?")
        print(f"### {name}: measuring the Cython extension ({where})", flush=True)
        return
    if accel.NO_EXTENSIONS:
        print(f"### {name}: measuring the PLAIN-PYTHON TWIN (DENSEDEV_NO_EXTENSIONS is set)", flush=True)
        return
    reason = accel.FALLBACK_REASON or "not built"
    sys.exit(
        f"{name}: the Cython extension is not available in {SRC} ({reason}); these figures would be the "
        f"plain-Python twin's. Build it in place from the repository root: {BUILD} "
        "(or set DENSEDEV_NO_EXTENSIONS=1 to measure the twin on purpose)"
    )


def arguments(script: str, doc: str | None, quick: str) -> argparse.ArgumentParser:
    """Announce what ``script`` measures; return its parser with the shared ``--quick`` and ``--json``."""
    announce(script)
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def kept(workdir: Path) -> None:
    """Say on stderr that ``--dir`` kept the simulated nodes, how much they hold and how to free it."""
    total = 0
    for dirpath, _dirs, files in os.walk(workdir):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    where = "RAM (tmpfs)" if str(workdir.resolve()).startswith("/dev/shm") else "disk"
    print(
        f"kept the simulated nodes in {workdir} for the next run: {total / 2**20:.0f} MiB of {where}; "
        f"rm -rf {workdir} frees it",
        file=sys.stderr,
    )


@contextlib.contextmanager
def scratch(prefix: str, parent: str | Path | None = None) -> Iterator[Path]:
    """Yield a new directory under ``parent`` (default: the system's temp dir), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def workdir(given: Path | None, prefix: str) -> Iterator[Path]:
    """Yield where to build simulated nodes: ``--dir`` if given (kept, and said so), else a scratch dir."""
    if given is None:
        with scratch(prefix) as path:
            yield path
        return
    given.mkdir(parents=True, exist_ok=True)
    try:
        yield given
    finally:
        kept(given)


# --------------------------------------------------------------------------- the daemon as a process
# Shared by the benchmarks that start ``densedev run`` as its own process (bench_e2e, bench_startup):
# the same command line and environment a DaemonSet would run, pointed at a simulated node.


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Return the median seconds of ``repeat`` calls (median: the machine is shared and noisy)."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def rss_mib(pid: int) -> float:
    """Resident memory of a process now, in MiB (/proc/<pid>/statm, second field, in pages)."""
    with open(f"/proc/{pid}/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User + system CPU time a process has used (/proc/<pid>/stat fields 14 and 15, in clock ticks),
    with ``children`` also that of its children it has waited for (fields 16 and 17)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


async def past_catch_up(margin_s: float = 1.0) -> None:
    """Wait out the full rescan a daemon makes a second after a start from its scanning child's table
    (``daemon.CATCH_UP_RESCAN_S``): a start-up transient, not part of what a benchmark of a running
    daemon times (a scan of 16,384 VFs in a worker thread delays the event loop by a few ms)."""
    from densedev.daemon import CATCH_UP_RESCAN_S

    await asyncio.sleep(CATCH_UP_RESCAN_S + margin_s)


def daemon_env(pycache: Path | None = None, src: Path = SRC) -> dict[str, str]:
    """The environment of a daemon child: this one, importing densedev from ``src`` (this tree's).

    With ``pycache``, the child keeps bytecode there (``PYTHONPYCACHEPREFIX``) even if this environment
    says ``PYTHONDONTWRITEBYTECODE``: an installed densedev has its bytecode written at install time, so
    start-up figures without it would time the compiler, not the daemon.
    """
    env = {**os.environ, "PYTHONPATH": str(src)}
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


@contextlib.asynccontextmanager
async def emulator_child() -> AsyncIterator[Path]:
    """Run the kubelet emulator in a child process (its buffers are not the daemon's) on a new kubelet
    dir; yield the dir once ``kubelet.sock`` is there, and stop the emulator and remove the dir after."""
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))
    emulator = subprocess.Popen(
        [sys.executable, "-m", "densedev", "kubelet-emulator", str(kubelet_dir)],
        env=daemon_env(),
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (kubelet_dir / "kubelet.sock").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kubelet emulator did not listen in {kubelet_dir} within 60 s")
            await asyncio.sleep(0.05)
        yield kubelet_dir
    finally:
        emulator.terminate()
        await asyncio.to_thread(emulator.wait, 30)
        shutil.rmtree(kubelet_dir, ignore_errors=True)


def traced_settings(sysfs: Path, kubelet_dir: Path, work: Path, config: Path) -> Any:
    """The settings of a daemon run in a benchmark's own process under tracemalloc: no netlink, no polling."""
    from densedev.settings import DaemonSettings

    return DaemonSettings(
        sysfs_root=sysfs,
        kubelet_dir=kubelet_dir,
        dev_root=work / "dev",
        config_path=config,
        netlink=False,
        config_poll_s=3600.0,
    )


def daemon_argv(
    config: Path,
    sysfs: Path,
    kubelet_dir: Path,
    dev_root: Path,
    netns: str | None,
    python_flags: tuple[str, ...] = (),
    src: Path = SRC,
    python: str = sys.executable,
) -> list[str]:
    """``densedev run`` on a simulated node: devinfo off (needs root paths), errors-only logging.

    ``netns`` names the namespace holding the PFs' links; None turns netlink off (the simulated PF
    links do not exist in the host's namespace).  ``python_flags`` go to the interpreter
    (``-X importtime``), ``python`` is the interpreter (this one by default).  The module is the
    installed ``densedev`` command's (``densedev.__main__``), or ``densedev.cli`` for a ``src`` tree
    from before that entry point existed (before/after runs).
    """
    netlink = ["--netns", netns] if netns is not None else ["--no-netlink"]
    module = "densedev" if (src / "densedev" / "__main__.py").exists() else "densedev.cli"
    return [
        python,
        *python_flags,
        "-m",
        module,
        "run",
        "--config",
        str(config),
        "--sysfs-root",
        str(sysfs),
        "--kubelet-dir",
        str(kubelet_dir),
        "--dev-root",
        str(dev_root),
        "--devinfo-dir",
        "",
        *netlink,
        "--log-level",
        "error",
    ]


def veth_pfs(ns: str, netdevs: list[str]) -> None:
    """Make each PF netdev a real veth link, up, in namespace ``ns`` (one ``ip -batch`` run)."""
    import subprocess

    batch = subprocess.run(
        ["ip", "-n", ns, "-batch", "-"],
        input="".join(
            f"link add {name} type veth peer name p{i}\nlink set p{i} up\nlink set {name} up\n"
            for i, name in enumerate(netdevs)
        ),
        text=True,
        capture_output=True,
    )
    if batch.returncode:
        raise RuntimeError(batch.stderr)


# Inodes one simulated VF takes (its directory, attribute files, links and class views): a 65,536-VF node
# holds ~2 million, which a shared /dev/shm may not have free even with gigabytes to spare.
INODES_PER_DEVICE = 35


def tmpfs_dir(need: int = 4 << 30, devices: int = 0) -> str | None:
    """/dev/shm when it is writable with ``need`` bytes and inodes for ``devices`` simulated VFs free, else
    None (the system's temp directory)."""
    import shutil

    if not os.access("/dev/shm", os.W_OK) or shutil.disk_usage("/dev/shm").free <= need:
        return None
    if os.statvfs("/dev/shm").f_favail <= devices * INODES_PER_DEVICE:
        return None
    return "/dev/shm"

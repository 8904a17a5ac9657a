"""The daemon's settings: every path it reads and writes and its timings (from the CLI, tests, the demo)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .dra import DraSettings
from .model import DEFAULT_PREFIX
from .node.events import DEFAULT_RCVBUF
from .node.layout import SYSFS_ROOT


class DaemonSettings(NamedTuple):
    """Where the daemon reads and writes; every path is a parameter so tests and the demo relocate it."""

    sysfs_root: Path = Path(SYSFS_ROOT)
    kubelet_dir: Path = Path("/var/lib/kubelet/device-plugins")
    dev_root: Path = Path("/dev")
    cdi_dir: Path | None = None
    devinfo_dir: Path | None = None
    cdi_annotations: bool = False  # also return cdi.k8s.io/ annotations (runtimes without CRI CDI fields)
    resource_prefix: str = DEFAULT_PREFIX
    config_path: Path | None = None  # watched for changes when set
    metrics_addr: str | None = None
    netlink: bool = True  # watch rtnetlink links and kernel uevents
    netns: str | None = None  # watch links and uevents in this named network namespace (tests)
    netlink_rcvbuf: int = DEFAULT_RCVBUF  # each netlink socket's receive buffer (fault tests shrink it)
    config_poll_s: float = 1.0
    housekeeping_s: float = 1.0  # how often registration state is copied into metrics
    registration_poll_s: float = 0.2  # how often each pool checks kubelet.sock and its own socket
    pod_resources_socket: Path | None = None  # the kubelet's PodResources API (None: checkpoint only)
    in_use_poll_s: float = 5.0  # PodResources poll while no device is withheld (0.25 s while some are)
    start_timeout_s: float = 60.0  # no pool served this long: /readyz and the exit code say so
    start_retry_s: tuple[float, float] = (0.5, 10.0)  # backoff of a pool that failed to start
    dra: DraSettings | None = None  # None: no DRA side (pools with "api": "dra" are not served)

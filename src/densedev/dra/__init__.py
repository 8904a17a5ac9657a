"""Dynamic Resource Allocation: the same engine's pools served as ResourceSlices and DRA claims.

This module holds only what the daemon and the command line need before they know whether DRA is used:
its settings, their default kubelet paths and the name of the prepared claims' checkpoint.  The driver,
its kubelet plugin and its API-server client (gRPC DRA services, kubernetes_asyncio, aiohttp) are imported
by the daemon only when a pool's API is DRA or prepared claims are on record, so a device-plugin-only node
never loads them (issue 14: start-up).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
CHECKPOINT_NAME = "checkpoint.json"
# Slice writes per second per node, and the burst (issue 26).  A node writes a slice at most once a
# second already (the publisher's per-slice limit); the bucket caps the node as a whole, so a flap storm
# on a node of hundreds of slices costs the API server at most WRITE_QPS of its mutating seats, whatever
# the node's size.  client-go's default (rest.Config: QPS 5, burst 10) covers every request of a
# client; ours meters writes only (a node's reads are one LIST per watch loss).  The burst is a whole
# start of a 65,536-device node (512 slices of 128), so a start is never held back by it.
WRITE_QPS = 20.0
WRITE_BURST = 512


class DraSettings(NamedTuple):
    """Where the DRA side talks to the kubelet and the API server."""

    node_name: str | None = None  # the Node object's name: the ResourceSlices' pool and nodeName
    kubeconfig: Path | None = None  # None: the in-cluster service account
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    taints: bool = False  # taint unhealthy devices NoSchedule instead of withdrawing them
    min_write_interval_s: float = 1.0  # per slice: at most one write per interval
    retry_s: tuple[float, float] = (0.5, 30.0)  # backoff of a start that failed
    write_qps: float = WRITE_QPS  # slice writes per second for the whole node (0: no limit) ...
    write_burst: int = WRITE_BURST  # ... and how many may go at once (WRITE_QPS says why)
    # A renamed driver holding no claim stops once its slices are deleted, or after this long at most
    # (the kubelet deletes a deregistered driver's slices itself: at once on 1.32, after 30 s later).
    withdraw_wait_s: float = 10.0
    # ... and not before this long after its last answer to the kubelet: the kubelet may drop the
    # connection as it deregisters the driver, and an answer it has not read yet would be lost with it
    # (it would then retry an Unprepare against a driver that is gone).
    retire_linger_s: float = 1.0

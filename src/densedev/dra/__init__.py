"""Dynamic Resource Allocation: the same engine's pools served as ResourceSlices and DRA claims."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
CHECKPOINT_NAME = "checkpoint.json"


@dataclass(frozen=True)
class DraSettings:
    """Where the DRA side talks to the kubelet and the API server."""

    node_name: str | None = None  # the Node object's name: the ResourceSlices' pool and nodeName
    kubeconfig: Path | None = None  # None: the in-cluster service account
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    taints: bool = False  # taint unhealthy devices NoSchedule instead of withdrawing them
    min_write_interval_s: float = 1.0  # per slice: at most one write per interval
    retry_s: tuple[float, float] = (0.5, 30.0)  # backoff of a start that failed

"""``densedev dra-slices`` and ``densedev dra-manifests``: DRA's dry run and its cluster objects.

Both print a ``v1 List`` as JSON, which ``kubectl apply -f -`` / ``kubectl diff -f -`` take as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..node.layout import SYSFS_ROOT
from . import classes, slices

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def add_parsers(sub: Any, add_common: Callable[[argparse.ArgumentParser], None], default_prefix: str) -> None:
    """Add the two sub-commands to the ``densedev`` parser."""
    s = sub.add_parser(
        "dra-slices",
        help="print, as JSON, the ResourceSlices the daemon would publish (every device healthy, none held)",
    )
    add_common(s)
    s.add_argument("--config", type=Path, required=True)
    s.add_argument("--sysfs-root", type=Path, default=Path(SYSFS_ROOT))
    s.add_argument("--node-name", default=os.environ.get("NODE_NAME") or None, help="default: $NODE_NAME")
    s.add_argument("--resource-prefix", default=default_prefix)
    s.add_argument("--api-version", choices=[v.value for v in slices.ApiVersion], default="v1")
    s.add_argument("--dra-taints", action="store_true", help="size slices as with tainting (64 devices)")

    m = sub.add_parser("dra-manifests", help="print the DeviceClasses of the DRA pools and the RBAC as JSON")
    add_common(m)
    m.add_argument("--config", type=Path, required=True)
    m.add_argument("--resource-prefix", default=default_prefix)
    m.add_argument("--api-version", choices=[v.value for v in slices.ApiVersion], default="v1")
    m.add_argument(
        "--namespace", default=classes.DEFAULT_NAMESPACE, help="the daemon's ServiceAccount namespace"
    )
    m.add_argument("--service-account", default=classes.DEFAULT_SERVICE_ACCOUNT)


def _print_list(items: list[dict[str, Any]]) -> None:
    json.dump({"apiVersion": "v1", "kind": "List", "items": items}, sys.stdout, indent=1)
    print()


def _load(args: argparse.Namespace) -> Any:
    from ..pools import config

    try:
        return config.load(args.config, default_prefix=args.resource_prefix)
    except config.ConfigError as exc:
        for p in exc.problems:
            print(f"{exc.source}: {p}", file=sys.stderr)
        return None


def cmd_slices(args: argparse.Namespace) -> int:
    """Print the node's ResourceSlices as the publisher would first write them (generation 1)."""
    from ..node import scanner as discovery
    from ..pools import select as selectors

    node = args.node_name
    if not node:
        print("densedev dra-slices: --node-name (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    if len(node) > 253 or not _DNS_SUBDOMAIN.fullmatch(node):
        print(f"densedev dra-slices: node name {node!r} is not a DNS subdomain", file=sys.stderr)
        return 2
    cfg = _load(args)
    if cfg is None:
        return 1
    table = discovery.scan(args.sysfs_root)
    pools = slices.dra_pools(selectors.build_pools(cfg, table.devices))
    out = slices.build_slices(
        node,
        cfg.dra_driver_name,
        pools,
        version=slices.ApiVersion(args.api_version),
        taints=args.dra_taints,
    )
    _print_list(out)
    return 0


def cmd_manifests(args: argparse.Namespace) -> int:
    """Print the DeviceClasses of the config's DRA pools and the daemon's RBAC."""
    cfg = _load(args)
    if cfg is None:
        return 1
    _print_list(
        classes.manifests(
            cfg.pools,
            cfg.dra_driver_name,
            version=args.api_version,
            namespace=args.namespace,
            service_account=args.service_account,
        )
    )
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "dra-slices": cmd_slices,
    "dra-manifests": cmd_manifests,
}

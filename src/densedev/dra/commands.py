"""``densedev dra-slices``, ``dra-manifests`` and ``dra-check-params``: DRA's dry run, its cluster objects,
and a check of claim parameters before they are applied.

The first two print a ``v1 List`` as JSON, which ``kubectl apply -f -`` / ``kubectl diff -f -`` take as it is.
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

from ..model import DEFAULT_DRIVER_NAME
from ..node.layout import SYSFS_ROOT
from . import classes, slices

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def add_parsers(sub: Any, add_common: Callable[[argparse.ArgumentParser], None], default_prefix: str) -> None:
    """Add the DRA sub-commands to the ``densedev`` parser."""
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

    c = sub.add_parser(
        "dra-check-params",
        help="check the claim parameters (VfConfig) in a ResourceClaimTemplate, ResourceClaim or DeviceClass "
        "file, as Prepare would, before applying it",
    )
    add_common(c)
    c.add_argument("file", type=Path, help="JSON, or YAML (one or more documents) when PyYAML is installed")
    c.add_argument(
        "--driver",
        default=DEFAULT_DRIVER_NAME,
        help="the DRA driver name whose opaque config is checked (the config's draDriverName)",
    )


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


class _Unreadable(Exception):
    """The file cannot be checked at all (unreadable, not JSON or YAML): one line, exit 2."""


def _documents(path: Path) -> list[Any]:
    """Return the objects a file holds: one JSON value, or every document of a YAML stream."""
    from ..pools.validator import ConfigError, read_config_bytes

    try:
        data = read_config_bytes(path)  # at most 1 MiB of a regular file: never blocks on a FIFO
    except ConfigError as exc:
        raise _Unreadable("; ".join(exc.problems)) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _Unreadable(f"not UTF-8 text (byte {exc.start})") from None
    try:
        return [json.loads(text)]
    except json.JSONDecodeError as exc:
        json_error = f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
    except RecursionError:
        raise _Unreadable("nested too deeply") from None
    try:
        # PyYAML is not a dependency of densedev (only of its tests): YAML is read when it is there.
        import yaml
    except ImportError:
        raise _Unreadable(f"{json_error} (YAML needs PyYAML, which is not installed)") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return [d for d in yaml.load_all(text, Loader=loader) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise _Unreadable(f"neither JSON nor YAML: {problem}{at}") from None
    except RecursionError:
        raise _Unreadable("nested too deeply") from None


def _objects(docs: list[Any]) -> list[dict[str, Any]]:
    """Return the objects to check: the documents, and the items of any ``List``."""
    found: list[dict[str, Any]] = []
    for d in docs:
        if isinstance(d, dict) and d.get("kind") == "List" and isinstance(d.get("items"), list):
            found.extend(i for i in d["items"] if isinstance(i, dict))
        elif isinstance(d, dict):
            found.append(d)
    return found


def cmd_check_params(args: argparse.Namespace) -> int:
    """Check every VfConfig a file's objects give our driver: a line per problem (exit 1) or a summary."""
    from ..printable import clip, escape
    from . import params

    shown = escape(str(args.file))
    try:
        objects = _objects(_documents(args.file))
    except _Unreadable as exc:
        print(f"densedev dra-check-params: error: {shown}: {exc}", file=sys.stderr)
        return 2
    checked = [params.check_object(o, args.driver) for o in objects if o.get("kind") in params.CHECKED_KINDS]
    if not checked:
        kinds = ", ".join(sorted({clip(str(o.get("kind")), 40) for o in objects})) or "nothing"
        print(
            f"densedev dra-check-params: error: {shown}: no {', '.join(params.CHECKED_KINDS)} in it "
            f"(found {kinds})",
            file=sys.stderr,
        )
        return 2
    problems = 0
    for c in checked:
        for p in c.problems:
            print(f"{shown}: {c.label}: {p}")
        problems += len(c.problems)
    if problems:
        return 1
    for c in checked:
        if not c.configs:
            print(f"{shown}: {c.label}: OK, no config for {clip(args.driver, 63)}")
        for request, cfg in c.configs.items():
            settings = {k: v for k, v in cfg.to_json().items() if k not in ("apiVersion", "kind")}
            print(f"{shown}: {c.label}: OK, request {clip(request, 64)}: {json.dumps(settings)}")
        for other in c.other_drivers:
            ours = clip(args.driver, 63)
            print(f"{shown}: {c.label}: note: config for driver {other} is not checked (not {ours})")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "dra-slices": cmd_slices,
    "dra-manifests": cmd_manifests,
    "dra-check-params": cmd_check_params,
}

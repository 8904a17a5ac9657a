"""DeviceClasses for the pools served through DRA, and the RBAC the daemon needs to publish them.

One DeviceClass per DRA pool selects that pool's devices by CEL (our driver and the ``resourceName``
attribute every device of the pool carries, see ``slices.py``), and sets ``extendedResourceName`` to the
pool's resource name, so a pod that still asks ``intel.com/sriov_x: 1`` can be served by DRA on clusters
with the DRAExtendedResource feature (alpha 1.34, beta 1.36; resource.k8s.io/v1 DeviceClassSpec).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from ..model import PoolApi, PoolConfig

GROUP = "resource.k8s.io"
ATTR_RESOURCE_NAME = "resourceName"  # unprefixed: in the driver's own attribute domain
DEFAULT_NAMESPACE = "kube-system"
DEFAULT_SERVICE_ACCOUNT = "densedev"  # deploy/base/serviceaccount.yaml
ROLE_NAME = "densedev-dra"
_NOT_LABEL = re.compile(r"[^a-z0-9]+")


def device_class_name(full_name: str) -> str:
    """Return the DeviceClass name of a resource: ``intel.com/sriov_x`` → ``sriov-x.intel.com``.

    DeviceClass names are DNS subdomains (lowercase); the resource's prefix already is one, and its name
    part becomes one DNS label (runs of anything else folded into '-').
    """
    prefix, _, name = full_name.partition("/")
    label = _NOT_LABEL.sub("-", name.lower()).strip("-") or "pool"
    return f"{label}.{prefix}"


def cel_selector(driver: str, full_name: str) -> str:
    """Return the CEL expression selecting the devices of one pool (the CEL ``device`` variable's fields)."""
    # json.dumps quotes like a CEL string literal for the names we allow (no control characters).
    return (
        f"device.driver == {json.dumps(driver)} && "
        f"device.attributes[{json.dumps(driver)}].{ATTR_RESOURCE_NAME} == {json.dumps(full_name)}"
    )


def device_class(pool: PoolConfig, driver: str, version: str = "v1") -> dict[str, Any]:
    """Return the DeviceClass of one DRA pool (``extendedResourceName`` only in v1, where it exists)."""
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": cel_selector(driver, pool.full_name)}}]}
    if version == "v1":
        spec["extendedResourceName"] = pool.full_name
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "DeviceClass",
        "metadata": {
            "name": device_class_name(pool.full_name),
            "labels": {"app.kubernetes.io/managed-by": "densedev"},
        },
        "spec": spec,
    }


def rbac(
    namespace: str = DEFAULT_NAMESPACE,
    service_account: str = DEFAULT_SERVICE_ACCOUNT,
    driver: str | None = None,
) -> list[dict[str, Any]]:
    """Return the ClusterRole and ClusterRoleBinding the daemon's ServiceAccount needs for DRA.

    What the official helper documents a driver needs (slices CRUD, claims get, nodes get for the
    Node UID in ownerReferences), plus deletecollection to drop all of its slices at once, and the
    claim status writes (``status.devices[]`` after Prepare, issue 25 §3): get, update and patch on
    ``resourceclaims/status``; with ``driver``, also what 1.36's granular status authorization asks
    (``resourceclaims/driver``, verbs ``associated-node:update``/``patch``, the driver's name;
    api resource/v1 ``SubresourceDriver``, ``VerbPrefixAssociatedNode``), unused by older servers.
    """
    claim_rules: list[dict[str, Any]] = [
        {"apiGroups": [GROUP], "resources": ["resourceclaims"], "verbs": ["get"]},
        {"apiGroups": [GROUP], "resources": ["resourceclaims/status"], "verbs": ["get", "update", "patch"]},
    ]
    if driver is not None:
        claim_rules.append(
            {
                "apiGroups": [GROUP],
                "resources": ["resourceclaims/driver"],
                "resourceNames": [driver],
                "verbs": ["associated-node:update", "associated-node:patch"],
            }
        )
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": ROLE_NAME},
        "rules": [
            {
                "apiGroups": [GROUP],
                "resources": ["resourceslices"],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"],
            },
            *claim_rules,
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": ROLE_NAME},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }
    return [role, binding]


def manifests(
    pools: Iterable[PoolConfig],
    driver: str,
    *,
    version: str = "v1",
    namespace: str = DEFAULT_NAMESPACE,
    service_account: str = DEFAULT_SERVICE_ACCOUNT,
) -> list[dict[str, Any]]:
    """Return the DeviceClass of every DRA pool, then the RBAC objects (``densedev dra-manifests``)."""
    classes = [device_class(p, driver, version) for p in pools if p.api is PoolApi.DRA]
    return [*classes, *rbac(namespace, service_account, driver)]

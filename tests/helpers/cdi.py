"""What a runtime's CDI registry checks in a spec, written from the CDI schema, not from densedev."""

from __future__ import annotations

import re
from typing import Any

# From the CDI JSON schema and SPEC.md: what a runtime's CDI registry refuses to load.
KIND_RE = re.compile(
    r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*/[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$"
)
NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
QUALIFIED_RE = re.compile(r"^(?P<kind>[^=]+)=(?P<name>.+)$")


def validate_spec(doc: dict[str, Any]) -> None:
    """Fail unless ``doc`` has every field the CDI schema requires, in the right shape."""
    assert set(doc) <= {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}, (
        "unknown top-level field"
    )
    assert isinstance(doc["cdiVersion"], str) and re.match(r"^\d+\.\d+\.\d+$", doc["cdiVersion"])
    assert KIND_RE.match(doc["kind"]), doc["kind"]
    assert isinstance(doc["devices"], list) and doc["devices"], "a spec needs at least one device"
    names = [d["name"] for d in doc["devices"]]
    assert len(names) == len(set(names)), "device names must be unique within a kind"
    for d in doc["devices"]:
        assert set(d) <= {"name", "annotations", "containerEdits"}
        assert NAME_RE.match(d["name"]), d["name"]
        edits = d["containerEdits"]
        assert edits, "runtimes refuse a device with empty container edits"
        assert set(edits) <= {
            "env",
            "deviceNodes",
            "hooks",
            "mounts",
            "additionalGids",
            "intelRdt",
            "netDevices",
        }
        for n in edits.get("deviceNodes", []):
            assert n["path"].startswith("/dev/") and n["hostPath"].startswith("/dev/")
            assert set(n["permissions"]) <= set("rwm")
        for e in edits.get("env", []):
            assert re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", e), e

"""Device-info files for Multus and SR-IOV CNI (the Network Plumbing WG device-info spec, 1.1.0).

The device plugin writes ``<dir>/<prefix>-<name>-<address>-device.json`` at Allocate; the CNI plugin
that later attaches the interface reads it and copies it into the pod's ``network-status`` annotation,
where applications (DPDK, KubeVirt) find the PCI address of the device they were given.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .cdi import write_atomic
from .model import Device

log = logging.getLogger(__name__)

DEFAULT_DEVINFO_DIR = Path("/var/run/k8s.cni.cncf.io/devinfo/dp")
SPEC_VERSION = "1.1.0"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")


def file_name(prefix: str, name: str, device_id: str) -> str:
    """Return the device-info file name the CNI side looks up: ``<prefix>-<name>-<address>-device.json``."""
    return _UNSAFE.sub("_", f"{prefix}-{name}-{device_id}") + "-device.json"


def info_document(device: Device, vhost_net: bool, vdpa_path: str) -> dict[str, Any]:
    """Return the device-info document of a device: ``type: vdpa`` if a vDPA device sits on it, else pci."""
    if device.vdpa:
        vdpa: dict[str, str] = {
            "parent-device": device.vdpa,
            # The spec names the bus driver without the "_vdpa" suffix: "vhost" or "virtio".
            "driver": device.vdpa_driver.removesuffix("_vdpa"),
            "pci-address": device.id,
        }
        if vdpa_path:
            vdpa["path"] = vdpa_path
        if device.pf:
            vdpa["pf-pci-address"] = device.pf
        return {"type": "vdpa", "version": SPEC_VERSION, "vdpa": vdpa}
    pci: dict[str, str] = {"pci-address": device.id}
    if device.pf:
        pci["pf-pci-address"] = device.pf
    if device.rdma_device:
        pci["rdma-device"] = device.rdma_device
    if vhost_net:
        pci["vhost-net"] = "/dev/vhost-net"
    return {"type": "pci", "version": SPEC_VERSION, "pci": pci}


def encode(doc: dict[str, Any]) -> bytes:
    """Return the canonical bytes of a device-info document."""
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


class InfoWriter:
    """Writes and removes one pool's device-info files, remembering which ones it wrote."""

    def __init__(self, directory: Path, prefix: str, name: str) -> None:
        self.directory = directory
        self.prefix = prefix
        self.name = name
        self.written: set[str] = set()  # device IDs whose file this writer created or refreshed

    def path_of(self, device_id: str) -> Path:
        """Return the device-info file path of a device of this pool."""
        return self.directory / file_name(self.prefix, self.name, device_id)

    def write_all(self, docs: dict[str, dict[str, Any]]) -> None:
        """Write every document, or none: on an error, files written by this call are removed again."""
        done: list[str] = []
        try:
            for device_id, doc in docs.items():
                if write_atomic(self.path_of(device_id), encode(doc)) or device_id not in self.written:
                    done.append(device_id)
                self.written.add(device_id)
        except BaseException:
            for device_id in done:
                self.remove((device_id,))
            raise

    def remove(self, device_ids: Iterable[str]) -> None:
        """Remove the files of these devices (left the pool, or shutdown); missing files are fine."""
        for device_id in device_ids:
            self.written.discard(device_id)
            try:
                self.path_of(device_id).unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cannot remove device-info file %s: %s", self.path_of(device_id), e)

    def close(self) -> None:
        """Remove every file this writer wrote."""
        self.remove(sorted(self.written))

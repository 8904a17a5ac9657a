"""Capture golden netlink and uevent datagrams from real veth links in a throw-away network namespace.

Run as root from the repository root:  PYTHONPATH=src python tests/data/netlink/capture.py
Writes ``<name>.hex`` (one datagram per line) and ``<name>.json`` (the expected decode: pyroute2's for
link messages, the kernel's documented record layout for uevents) beside this file.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import subprocess
import uuid
from pathlib import Path

from densedev.node.events import NETLINK_KOBJECT_UEVENT, NETLINK_ROUTE, RTMGRP_LINK, open_netlink_socket
from densedev.testing.reference import pyroute2_links

HERE = Path(__file__).resolve().parent


def uevent_fields(data: bytes) -> list[object]:
    """Split a kernel uevent by its documented layout (lib/kobject_uevent.c), independently of ours."""
    head, *rest = data.rstrip(b"\0").split(b"\0")
    action, devpath = head.decode().split("@", 1)
    return [action, devpath, [kv.decode().split("=", 1) for kv in rest]]


def drain(sock: socket.socket, timeout: float = 0.5) -> list[bytes]:
    """Read datagrams until the socket has been quiet for ``timeout`` seconds."""
    out = []
    while select.select([sock], [], [], timeout)[0]:
        out.append(sock.recv(1 << 18))
    return out


def ip(ns: str, *args: str) -> None:
    """Run ``ip -n ns ...`` and fail loudly."""
    subprocess.run(["ip", "-n", ns, *args], check=True)


def save(name: str, datagrams: list[bytes], expected: list[object]) -> None:
    """Write one capture and its expected decode."""
    (HERE / f"{name}.hex").write_text("".join(d.hex() + "\n" for d in datagrams))
    rows = ",\n ".join(json.dumps(item) for item in expected)  # type: ignore[attr-defined]
    (HERE / f"{name}.json").write_text(f"[\n {rows}\n]\n")


def main() -> None:
    """Create a namespace with veth pairs, capture a dump, link flips, a deletion and uevents."""
    ns = f"densedev-cap-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        path = Path("/var/run/netns") / ns
        route = open_netlink_socket(NETLINK_ROUTE, RTMGRP_LINK, path)
        uev = open_netlink_socket(NETLINK_KOBJECT_UEVENT, 1, path)
        route.setblocking(True)
        for k in range(4):
            ip(ns, "link", "add", f"ens{k}f0", "type", "veth", "peer", "name", f"ens{k}f0p")
        ip(ns, "link", "set", "ens0f0p", "up")
        ip(ns, "link", "set", "ens0f0", "up")
        ip(ns, "link", "set", "ens1f0", "up")  # up without carrier: its peer stays down
        drain(route)
        uevents = drain(uev)
        save("uevent_veth_add", uevents, [uevent_fields(d) for d in uevents])

        # One RTM_GETLINK dump: multi-part, ends with NLMSG_DONE.
        req = struct.pack("=IHHII", 32, 18, 0x301, 1, 0) + struct.pack("=BBHiII", 0, 0, 0, 0, 0, 0)
        route.send(req)
        dump = drain(route)
        save("dump_veth", dump, [pyroute2_links(d) for d in dump])

        ip(ns, "link", "set", "ens0f0", "down")
        ip(ns, "link", "set", "ens0f0", "up")
        ip(ns, "link", "del", "ens3f0")
        events = drain(route)
        save("events_flip_del", events, [pyroute2_links(d) for d in events])
        uevents = drain(uev)
        save("uevent_veth_remove", uevents, [uevent_fields(d) for d in uevents])
        route.close()
        uev.close()
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    print("captured into", HERE, os.listdir(HERE))


if __name__ == "__main__":
    main()

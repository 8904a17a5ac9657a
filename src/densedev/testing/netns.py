"""Network namespaces for tests and benchmarks: create, run ``ip`` inside, flip links by rtnetlink.

Subprocesses are started with :mod:`subprocess` (``vfork`` on Linux), never with the event loop's own
spawner: libuv forks, and gRPC's ``pthread_atfork`` handlers then run in the child of a process with
live gRPC threads, which has been seen to crash ``ip`` with SIGSEGV before it could ``exec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import struct
import subprocess
import uuid
from collections.abc import Iterator

from ..node.events import NETLINK_ROUTE, open_netlink_socket, resolve_netns

RTM_NEWLINK = 16  # include/uapi/linux/rtnetlink.h
NLM_F_REQUEST = 0x1
IFF_UP = 0x1


def available() -> str | None:
    """Return why namespaces cannot be made here (not root, no iproute2), or None when they can."""
    import os

    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return None


@contextlib.contextmanager
def namespace(prefix: str = "densedev-t") -> Iterator[str]:
    """Create a uniquely named network namespace and delete it afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, text=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def ip(ns: str, *args: str) -> None:
    """Run ``ip -n ns ...``; raise with ip's message on failure."""
    done = subprocess.run(["ip", "-n", ns, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip -n {ns} {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")


async def aip(ns: str, *args: str) -> None:
    """Run ``ip -n ns ...`` in a worker thread so the event loop keeps turning."""
    await asyncio.to_thread(ip, ns, *args)


def ifindexes(ns: str) -> dict[str, int]:
    """Return every link's ifindex in the namespace, by name."""
    out = subprocess.run(["ip", "-j", "-n", ns, "link", "show"], check=True, capture_output=True, text=True)
    return {link["ifname"]: link["ifindex"] for link in json.loads(out.stdout)}


def link_request(ifindex: int, up: bool, seq: int = 0) -> bytes:
    """Return an RTM_NEWLINK request that changes only IFF_UP of a link.

    ``struct nlmsghdr`` (len, type, flags, seq, pid) then ``struct ifinfomsg`` (family, pad, type,
    index, flags, change), as ``ip link set X up|down`` sends it.
    """
    ifinfo = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, ifindex, IFF_UP if up else 0, IFF_UP)
    return struct.pack("=IHHII", 16 + len(ifinfo), RTM_NEWLINK, NLM_F_REQUEST, seq, 0) + ifinfo


class LinkSwitch:
    """Flips links in a namespace with raw rtnetlink requests: no process per flip, exact send time."""

    def __init__(self, ns: str) -> None:
        self.index = ifindexes(ns)
        self._sock = open_netlink_socket(NETLINK_ROUTE, 0, resolve_netns(ns))
        self._seq = 0

    def set(self, ifname: str, up: bool) -> None:
        """Send the request that sets ``ifname`` up or down."""
        self._seq += 1
        self._sock.send(link_request(self.index[ifname], up, self._seq))

    def close(self) -> None:
        """Close the netlink socket."""
        self._sock.close()

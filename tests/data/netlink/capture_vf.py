"""Capture the kernel's answers to VF settings on a veth (no SR-IOV) for ``tests/test_vfnetlink.py``.

Run as root from the repository root: ``PYTHONPATH=src python tests/data/netlink/capture_vf.py``.
Writes ``vf_veth_answers.hex`` (one datagram a line) and ``vf_veth_answers.json`` (each one's message
type, and for an NLMSG_ERROR its errno and the reason decode_ack gave when captured).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from densedev.node.events import NETLINK_ROUTE, open_netlink_socket, resolve_netns
from densedev.node.vfnetlink import (
    NETLINK_CAP_ACK,
    NETLINK_EXT_ACK,
    SOL_NETLINK,
    LinkState,
    VfSettings,
    decode_ack,
    encode_getlink,
    encode_set_mtu,
    encode_set_vf,
)
from densedev.testing import netns as nsmod

HERE = Path(__file__).parent


def main() -> None:
    with nsmod.namespace() as ns:
        nsmod.ip(ns, "link", "add", "pf0", "type", "veth", "peer", "name", "pf0p")
        index = nsmod.ifindexes(ns)["pf0"]
        sock = open_netlink_socket(NETLINK_ROUTE, 0, resolve_netns(ns))
        sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
        sock.setblocking(True)
        requests = [
            encode_set_vf(index, 0, VfSettings(mac="02:00:00:00:00:01", trust=True), 1),
            encode_set_vf(index, 0, VfSettings(link_state=LinkState.DISABLE), 2),
            encode_set_mtu(index, 70000, 3),  # above veth's max_mtu: EINVAL with an extack message
            encode_getlink(index, 4),  # the link, then the ACK
        ]
        lines, expected = [], []
        for request in requests:
            sock.send(request)
            while True:
                data = sock.recv(1 << 16)
                lines.append(data.hex())
                mtype = int.from_bytes(data[4:6], "little")
                if mtype == 2:
                    err, reason = decode_ack(data)
                    expected.append({"type": mtype, "errno": err, "reason": reason})
                    break
                expected.append({"type": mtype})
        sock.close()
    (HERE / "vf_veth_answers.hex").write_text("\n".join(lines) + "\n")
    (HERE / "vf_veth_answers.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    socket.setdefaulttimeout(5)
    main()

"""pyroute2 as the reference decoder: what the Cython netlink parser is checked and benchmarked against."""

from __future__ import annotations

from typing import Any

from pyroute2.netlink.rtnl.ifinfmsg import state_by_name
from pyroute2.netlink.rtnl.marshal import MarshalRtnl

LinkRow = tuple[int, int, str, int, int, int, int]
_LINK_TYPES = (16, 17)  # RTM_NEWLINK, RTM_DELLINK


def pyroute2_links(data: bytes, marshal: Any = None) -> list[LinkRow]:
    """Decode a netlink datagram with pyroute2 into ``parse_links``' layout (-1 / "" where absent).

    Pass one ``MarshalRtnl`` to decode many datagrams without rebuilding it (as a benchmark should).
    """
    out: list[LinkRow] = []
    for msg in (marshal or MarshalRtnl()).parse(data):
        mtype = msg["header"]["type"]
        if mtype not in _LINK_TYPES:
            continue
        oper = msg.get_attr("IFLA_OPERSTATE")
        carrier = msg.get_attr("IFLA_CARRIER")
        link = msg.get_attr("IFLA_LINK")
        out.append(
            (
                mtype,
                msg["index"],
                msg.get_attr("IFLA_IFNAME") or "",
                msg["flags"],
                -1 if oper is None else state_by_name[oper],
                -1 if carrier is None else carrier,
                -1 if link is None else link,
            )
        )
    return out

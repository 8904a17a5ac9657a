"""Rebinding a VF's driver through the kernel's sysfs interface, bounded in time and put back on failure.

The kernel's way (Documentation/ABI/testing/sysfs-bus-pci, drivers/pci/pci-sysfs.c, drivers/base/bus.c):
write the driver's name to ``<dev>/driver_override``, the address to ``<dev>/driver/unbind`` when a
driver holds the function, then the address to ``bus/pci/drivers_probe``; the kernel probes the drivers
whose match allows it (with an override set, only the named one) and, on success, makes ``<dev>/driver``
a link to ``bus/pci/drivers/<name>``.  A kernel-bound VF's ``net/<ifname>`` goes with the unbind and comes
back with a network driver's bind; with ``vfio-pci`` the process needs ``/dev/vfio/<group>``.

On a real kernel each write returns when the kernel is done (or with its errno).  The simulated kernel
(:mod:`densedev.testing.simkernel`) works over ordinary files, so it cannot block a write: it *answers*
each command through the file's content -- empty when done, ``!<errno>`` when refused.  The waits below
accept both: a write-only attribute that cannot be read back (the real ``unbind``, ``bind`` and
``drivers_probe``) was answered by the write itself.  Every wait is bounded by the caller's timeout.

Everything here blocks: callers on the event loop run it through ``workers.run(Work.REBIND, ...)``.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import os
import re
import select
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import layout

__all__ = [
    "Binding",
    "Reason",
    "RebindError",
    "binding_of",
    "busy_reason",
    "host_addresses",
    "override_of",
    "rebind",
    "restore",
]

VFIO_PCI = "vfio-pci"
# Drivers a vfio group tolerates beside vfio-pci (drivers/vfio/group.c vfio_dev_driver_allowed()):
# the group stays viable with these (or no driver) on its other members.
_GROUP_TOLERATED = frozenset({VFIO_PCI, "pci-stub", "pcieport"})
_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\Z")
_DRIVER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
NULL_OVERRIDE = "(null)"  # what driver_override shows when none is set (drivers/pci/pci-sysfs.c)
IFF_UP = 0x1  # include/uapi/linux/if.h
# A simulated node records its host interfaces' addresses here (densedev.testing.simnode); a real
# /sys can never hold it (sysfs has no user-made files), so its presence says the tree is simulated.
SIM_ADDRESSES = ".simnode/addresses.json"
_POLL_STEPS = (0.0002, 0.0005, 0.001)  # seconds between looks: at most 1 ms past the kernel's answer
_NETLINK_TIMEOUT = 1.0  # an address dump answers in microseconds; this only bounds a wedged socket


class Reason(enum.Enum):
    """Why a rebind was refused or failed: the kind of a RebindError."""

    BAD_INPUT = "bad-input"  # an address or driver name that cannot be one
    NO_DEVICE = "no-device"  # no such PCI function under the sysfs root
    NOT_VF = "not-vf"  # a PF or plain function: rebinding it would take down what hangs on it
    NO_DRIVER = "no-driver"  # the driver asked for is not loaded (no bus/pci/drivers/<name>)
    UNSAFE = "unsafe"  # a link or command file that is not what the kernel makes (planted symlink)
    BUSY = "busy"  # the VF's netdev is up with addresses or used by the host
    GROUP = "group"  # another member of the IOMMU group keeps the vfio group unusable
    REFUSED = "refused"  # the kernel refused a write (its errno)
    TIMEOUT = "timeout"  # the kernel did not finish within the bound


class RebindError(Exception):
    """A rebind refused or failed, in one line; ``reason`` says the kind, ``restored`` what was put back.

    ``restored`` is None when nothing was changed (refused before the first write), True when the
    device was put back on its old driver, False when putting it back failed too (its state is unknown:
    callers keep it withheld).
    """

    def __init__(self, reason: Reason, pci: str, detail: str, restored: bool | None = None) -> None:
        super().__init__(f"{pci}: {detail}")
        self.reason = reason
        self.pci = pci
        self.detail = detail
        self.restored = restored
        self.errno: int | None = None


@dataclass(frozen=True)
class Binding:
    """What a PCI function is bound to now: its driver, its IOMMU group and its host interfaces."""

    driver: str | None
    iommu_group: str | None
    netdevs: tuple[str, ...]


# ------------------------------------------------------------------------------------------------ reads


def _check_pci(pci: str) -> str:
    if not isinstance(pci, str) or not _BDF.match(pci):
        raise RebindError(Reason.BAD_INPUT, str(pci)[:40], "not a PCI address (expected 0000:3b:00.2)")
    return pci


def _inside(path: str, top: str) -> bool:
    return path.startswith(top + os.sep)


def _device_dir(root: str, pci: str) -> str:
    """The function's real directory, refused unless it resolves inside ``<root>/devices``."""
    link = os.path.join(root, layout.PCI_DEVICES, pci)
    if not os.path.lexists(link):
        raise RebindError(Reason.NO_DEVICE, pci, f"no PCI function under {root}/{layout.PCI_DEVICES}")
    real = os.path.realpath(link)
    if not _inside(real, os.path.join(root, "devices")) or os.path.basename(real) != pci:
        raise RebindError(Reason.UNSAFE, pci, f"{layout.PCI_DEVICES}/{pci} does not lead to a PCI function")
    return real


def _driver_of(root: str, pci: str, dev: str) -> str | None:
    link = os.path.join(dev, "driver")
    try:
        os.readlink(link)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # a file or directory where the kernel keeps a link
            raise RebindError(Reason.UNSAFE, pci, "its driver entry is not a link") from None
        raise RebindError(Reason.UNSAFE, pci, f"its driver link cannot be read: {exc.strerror}") from None
    real = os.path.realpath(link)
    drivers = os.path.join(root, layout.PCI_DRIVERS)
    if os.path.dirname(real) != drivers or not os.path.isdir(real) or os.path.islink(real):
        raise RebindError(Reason.UNSAFE, pci, f"its driver link leads outside {layout.PCI_DRIVERS}")
    return os.path.basename(real)


def _group_of(root: str, pci: str, dev: str) -> str | None:
    link = os.path.join(dev, "iommu_group")
    if not os.path.lexists(link):
        return None
    real = os.path.realpath(link)
    if os.path.dirname(real) != os.path.join(root, layout.IOMMU_GROUPS) or not os.path.isdir(real):
        raise RebindError(Reason.UNSAFE, pci, f"its iommu_group link leads outside {layout.IOMMU_GROUPS}")
    return os.path.basename(real)


def _netdevs(dev: str) -> tuple[str, ...]:
    net = os.path.join(dev, "net")
    if os.path.islink(net):
        return ()  # the kernel makes net/ a directory; a link here was planted and names nothing
    try:
        return tuple(sorted(os.listdir(net)))
    except (FileNotFoundError, NotADirectoryError):
        return ()


def _binding(root: str, pci: str, dev: str) -> Binding:
    return Binding(_driver_of(root, pci, dev), _group_of(root, pci, dev), _netdevs(dev))


def binding_of(sysfs_root: Path | str, pci: str) -> Binding:
    """Return what the function ``pci`` is bound to; RebindError if it is absent or its links are not sane."""
    root = os.path.realpath(sysfs_root)
    return _binding(root, _check_pci(pci), _device_dir(root, pci))


def _read_at(dirfd: int, name: str) -> bytes:
    # O_NOFOLLOW: a symlink planted at a command file's name is refused (ELOOP), never followed;
    # O_NONBLOCK: nor does a FIFO planted there hang the reader.
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def override_of(sysfs_root: Path | str, pci: str) -> str | None:
    """Return the function's ``driver_override`` (None when unset, shown as ``(null)``, or absent)."""
    root = os.path.realpath(sysfs_root)
    dev = _device_dir(root, _check_pci(pci))
    dirfd = os.open(dev, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        raw = _read_at(dirfd, "driver_override")
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None
        if exc.errno == errno.ELOOP:
            raise RebindError(Reason.UNSAFE, pci, "its driver_override is a symlink") from None
        raise RebindError(Reason.REFUSED, pci, f"driver_override cannot be read: {exc.strerror}") from None
    finally:
        os.close(dirfd)
    if not raw:
        return None  # a function without the attribute's value (a bare simulated tree)
    text = raw.decode(errors="replace")
    # The kernel shows "<name>\n" or "(null)\n"; anything else is a write it has not taken (yet), or
    # the simulated kernel's "!<errno>" refusal: the value is unknown, and callers must not guess.
    if not text.endswith("\n") or text == "\n" or text.startswith("!"):
        raise RebindError(Reason.TIMEOUT, pci, "driver_override holds a write the kernel has not taken")
    text = text.strip()
    return None if text == NULL_OVERRIDE else text


# --------------------------------------------------------------------------------------- busy netdevs


def _sim_addresses(root: str) -> dict[str, list[str]] | None:
    path = os.path.join(root, SIM_ADDRESSES)
    if not os.path.isdir(os.path.join(root, ".simnode")):
        return None
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {"?": ["(unreadable record)"]}  # fail closed: an unreadable record counts as addresses
    return doc if isinstance(doc, dict) else {}


# <linux/if_addr.h>: struct ifaddrmsg { u8 family, prefixlen, flags, scope; u32 index; }; IFA_ADDRESS 1,
# IFA_LOCAL 2.  RTM_GETADDR 22 / RTM_NEWADDR 20 (<linux/rtnetlink.h>); NLM_F_REQUEST|NLM_F_DUMP 0x301.
_NLMSG = struct.Struct("=IHHII")
_IFADDR = struct.Struct("=BBBBI")
_RTA = struct.Struct("=HH")
_RTM_NEWADDR, _RTM_GETADDR, _NLMSG_DONE, _NLMSG_ERROR = 20, 22, 3, 2


def _rtnl_addresses(netns: str | None) -> dict[int, list[str]]:
    """Dump the namespace's addresses by rtnetlink: ifindex → ``addr/prefix`` strings."""
    from .events import NETLINK_ROUTE, open_netlink_socket, resolve_netns

    sock = open_netlink_socket(NETLINK_ROUTE, 0, resolve_netns(netns) if netns else None)
    out: dict[int, list[str]] = {}
    try:
        body = _IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        sock.send(_NLMSG.pack(_NLMSG.size + len(body), _RTM_GETADDR, 0x301, 1, 0) + body)
        deadline = time.monotonic() + _NETLINK_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([sock], [], [], left)[0]:
                raise OSError(errno.ETIMEDOUT, "no answer to the address dump")
            buf = sock.recv(1 << 16)
            pos = 0
            while pos + _NLMSG.size <= len(buf):
                length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(buf, pos)
                if length < _NLMSG.size:
                    return out
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    err = -struct.unpack_from("=i", buf, pos + _NLMSG.size)[0]
                    raise OSError(err, os.strerror(err))
                if kind == _RTM_NEWADDR:
                    family, prefix, _f, _scope, index = _IFADDR.unpack_from(buf, pos + _NLMSG.size)
                    a = pos + _NLMSG.size + _IFADDR.size
                    found: dict[int, bytes] = {}
                    while a + _RTA.size <= pos + length:
                        alen, atype = _RTA.unpack_from(buf, a)
                        if alen < _RTA.size:
                            break
                        found[atype] = buf[a + _RTA.size : a + alen]
                        a += (alen + 3) & ~3
                    raw = found.get(2) or found.get(1)
                    if raw is not None and family in (socket.AF_INET, socket.AF_INET6):
                        out.setdefault(index, []).append(f"{socket.inet_ntop(family, raw)}/{prefix}")
                pos += (length + 3) & ~3
    finally:
        sock.close()


def host_addresses(
    sysfs_root: Path | str, ifnames: tuple[str, ...], netns: str | None = None
) -> dict[str, list[str]]:
    """Return the addresses the host's interfaces ``ifnames`` carry, not counting IPv6 link-local ones.

    A simulated node keeps its record in ``.simnode/addresses.json``; a real one is asked by rtnetlink
    (an ``RTM_GETADDR`` dump in ``netns``), matching interfaces by the ifindex sysfs shows.  The kernel
    gives every up interface an ``fe80::/64`` address on its own (addrconf), so those say nothing about
    use.
    """
    root = os.path.realpath(sysfs_root)
    sim = _sim_addresses(root)
    found: dict[str, list[str]] = {}
    if sim is not None:
        for ifname in ifnames:
            found[ifname] = [str(a) for a in sim.get(ifname, []) or []] + list(sim.get("?", []))
    else:
        by_index = _rtnl_addresses(netns)
        for ifname in ifnames:
            try:
                with open(os.path.join(root, layout.NET_CLASS, ifname, "ifindex")) as f:
                    index = int(f.read().strip())
            except (OSError, ValueError):
                found[ifname] = ["(ifindex unreadable)"]  # fail closed: cannot tell, so in use
                continue
            found[ifname] = by_index.get(index, [])
    return {k: [a for a in v if not a.lower().startswith("fe80:")] for k, v in found.items()}


def _flags_up(netdir: str) -> bool:
    try:
        with open(os.path.join(netdir, "flags")) as f:
            return bool(int(f.read().strip(), 16) & IFF_UP)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(netdir, "operstate")) as f:
            return f.read().strip() not in ("down", "notpresent")
    except OSError:
        return True  # cannot tell: count it as up (fail closed)


def busy_reason(sysfs_root: Path | str, pci: str, *, netns: str | None = None) -> str | None:
    """Return why the function's host interfaces forbid taking its driver away, or None when none do.

    Busy: an interface enslaved to another (its ``master`` link: a bond, a bridge, OVS), one with an
    upper device on it (``upper_<name>`` links: VLANs, macvlans), or one that is up (``flags`` has
    IFF_UP) and carries addresses.  Unbinding such a VF would cut the host's own traffic.
    """
    root = os.path.realpath(sysfs_root)
    dev = _device_dir(root, _check_pci(pci))
    names = _netdevs(dev)
    if not names:
        return None
    reasons: list[str] = []
    up: list[str] = []
    for ifname in names:
        netdir = os.path.join(dev, "net", ifname)
        if os.path.lexists(os.path.join(netdir, "master")):
            master = os.path.basename(os.path.realpath(os.path.join(netdir, "master")))
            reasons.append(f"netdev {ifname} is enslaved to {master}")
            continue
        try:
            uppers = sorted(e[len("upper_") :] for e in os.listdir(netdir) if e.startswith("upper_"))
        except OSError:
            uppers = []
        if uppers:
            reasons.append(f"netdev {ifname} carries {', '.join(uppers)}")
            continue
        if _flags_up(netdir):
            up.append(ifname)
    if up:
        try:
            addresses = host_addresses(root, tuple(up), netns)
        except OSError as exc:
            return f"addresses of {', '.join(up)} cannot be read ({exc.strerror or exc})"
        for ifname in up:
            if addresses.get(ifname):
                reasons.append(f"netdev {ifname} is up with {', '.join(addresses[ifname][:3])}")
    return "; ".join(reasons) or None


# -------------------------------------------------------------------------------------------- writes

# A command file that can be read back is answered through its content (the simulated kernel): two
# writers of one such shared file (drivers_probe, a driver's bind) would mix their texts, so writers in
# this process take turns on it.  A real kernel's write-only attributes need no turns.
_turns: dict[str, threading.Lock] = {}
_turns_lock = threading.Lock()


def _turn(path: str) -> threading.Lock:
    with _turns_lock:
        lock = _turns.get(path)
        if lock is None:
            lock = _turns[path] = threading.Lock()
        return lock


class _Step:
    """One rebind's writes and waits, all against one deadline."""

    def __init__(self, root: str, pci: str, dev: str, deadline: float) -> None:
        self.root = root
        self.pci = pci
        self.dev = dev
        self.deadline = deadline

    def fail(self, reason: Reason, detail: str, err: int | None = None) -> RebindError:
        exc = RebindError(reason, self.pci, detail)
        exc.errno = err
        return exc

    def command(self, directory: str, name: str, text: str, expect: bytes = b"") -> None:
        """Write ``text`` to ``directory/name`` and wait for the kernel's answer (``expect`` read back)."""
        what = os.path.relpath(os.path.join(directory, name), self.root)
        try:
            dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise self.fail(Reason.UNSAFE if exc.errno in (errno.ELOOP, errno.ENOTDIR) else Reason.NO_DRIVER,
                            f"{os.path.relpath(directory, self.root)}: {exc.strerror}") from None  # fmt: skip
        try:
            shared = self._readable(dirfd, name)
            # The turn is taken before the open: O_TRUNC would wipe another writer's pending text.
            with _turn(os.path.join(directory, name)) if shared else contextlib.nullcontext():
                # O_NONBLOCK: a FIFO planted at the name must not hang the open (ENXIO without a reader).
                flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_TRUNC
                try:
                    fd = os.open(name, flags, dir_fd=dirfd)
                except OSError as exc:
                    reason = Reason.UNSAFE if exc.errno in (errno.ELOOP, errno.ENXIO) else Reason.REFUSED
                    raise self.fail(reason, f"{what} cannot be opened: {exc.strerror}", exc.errno) from None
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # sysfs attributes are regular files
                    os.close(fd)
                    raise self.fail(Reason.UNSAFE, f"{what} is not a regular file")
                try:
                    os.write(fd, text.encode())
                except OSError as exc:
                    # The kernel's answer on a real node: the store's errno (ENODEV: no match, EBUSY ...).
                    raise self.fail(Reason.REFUSED, f"the kernel refused {what}: {exc.strerror}",
                                    exc.errno) from None  # fmt: skip
                finally:
                    os.close(fd)
                if shared:
                    self._answer(dirfd, name, what, expect)
        finally:
            os.close(dirfd)

    @staticmethod
    def _readable(dirfd: int, name: str) -> bool:
        try:
            _read_at(dirfd, name)
        except OSError:
            return False  # a write-only attribute (EACCES): the write is the kernel's whole answer
        return True

    def _answer(self, dirfd: int, name: str, what: str, expect: bytes) -> None:
        n = 0
        while True:
            try:
                data = _read_at(dirfd, name)
            except OSError:
                return
            if data.startswith(b"!"):
                try:
                    err = int(data[1:].strip() or b"0")
                except ValueError:
                    err = errno.EIO
                raise self.fail(Reason.REFUSED, f"the kernel refused {what}: {os.strerror(err)}", err)
            if data == expect:
                return
            if time.monotonic() >= self.deadline:
                raise self.fail(Reason.TIMEOUT, f"the kernel did not answer {what} in time")
            time.sleep(_POLL_STEPS[min(n, len(_POLL_STEPS) - 1)])
            n += 1

    def set_override(self, driver: str | None) -> None:
        # Written without a newline (the kernel strips one if present, drivers/base/driver.c
        # driver_set_override()), so the value read back -- "<name>\n", "(null)\n" when cleared --
        # differs from the bytes written until the kernel has taken it.  An empty value needs the
        # newline: a zero-length write never reaches the store.
        text = driver if driver else "\n"
        shown = f"{driver or NULL_OVERRIDE}\n".encode()
        self.command(self.dev, "driver_override", text, shown)

    def wait_driver(self, want: str | None) -> Binding:
        """Wait until the function's driver link names ``want`` (None: gone); return the binding then."""
        n = 0
        while True:
            found = _binding(self.root, self.pci, self.dev)
            if found.driver == want:
                return found
            if time.monotonic() >= self.deadline:
                now = found.driver or "no driver"
                raise self.fail(Reason.TIMEOUT, f"still on {now} when {want or 'unbound'} was awaited")
            time.sleep(_POLL_STEPS[min(n, len(_POLL_STEPS) - 1)])
            n += 1

    def wait_node(self, dev_root: str, group: str | None) -> None:
        """Wait for the vfio group's node under ``dev_root`` (``noiommu-<n>`` for a no-IOMMU group)."""
        if group is None:
            raise self.fail(Reason.REFUSED, "bound to vfio-pci without an IOMMU group")
        name = group
        with (
            contextlib.suppress(OSError),
            open(os.path.join(self.root, layout.IOMMU_GROUPS, group, "name")) as f,
        ):
            if f.read().strip() == "vfio-noiommu":  # drivers/vfio/group.c
                name = f"noiommu-{group}"
        node = os.path.join(dev_root, "vfio", name)
        n = 0
        while not os.path.exists(node):
            if time.monotonic() >= self.deadline:
                raise self.fail(Reason.TIMEOUT, f"{node} did not appear in time")
            time.sleep(_POLL_STEPS[min(n, len(_POLL_STEPS) - 1)])
            n += 1

    def unbind(self, driver: str) -> None:
        self.command(os.path.join(self.root, layout.PCI_DRIVERS, driver), "unbind", self.pci)
        self.wait_driver(None)


def _check_driver(pci: str, driver: str) -> str:
    if not isinstance(driver, str) or not _DRIVER.match(driver):
        raise RebindError(Reason.BAD_INPUT, pci, f"driver name {str(driver)[:40]!r} is not one")
    return driver


NOIOMMU_MODE = "module/vfio/parameters/enable_unsafe_noiommu_mode"


def _check_group(root: str, pci: str, group: str | None) -> None:
    """Refuse vfio-pci when another member of the group is bound to a driver vfio does not tolerate.

    Without a group vfio-pci cannot take the function (vfio_pci_core_register_device() fails), unless
    vfio runs in no-IOMMU mode, where it makes a ``vfio-noiommu`` group at the bind.
    """
    if group is None:
        try:
            with open(os.path.join(root, NOIOMMU_MODE)) as f:
                noiommu = f.read().strip() in ("Y", "1")
        except OSError:
            noiommu = False
        if not noiommu:
            raise RebindError(Reason.GROUP, pci, "no IOMMU group (and vfio is not in no-IOMMU mode)")
        return
    members = os.path.join(root, layout.IOMMU_GROUPS, group, "devices")
    try:
        others = [m for m in os.listdir(members) if m != pci]
    except OSError:
        return
    for other in sorted(others):
        try:
            dev = _device_dir(root, other)
            held = _driver_of(root, other, dev)
        except RebindError:
            continue
        if held is not None and held not in _GROUP_TOLERATED:
            raise RebindError(Reason.GROUP, pci, f"IOMMU group {group} also holds {other} bound to {held}")


def _vf_dir(root: str, pci: str) -> str:
    dev = _device_dir(root, _check_pci(pci))
    if not os.path.lexists(os.path.join(dev, "physfn")):
        raise RebindError(Reason.NOT_VF, pci, "not a VF (no physfn): only VFs are rebound")
    return dev


def rebind(
    sysfs_root: Path | str,
    pci: str,
    driver: str,
    *,
    timeout: float,
    dev_root: Path | str = "/dev",
    netns: str | None = None,
) -> Binding:
    """Bind the VF ``pci`` to ``driver`` as the kernel defines it and return its new binding.

    Sets ``driver_override``, unbinds the current driver, writes ``drivers_probe``, then waits (at most
    ``timeout`` seconds in all) for the ``driver`` link and, for vfio-pci, the group's node under
    ``dev_root``.  Refused before any write when the VF's netdev is busy (:func:`busy_reason`), when the
    driver is not loaded, or when its IOMMU group could not be used.  On any later failure the old
    driver and override are put back (:func:`restore`, bounded by ``timeout`` again: at most twice
    ``timeout`` in all) and RebindError says what failed and whether putting back worked.  Already
    bound to ``driver``: nothing is written.
    """
    deadline = time.monotonic() + timeout
    root = os.path.realpath(sysfs_root)
    dev = _vf_dir(root, pci)
    _check_driver(pci, driver)
    before = _binding(root, pci, dev)
    if before.driver == driver:
        return before
    if not os.path.isdir(os.path.join(root, layout.PCI_DRIVERS, driver)):
        raise RebindError(
            Reason.NO_DRIVER, pci, f"driver {driver} is not loaded (no {layout.PCI_DRIVERS}/{driver})"
        )
    if driver == VFIO_PCI:
        _check_group(root, pci, before.iommu_group)
    busy = busy_reason(root, pci, netns=netns)
    if busy:
        raise RebindError(Reason.BUSY, pci, f"in use by the host: {busy}")
    old_override = override_of(root, pci)
    step = _Step(root, pci, dev, deadline)
    try:
        step.set_override(driver)
        if before.driver is not None:
            step.unbind(before.driver)
        step.command(os.path.join(root, "bus", "pci"), "drivers_probe", pci)
        after = step.wait_driver(driver)
        if driver == VFIO_PCI:
            step.wait_node(str(dev_root), after.iommu_group)
        return _binding(root, pci, dev)
    except RebindError as exc:
        try:
            restore(root, pci, before, old_override, timeout=timeout)
        except RebindError as again:
            raise _failed(
                exc, False, f"; putting back {before.driver or 'no driver'} failed: {again.detail}"
            ) from None
        raise _failed(exc, True, f"; put back on {before.driver or 'no driver'}") from None


def _failed(exc: RebindError, restored: bool, tail: str) -> RebindError:
    out = RebindError(exc.reason, exc.pci, exc.detail + tail, restored)
    out.errno = exc.errno
    return out


def restore(
    sysfs_root: Path | str, pci: str, before: Binding, override: str | None, *, timeout: float
) -> Binding:
    """Put the VF back on the driver of ``before`` with ``override`` as its driver_override; return it.

    Writes the old override first (so the kernel's match allows the old driver again), unbinds whatever
    holds the VF if it is not the old driver, then binds the old one through its own ``bind`` file (the
    exact driver, whatever else would match).  Bounded by ``timeout``; RebindError when it fails.
    """
    root = os.path.realpath(sysfs_root)
    dev = _vf_dir(root, pci)
    step = _Step(root, pci, dev, time.monotonic() + timeout)
    try:
        # Always written: a refused write may have left the file unreadable as a value (the simulated
        # kernel's "!<errno>" answer), and the write is idempotent on a real one.
        step.set_override(override)
        now = _binding(root, pci, dev)
        if now.driver == before.driver:
            return now
        if now.driver is not None:
            step.unbind(now.driver)
        if before.driver is None:
            return _binding(root, pci, dev)
        if not os.path.isdir(os.path.join(root, layout.PCI_DRIVERS, before.driver)):
            raise RebindError(Reason.NO_DRIVER, pci, f"driver {before.driver} is not loaded any more")
        step.command(os.path.join(root, layout.PCI_DRIVERS, before.driver), "bind", pci)
        return step.wait_driver(before.driver)
    except RebindError:
        # A probe that the failed rebind left pending may have bound the old driver meanwhile (then
        # the bind answers EBUSY): what counts is where the VF is now.
        now = _binding(root, pci, dev)
        try:
            same = now.driver == before.driver and override_of(root, pci) == override
        except RebindError:
            same = False
        if same:
            return now
        raise

"""A simulated kernel for a simulated node: it answers driver rebinding writes as the PCI driver core does.

Over a :mod:`densedev.testing.simnode` tree it watches, with inotify, the files through which a process
asks the kernel to rebind a PCI function (Documentation/ABI/testing/sysfs-bus-pci):

- ``<dev>/driver_override``: a driver name (a trailing newline stripped), or an empty line to clear it;
  shown afterwards as ``<name>\\n`` or ``(null)\\n`` (drivers/base/driver.c driver_set_override());
- ``bus/pci/drivers/<drv>/unbind``: an address; ENODEV unless ``<drv>`` holds it (drivers/base/bus.c
  unbind_store());
- ``bus/pci/drivers/<drv>/bind``: an address; ENODEV when the driver does not match it (with an override
  set only the named driver matches, drivers/pci/pci-driver.c pci_match_device()), EBUSY when bound;
- ``bus/pci/drivers_probe``: an address; an unbound function gets the first matching loaded driver, or
  stays unbound when none matches or the probe fails (the write still succeeds, as in the kernel).

Binding moves the ``driver`` link (and the driver's link back), adds ``net/<ifname>`` for a network
driver (the name udev gave it before) and mlx5's RDMA device, creates ``<dev_root>/vfio/<group>`` (or
``noiommu-<group>``) when vfio-pci binds; unbinding undoes it.  Given a network namespace, it sends
the uevents the kernel would there (``remove``/``add`` of the netdev, ``unbind``/``bind`` of the
function), so a daemon listening in it rescans as on a node.  A real write returns when the kernel is
done; a write to a regular file cannot wait, so this kernel *answers* each command through the file:
emptied when done, ``!<errno>`` when refused (driver_override shows its value, as the kernel's does).
:mod:`densedev.node.rebind` reads those answers.

Faults come from ``.simnode/kernel/faults.json`` (re-read when it changes)::

    {"rules": [{"op": "drivers_probe", "pci": "0000:18:00.2", "driver": "vfio-pci",
                "delay_ms": 20, "errno": 0, "probe_fails": false, "times": 1}]}

``op`` is a command file's name (``driver_override``, ``unbind``, ``bind``, ``drivers_probe``) or ``*``;
``pci``/``driver`` narrow it (``*`` or absent: any); the first matching rule applies: the answer comes
after ``delay_ms``; ``errno`` refuses the write; ``probe_fails`` lets the write succeed with nothing
bound (a driver's probe() failing); ``times`` limits how often the rule fires.  Every command is logged
as one line in ``.simnode/kernel/log``.  It runs in a thread (:class:`SimKernel`) or as a process
(``densedev simulate-kernel``).
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import json
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TextIO

from ..node import layout
from . import simnode

__all__ = ["FaultRule", "SimKernel", "write_faults"]

log = logging.getLogger(__name__)

KERNEL_DIR = ".simnode/kernel"
FAULTS = KERNEL_DIR + "/faults.json"
LOG = KERNEL_DIR + "/log"
READY = KERNEL_DIR + "/ready"  # holds the serving process's pid while it answers
# Y: vfio takes devices without an IOMMU group, making a vfio-noiommu group for each at the bind.
NOIOMMU_MODE = "module/vfio/parameters/enable_unsafe_noiommu_mode"

# include/uapi/linux/inotify.h
_IN_CLOSE_WRITE = 0x00000008
_IN_CREATE = 0x00000100
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000  # the watch is gone (its directory was removed)
_EVENT = 16  # struct inotify_event { int wd; u32 mask; u32 cookie; u32 len; char name[]; }

# Each driver's PCI ID table (its MODULE_DEVICE_TABLE), for the devices a simulated node has: what
# drivers_probe matches without an override.  vfio-pci and the uio drivers have none (they bind only
# through driver_override or new_id), as in the kernel.
ID_TABLE: dict[str, frozenset[tuple[int, int]]] = {
    "mlx5_core": frozenset({(0x15B3, 0x101D), (0x15B3, 0x101E), (0x15B3, 0x1017), (0x15B3, 0x1018)}),
    "ice": frozenset({(0x8086, 0x1592)}),
    "iavf": frozenset({(0x8086, 0x1889)}),
    "4xxx": frozenset({(0x8086, 0x4940)}),
    "igb": frozenset({(0x8086, 0x1533)}),
    "virtio-pci": frozenset({(0x1AF4, 0x1041)}),
}
_LOADED = ("vfio-pci",)  # modules a node that hands out vfio VFs has loaded


@dataclass(frozen=True)
class FaultRule:
    """One injected behaviour: which commands it matches and what it does to them."""

    op: str = "*"
    pci: str = "*"
    driver: str = "*"
    delay_ms: float = 0.0
    errno: int = 0
    probe_fails: bool = False
    times: int | None = None  # None: every time

    def matches(self, op: str, pci: str, driver: str) -> bool:
        """Return whether this rule applies to the command ``op`` for ``pci`` and ``driver``."""
        return self.op in ("*", op) and self.pci in ("*", pci) and self.driver in ("*", driver)


def write_faults(sysfs_root: Path | str, rules: list[FaultRule]) -> None:
    """Write ``.simnode/kernel/faults.json`` (atomically: the kernel re-reads it while it runs)."""
    path = Path(sysfs_root, FAULTS)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"rules": [{k: v for k, v in r.__dict__.items() if v is not None} for r in rules]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _load_rules(path: str) -> list[FaultRule]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("simulate-kernel: %s unreadable (%s); no faults injected", path, exc)
        return []
    rules = []
    fields = set(FaultRule.__dataclass_fields__)
    for raw in doc.get("rules", []) if isinstance(doc, dict) else []:
        if isinstance(raw, dict):
            try:
                rules.append(FaultRule(**{k: v for k, v in raw.items() if k in fields}))
            except TypeError as exc:
                log.warning("simulate-kernel: fault rule %r skipped: %s", raw, exc)
    return rules


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@dataclass
class _Pending:
    """A command read from its file, to be answered when due."""

    due: float
    seq: int
    op: str
    path: str  # the command file
    pci: str
    driver: str  # the driver whose file it is (bind/unbind), the override's value, or ""
    text: bytes
    rule: FaultRule | None

    def __lt__(self, other: _Pending) -> bool:
        return (self.due, self.seq) < (other.due, other.seq)


class SimKernel:
    """The simulated kernel of one simulated node: start() serves it in a thread until stop()."""

    def __init__(self, sysfs_root: Path | str, dev_root: Path | str, uevent_netns: str | None = None) -> None:
        self.root = os.path.realpath(sysfs_root)
        self.dev_root = str(dev_root)
        self.uevent_netns = uevent_netns  # where to send the kernel's uevents (None: send none)
        self._uevents: socket.socket | None = None
        self._seqnum = 0
        self.commands = 0  # commands answered, for tests
        self._libc = _libc()
        self._fd = -1
        self._wds: dict[int, tuple[str, str]] = {}  # wd → (kind, directory)
        self._watched: set[str] = set()
        self._written: dict[str, bytes] = {}  # what this kernel last wrote to a file (its own answers)
        self._overrides: dict[str, str | None] = {}
        self._pending: list[_Pending] = []
        self._queued: dict[str, bytes] = {}  # command file → the text of its latest pending command
        self._seq = 0
        self._unsaved: str | None = None  # the counters before the first unsaved change, if any
        self._busy_until: dict[str, float] = {}  # device → when its last queued command is due
        self._rules: list[FaultRule] = []
        self._rules_id: tuple[int, int] | None = None
        self._fired: dict[int, int] = {}
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._w: simnode._Writer | None = None
        self._w_id: tuple[int, int] | None = None
        self._log_file: TextIO | None = None

    # -- life cycle
    def prepare(self) -> int:
        """Make the node's command files (what a kernel with vfio-pci loaded shows) and watch them.

        Returns the number of PCI functions watched.  Idempotent; a tree built before these files
        existed gets them here.
        """
        os.makedirs(os.path.join(self.root, KERNEL_DIR), exist_ok=True)
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._fd = fd
        if self.uevent_netns is not None and self._uevents is None:
            from ..node.events import NETLINK_KOBJECT_UEVENT, open_netlink_socket, resolve_netns

            self._uevents = open_netlink_socket(NETLINK_KOBJECT_UEVENT, 0, resolve_netns(self.uevent_netns))
        w = simnode._Writer(Path(self.root))
        for driver in _LOADED:
            w.driver_dir(driver)
        bus = os.path.join(self.root, "bus", "pci")
        probe = os.path.join(bus, "drivers_probe")
        if not os.path.exists(probe):
            w.write(probe, "")
        self._watch(bus, "bus", _IN_CLOSE_WRITE)
        self._watch(os.path.join(self.root, layout.PCI_DRIVERS), "drivers", _IN_CREATE)
        for driver in os.listdir(os.path.join(self.root, layout.PCI_DRIVERS)):
            self._watch_driver(driver)
        self._watch(os.path.join(self.root, layout.PCI_DEVICES), "devices", _IN_CREATE)
        count = 0
        for pci in os.listdir(os.path.join(self.root, layout.PCI_DEVICES)):
            count += self._watch_device(pci)
        return count

    def _watch(self, directory: str, kind: str, mask: int) -> None:
        if directory in self._watched:
            return
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(directory), mask)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_add_watch {directory}: {os.strerror(err)}")
        self._wds[wd] = (kind, directory)
        self._watched.add(directory)

    def _watch_driver(self, driver: str) -> None:
        path = os.path.join(self.root, layout.PCI_DRIVERS, driver)
        if os.path.isdir(path) and not os.path.islink(path):
            for attr in ("bind", "unbind"):
                if not os.path.exists(os.path.join(path, attr)):
                    simnode._write(os.path.join(path, attr), "")
            self._watch(path, "driver", _IN_CLOSE_WRITE)

    def _watch_device(self, pci: str) -> int:
        link = os.path.join(self.root, layout.PCI_DEVICES, pci)
        real = os.path.realpath(link)
        if not os.path.isdir(real):
            return 0
        override = os.path.join(real, "driver_override")
        try:
            with open(override) as f:
                text = f.read().strip()
        except FileNotFoundError:
            text = simnode.NULL_OVERRIDE
            self._answer(override, f"{text}\n".encode())
        self._overrides[pci] = None if text in ("", simnode.NULL_OVERRIDE) else text
        self._watch(real, "device", _IN_CLOSE_WRITE)
        return 1

    def start(self) -> SimKernel:
        """Prepare (unless done) and serve in a daemon thread; returns self (a context manager stops it)."""
        if self._fd < 0:
            self.prepare()
        self._thread = threading.Thread(target=self._serve_guarded, name="simkernel", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (commands still pending stay unanswered, as with a hung kernel) and close."""
        with self._lock:
            if self._stop_w >= 0:
                os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._uevents is not None:
            self._uevents.close()
            self._uevents = None
        for fd in (self._fd, self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._fd = self._stop_r = self._stop_w = -1
        if self._error is not None:
            raise RuntimeError(f"the simulated kernel failed: {self._error!r}") from self._error

    def __enter__(self) -> SimKernel:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _serve_guarded(self) -> None:
        try:
            self.serve()
        except BaseException as exc:  # kept for stop() to raise in the test's thread
            self._error = exc
            log.exception("simulated kernel failed")

    def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Answer commands until stop() (or the stop pipe) says to end; the caller must have prepared."""
        if on_ready is not None:
            on_ready()
        while True:
            timeout = None
            if self._pending:
                timeout = max(0.0, self._pending[0].due - time.monotonic())
            ready = select.select([self._fd, self._stop_r], [], [], timeout)[0]
            if self._stop_r in ready:
                return
            if self._fd in ready:
                self._read_events()
            now = time.monotonic()
            while self._pending and self._pending[0].due <= now:
                self._run(heapq.heappop(self._pending))

    # -- events
    def _read_events(self) -> None:
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return
        pos = 0
        while pos + _EVENT <= len(data):
            wd, mask, _cookie, length = (
                int.from_bytes(data[pos : pos + 4], "little", signed=True),
                *(int.from_bytes(data[pos + i : pos + i + 4], "little") for i in (4, 8, 12)),
            )
            name = data[pos + _EVENT : pos + _EVENT + length].split(b"\0", 1)[0].decode()
            pos += _EVENT + length
            if mask & _IN_Q_OVERFLOW:
                log.warning("simulate-kernel: inotify queue overflowed; reading every command file")
                self._resync()
                continue
            kind, directory = self._wds.get(wd, ("", ""))
            if mask & _IN_IGNORED:
                # A removed VF's directory: forget it, so a VF made again at that address is watched.
                self._wds.pop(wd, None)
                self._watched.discard(directory)
                continue
            if kind == "devices" and mask & _IN_CREATE:
                self._watch_device(name)
            elif kind == "drivers" and mask & _IN_CREATE:
                self._watch_driver(name)
            elif kind == "device" and name == "driver_override":
                self._command(
                    "driver_override", os.path.join(directory, name), os.path.basename(directory), ""
                )
            elif kind == "driver" and name in ("bind", "unbind"):
                self._command(name, os.path.join(directory, name), "", os.path.basename(directory))
            elif kind == "bus" and name == "drivers_probe":
                self._command(name, os.path.join(directory, name), "", "")

    def _resync(self) -> None:
        """Take every command still written in a file: the events that told of them were lost."""
        for kind, directory in list(self._wds.values()):
            if kind == "device":
                self._command(
                    "driver_override",
                    os.path.join(directory, "driver_override"),
                    os.path.basename(directory),
                    "",
                )
            elif kind == "driver":
                for op in ("bind", "unbind"):
                    self._command(op, os.path.join(directory, op), "", os.path.basename(directory))
            elif kind == "bus":
                self._command("drivers_probe", os.path.join(directory, "drivers_probe"), "", "")

    def _command(self, op: str, path: str, pci: str, driver: str) -> None:
        try:
            with open(path, "rb") as f:
                text = f.read(8192)
        except OSError:
            return
        if text == self._written.get(path) or (op != "driver_override" and not text):
            return  # our own answer coming back
        if self._queued.get(path) == text:
            return  # the same write seen twice (an open for writing closed again)
        if op == "driver_override":
            if text == f"{self._overrides.get(pci) or simnode.NULL_OVERRIDE}\n".encode():
                return  # the value shown now: nothing to take (a resync reads every device's file)
            driver = text.decode(errors="replace").removesuffix("\n")
        else:
            pci = text.decode(errors="replace").strip()
        rule = self._rule(op, pci, driver)
        self._seq += 1
        # Every one of these stores takes the device's lock (device_lock(): driver_override_store(),
        # unbind_store(), bind_store(), device_attach()), so a device's commands run one after the
        # other: a command written while an earlier one still works waits for it, as a writer blocked
        # on that lock would (and a killed writer's command still completes first).
        due = max(time.monotonic() + (rule.delay_ms / 1000 if rule else 0.0), self._busy_until.get(pci, 0.0))
        self._busy_until[pci] = due
        heapq.heappush(self._pending, _Pending(due, self._seq, op, path, pci, driver, text, rule))
        self._queued[path] = text

    def _rule(self, op: str, pci: str, driver: str) -> FaultRule | None:
        path = os.path.join(self.root, FAULTS)
        try:
            st = os.stat(path)
            ident: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)
        except FileNotFoundError:
            ident = None
        if ident != self._rules_id:
            self._rules = _load_rules(path) if ident else []
            self._rules_id = ident
            self._fired = {}
        for i, rule in enumerate(self._rules):
            if not rule.matches(op, pci, driver):
                continue
            fired = self._fired.get(i, 0)
            if rule.times is not None and fired >= rule.times:
                continue
            self._fired[i] = fired + 1
            return rule
        return None

    def _run(self, cmd: _Pending) -> None:
        try:
            self._run_one(cmd)
        finally:
            # The node's bookkeeping (its counters) is saved after the answer, off the writer's wait.
            if self._unsaved is not None and self._w is not None:
                self._save(self._w, self._unsaved)
            self._unsaved = None

    def _run_one(self, cmd: _Pending) -> None:
        if self._queued.get(cmd.path) == cmd.text:
            del self._queued[cmd.path]
        rule = cmd.rule
        err = rule.errno if rule and rule.errno else 0
        note = ""
        if not err:
            try:
                note = self._act(cmd, rule)
            except OSError as exc:
                err = exc.errno or errno.EIO
                note = exc.strerror or ""
        try:
            with open(cmd.path, "rb") as f:
                current = f.read(8192)
        except OSError:
            current = b""
        superseded = current != cmd.text
        # Logged before the answer: whoever sees the answer finds the line already there.
        self.commands += 1
        self._log(cmd, err, (note + " answer superseded").strip() if superseded else note)
        if superseded:
            # A later writer replaced the command (its writer gave up waiting): the answer is that
            # writer's to see, not this one's; the state change above stands, as in the kernel.
            return
        if cmd.op == "driver_override":
            shown = f"!{err}\n" if err else f"{self._overrides.get(cmd.pci) or simnode.NULL_OVERRIDE}\n"
            self._answer(cmd.path, shown.encode())
        else:
            self._answer(cmd.path, f"!{err}\n".encode() if err else b"")

    def _answer(self, path: str, data: bytes) -> None:
        self._written[path] = data
        if not data:
            simnode._write_bytes(path, data)  # truncation alone: atomic
            return
        # Written aside and renamed over: an in-place write would show an empty file between its
        # truncation and its write, which a waiting writer would take for "done".
        tmp = os.path.join(self.root, KERNEL_DIR, "answer.tmp")
        simnode._write_bytes(tmp, data)
        os.replace(tmp, path)

    def _log(self, cmd: _Pending, err: int, note: str) -> None:
        line = f"{time.time():.6f} {cmd.op} pci={cmd.pci or '-'} driver={cmd.driver or '-'} "
        line += f"errno={err}" if err else "ok"
        if note:
            line += f" {note}"
        if self._log_file is None:
            self._log_file = open(os.path.join(self.root, LOG), "a")  # noqa: SIM115 (closed by stop())
        self._log_file.write(line + "\n")
        self._log_file.flush()

    # -- the driver core
    def _act(self, cmd: _Pending, rule: FaultRule | None) -> str:
        if cmd.op == "driver_override":
            if len(cmd.text) >= 4096:
                raise OSError(errno.EINVAL, "override too long")  # PAGE_SIZE in driver_set_override()
            self._overrides[cmd.pci] = cmd.driver or None
            return ""
        dev = self._device(cmd.pci)
        if cmd.op == "unbind":
            if self._driver(dev) != cmd.driver:
                raise OSError(errno.ENODEV, f"not bound to {cmd.driver}")
            self._unbind(cmd.pci, dev)
            return ""
        if cmd.op == "bind":
            if self._driver(dev) is not None:
                raise OSError(errno.EBUSY, "already bound")
            if not self._matches(cmd.pci, dev, cmd.driver):
                raise OSError(errno.ENODEV, f"{cmd.driver} does not match")
            if rule is not None and rule.probe_fails:
                raise OSError(errno.ENXIO, "probe failed")  # bind_store() returns the probe's error
            self._attach(cmd.pci, dev, cmd.driver)
            return ""
        # drivers_probe: bus_rescan_devices_helper() attaches an unbound device; no match, or a probe
        # failing, leaves it unbound and the write still succeeds.
        cmd.driver = ""
        if self._driver(dev) is not None:
            return "already bound"
        drivers_dir = os.path.join(self.root, layout.PCI_DRIVERS)
        for driver in sorted(os.listdir(drivers_dir)):
            if self._matches(cmd.pci, dev, driver):
                cmd.driver = driver
                if rule is not None and rule.probe_fails:
                    return "probe failed"
                try:
                    self._attach(cmd.pci, dev, driver)
                except OSError as exc:
                    return f"probe failed: {exc.strerror}"
                return ""
        return "no driver matched"

    def _device(self, pci: str) -> str:
        link = os.path.join(self.root, layout.PCI_DEVICES, pci)
        if not pci or "/" in pci or not os.path.lexists(link):
            raise OSError(errno.ENODEV, "no such device")  # bus_find_device_by_name() found nothing
        return os.path.realpath(link)

    @staticmethod
    def _driver(dev: str) -> str | None:
        try:
            return os.path.basename(os.readlink(os.path.join(dev, "driver")))
        except OSError:
            return None

    def _matches(self, pci: str, dev: str, driver: str) -> bool:
        if not os.path.isdir(os.path.join(self.root, layout.PCI_DRIVERS, driver)):
            return False
        override = self._overrides.get(pci)
        if override is not None:
            return override == driver  # pci_match_device(): the override alone decides
        try:
            ids = (int(simnode._read_text(dev + "/vendor"), 16), int(simnode._read_text(dev + "/device"), 16))
        except (OSError, ValueError):
            return False
        return ids in ID_TABLE.get(driver, frozenset())

    def _group(self, dev: str) -> tuple[str, str] | None:
        link = os.path.join(dev, "iommu_group")
        if not os.path.lexists(link):
            return None
        gdir = os.path.realpath(link)
        group = os.path.basename(gdir)
        try:
            noiommu = simnode._read_text(gdir + "/name") == "vfio-noiommu"
        except OSError:
            noiommu = False
        return gdir, f"noiommu-{group}" if noiommu else group

    def _state_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.root, ".simnode", "state.json"))
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _writer(self) -> simnode._Writer:
        """The node's writer, its bookkeeping read again only when someone else saved it meanwhile."""
        ident = self._state_id()
        if self._w is None or ident != self._w_id:
            self._w = simnode._Writer(Path(self.root))
        self._w._made.clear()  # directories it made may have been removed since (net/<if> at unbind)
        return self._w

    @staticmethod
    def _counters(w: simnode._Writer) -> str:
        # The bookkeeping a bind can change (ifindex, uio, ... counters), without the names: at 4,096
        # VFs the whole record is ~0.3 MB, and most commands (unbind, vfio-pci) change nothing in it.
        return json.dumps({k: v for k, v in w.state.items() if k != "names"}, sort_keys=True)

    def _save(self, w: simnode._Writer, before: str) -> None:
        if self._counters(w) != before:
            w.save()
            self._w_id = self._state_id()

    def _uevent(self, action: str, path: str, pairs: list[tuple[str, str]]) -> None:
        """Send a kernel-format uevent to group 1 of ``uevent_netns`` (lib/kobject_uevent.c)."""
        if self._uevents is None:
            return
        self._seqnum += 1
        devpath = "/" + os.path.relpath(path, self.root)
        head = [("ACTION", action), ("DEVPATH", devpath), *pairs, ("SEQNUM", str(self._seqnum))]
        data = f"{action}@{devpath}\0".encode() + b"".join(f"{k}={v}\0".encode() for k, v in head)
        try:
            self._uevents.sendto(data, (0, 1))
        except OSError as exc:  # no listener is not an error for multicast; a full buffer is a lost event
            log.warning("simulate-kernel: uevent %s@%s not sent: %s", action, devpath, exc.strerror)

    def _net_uevents(self, dev: str, action: str) -> None:
        for ifname in simnode._listdir(os.path.join(dev, "net")):
            self._uevent(
                action, os.path.join(dev, "net", ifname), [("SUBSYSTEM", "net"), ("INTERFACE", ifname)]
            )

    def _attach(self, pci: str, dev: str, driver: str) -> None:
        group = self._group(dev)
        w = self._writer()
        before = self._counters(w)
        if driver == "vfio-pci" and group is None:
            # vfio_pci_core_register_device() → vfio_group_find_or_alloc(): no group, no vfio device;
            # in no-IOMMU mode vfio makes a "vfio-noiommu" group for the device instead.
            try:
                mode = simnode._read_text(os.path.join(self.root, NOIOMMU_MODE))
            except OSError:
                mode = "N"
            if mode not in ("Y", "1"):
                raise OSError(errno.EINVAL, "no IOMMU group")
            w.iommu(dev, pci, noiommu=True)
            group = self._group(dev)
        simnode.bind_driver(self.root, pci, driver, _writer=w)
        if self._unsaved is None:
            self._unsaved = before
        if driver == "vfio-pci" and group is not None:
            node = os.path.join(self.dev_root, "vfio", group[1])
            os.makedirs(os.path.dirname(node), exist_ok=True)
            with open(node, "a"):
                pass
        # The netdev registers during probe(), then driver_bound() sends KOBJ_BIND (drivers/base/dd.c).
        self._net_uevents(dev, "add")
        pairs = [("DRIVER", driver), ("SUBSYSTEM", "pci"), ("PCI_SLOT_NAME", pci)]
        self._uevent("bind", dev, pairs)

    def _unbind(self, pci: str, dev: str) -> None:
        old = self._driver(dev)
        # The driver's remove() unregisters the netdev; __device_release_driver() then sends KOBJ_UNBIND.
        self._net_uevents(dev, "remove")
        w = self._writer()
        before = self._counters(w)
        simnode.bind_driver(self.root, pci, None, _writer=w)
        if self._unsaved is None:
            self._unsaved = before
        group = self._group(dev)
        if old == "vfio-pci" and group is not None:
            # The group's node goes with its last vfio-bound member (vfio_group_put()).
            members = os.path.join(group[0], "devices")
            held = any(
                self._driver(os.path.realpath(os.path.join(members, m))) == "vfio-pci"
                for m in os.listdir(members)
                if m != pci
            )
            if not held:
                simnode._unlink(os.path.join(self.dev_root, "vfio", group[1]))
        self._uevent("unbind", dev, [("SUBSYSTEM", "pci"), ("PCI_SLOT_NAME", pci)])


def serve_process(sysfs_root: Path, dev_root: Path, uevent_netns: str | None = None) -> int:
    """Run the simulated kernel in this process until SIGTERM/SIGINT (``densedev simulate-kernel``)."""
    import signal

    kernel = SimKernel(sysfs_root, dev_root, uevent_netns)
    count = kernel.prepare()

    def ending(_sig: int, _frame: object) -> None:
        os.write(kernel._stop_w, b"x")

    signal.signal(signal.SIGTERM, ending)
    signal.signal(signal.SIGINT, ending)
    ready = os.path.join(kernel.root, READY)

    def on_ready() -> None:
        simnode._write(ready, f"{os.getpid()}\n")
        print(f"simulate-kernel: answering rebinds of {count} PCI functions under {kernel.root}", flush=True)

    try:
        kernel.serve(on_ready)
    finally:
        simnode._unlink(ready)
    return 0

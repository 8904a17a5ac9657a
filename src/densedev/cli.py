"""The ``densedev`` command: flags and environment → settings; runs the daemon, scan, simulate, demo."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from . import __version__, accel
from .argv import command_word, go_plugin_argv
from .dra import WRITE_BURST, WRITE_QPS
from .model import DEFAULT_PREFIX, PoolApi
from .node.ahead import ScanAhead
from .node.layout import PCI_DEVICES, SYSFS_ROOT

if TYPE_CHECKING:  # imported where run needs them: the other commands never load the daemon
    from .daemon import Daemon
    from .ops.preflight import InstanceLock, LockHeld

log = logging.getLogger("densedev.cli")

# Where ``run`` looks for its config when no --config is given, in order: the SR-IOV network device
# plugin's default, the RDMA shared device plugin's (its DaemonSet mounts a ConfigMap there and passes
# no argument at all), and densedev's own manifests' path.  Swapping either plugin's image for densedev's
# then finds the config where its DaemonSet put it.
DEFAULT_CONFIGS = (
    Path("/etc/pcidp/config.json"),
    Path("/k8s-rdma-shared-dev-plugin/config.json"),
    Path("/etc/densedev/config.json"),
)


def default_config(candidates: Sequence[Path] = DEFAULT_CONFIGS) -> Path:
    """Return the first of ``candidates`` that exists, else the first (a missing file is named by it)."""
    return next((p for p in candidates if p.exists()), candidates[0])


# Where --use-cdi writes CDI specs: the directory the SR-IOV network device plugin writes them to, and
# one of the two that containerd and CRI-O read by default (the CDI spec's /etc/cdi and /var/run/cdi).
CDI_DIR = "/var/run/cdi"

_T = TypeVar("_T")


def _terminal_columns() -> int:
    """Return the width ``shutil.get_terminal_size()`` gives: $COLUMNS, else stdout's terminal, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help that shows every flag's default and keeps the examples' line breaks."""

    def __init__(
        self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None
    ) -> None:
        # argparse makes a formatter for every argument it adds and, without a width, imports shutil
        # for its terminal size: shutil brings zlib, bz2 and lzma, ~2 ms of every start of run.
        # The same width (argparse's own rule: the terminal's columns less 2), without them.
        if width is None:
            width = _terminal_columns() - 2
        super().__init__(prog, indent_increment, max_help_position, width)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        """Show a flag's default unless it is None (no default: the help says what happens instead)."""
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the flag, with where to find help."""

    def error(self, message: str) -> NoReturn:
        """Print one line and exit 2, as argparse does, without the multi-line usage before it."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class CommandError(Exception):
    """An expected failure of a command (bad input, a busy port, a missing file): one line, exit ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _flag_type(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """Make ``parse`` an argparse type whose ValueError is the flag's error line, word for word.

    argparse prints an ArgumentTypeError's text as is, but replaces a ValueError's with "invalid <type>
    value"; the parsers below (and the stages' own, imported only when the flag is given) raise ValueError.
    """

    @functools.wraps(parse)
    def checked(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return checked


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number") from None
        if value < low:
            raise ValueError(f"{value} is below the minimum {low}")
        return value

    parse.__name__ = "int"
    return _flag_type(parse)


def _finite_at_least_0(unit: str, bound: str) -> Callable[[str], float]:
    """An argparse type for a finite float >= 0: ``unit`` names what a number is, ``bound`` the rule."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number {unit}") from None
        if not value >= 0 or value == float("inf"):  # rejects nan too
            raise ValueError(f"{text!r} must be {bound}")
        return value

    parse.__name__ = "float"
    return _flag_type(parse)


_seconds = _finite_at_least_0("of seconds", "a finite number of seconds >= 0")
_rate = _finite_at_least_0("per second", "a finite rate >= 0 (0: no limit)")


@_flag_type
def _log_level(text: str) -> str:
    from .ops.logs import parse_level

    parse_level(text)
    return text


@_flag_type
def _metrics_addr(text: str) -> str:
    from .ops.metrics import parse_addr

    parse_addr(text)
    return text


@_flag_type
def _sysfs_root(text: str) -> Path:
    from .ops.preflight import sysfs_root_problem

    path = Path(text)
    problem = sysfs_root_problem(path)
    if problem is not None:
        raise ValueError(problem)
    return path


def _allocation(text: str) -> tuple[str, int]:
    from .emulator_cli import parse_allocation

    return parse_allocation(text)


def _add_common(p: argparse.ArgumentParser, level: str = "info") -> None:
    p.add_argument(
        "--log-level",
        type=_log_level,
        default=os.environ.get("DENSEDEV_LOG_LEVEL", level),
        help="debug, info, warning or error, or a glog verbosity as the SR-IOV network device plugin takes "
        "it: 0-3 is info, 4 and more debug (env DENSEDEV_LOG_LEVEL)",
    )
    p.add_argument(
        "--log-format",
        choices=("kv", "json"),
        default=os.environ.get("DENSEDEV_LOG_FORMAT", "kv"),
        help="key=value lines or one JSON object per line (env DENSEDEV_LOG_FORMAT)",
    )


def _sub(sub: Any, name: str, summary: str, example: str, level: str = "info") -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=f"{summary[0].upper()}{summary[1:]}.",
        epilog=f"example:\n  {example}",
        formatter_class=_Formatter,
    )
    _add_common(p, level)
    return p


def _add_sysfs_root(p: argparse.ArgumentParser) -> None:
    """Add ``--sysfs-root``, checked like every flag: a tree without the PCI devices is refused."""
    p.add_argument(
        "--sysfs-root",
        type=_sysfs_root,
        default=SYSFS_ROOT,  # a string, so argparse runs the check on the default too
        help=f"sysfs to scan (refused unless it has {PCI_DEVICES})",
    )


def _add_resource_prefix(p: argparse.ArgumentParser) -> None:
    """Add ``--resource-prefix``, the prefix of every pool that does not set its own."""
    p.add_argument(
        "--resource-prefix", default=DEFAULT_PREFIX, help="prefix of pools that do not set resourcePrefix"
    )


def _add_node_shape(p: argparse.ArgumentParser, least: int) -> None:
    """Add the simulated node's shape: --pfs, --vfs-per-pf (each at least ``least``) and --vendor."""
    p.add_argument("--pfs", type=_int_at_least(least), default=16, help="physical functions")
    p.add_argument("--vfs-per-pf", type=_int_at_least(least), default=256, help="virtual functions per PF")
    p.add_argument("--vendor", choices=("mellanox", "intel", "virtio"), default="mellanox", help="NIC model")


def _add_seconds(p: argparse.ArgumentParser) -> None:
    """Add ``--seconds``, how long a foreground command runs."""
    p.add_argument("--seconds", type=_seconds, default=0.0, help="stop after N seconds (0: until Ctrl-C)")


DESCRIPTION = """\
densedev: a Kubernetes device plugin for SR-IOV VFs and RDMA devices at high density.

It reads the SR-IOV network device plugin's config.json, advertises one resource per pool to the
kubelet and keeps every device's health current.  Try it without root or hardware:

  densedev demo --seconds 20
"""


@_flag_type
def _positive_int(text: str) -> int:
    """Parse a positive integer argument."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"must be a positive integer, not {text!r}")
    return value


# The commands this module parses itself; the DRA commands' parsers come from dra.commands.
_OWN_COMMANDS = ("run", "scan", "check-config", "simulate", "simulate-kernel", "demo", "kubelet-emulator")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Return the argument parser of every sub-command.

    Given the ``command`` the arguments name, one of this module's own, only that command's parser is
    built: the others' ~40 arguments cost ~1 ms of every start of ``run`` (argparse makes a formatter,
    with a terminal-size query, per argument) and the DRA commands' parsers import the DRA side (~5 ms).
    Any other ``command`` (none, a DRA one, a typo) gets them all, so help and "invalid choice" list
    every command.
    """
    parser = _Parser(prog="densedev", description=DESCRIPTION, formatter_class=_Formatter)
    parser.add_argument(
        "--version",
        action="version",
        version=f"densedev {__version__} ({accel.IMPLEMENTATION}: {accel.DETAIL})",
    )
    # Not required= here: argparse would then answer "densedev --bogus" with "a command is required"
    # instead of naming the unknown flag; main() asks for the command itself.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def wanted(name: str) -> bool:
        return command not in _OWN_COMMANDS or command == name

    if wanted("run"):
        run = _sub(
            sub,
            "run",
            "run the device plugin daemon",
            "densedev run --config /etc/pcidp/config.json --metrics-addr :9477",
        )
        run.add_argument(
            "--config",
            "--config-file",  # the SR-IOV network device plugin's name for it
            dest="config",
            type=Path,
            default=None,
            help="the config file (default: the first of "
            + ", ".join(map(str, DEFAULT_CONFIGS))
            + " that exists: where the plugins densedev replaces keep theirs)",
        )
        _add_sysfs_root(run)
        run.add_argument(
            "--kubelet-dir",
            type=Path,
            default=Path("/var/lib/kubelet/device-plugins"),
            help="the kubelet's device-plugin directory; refused when missing (the kubelet creates it, so a "
            "missing one is a wrong path), while a missing kubelet.sock in it is waited for (a restarting "
            "kubelet); holds densedev.lock, so one daemon serves one kubelet",
        )
        run.add_argument(
            "--dev-root", type=Path, default=Path("/dev"), help="device nodes given to containers"
        )
        run.add_argument(
            "--cdi-dir", type=Path, default=None, help="write CDI specs here (e.g. /var/run/cdi)"
        )
        run.add_argument(
            "--use-cdi",
            action="store_true",
            help=f"the SR-IOV network device plugin's CDI switch: CDI specs in {CDI_DIR} (or --cdi-dir)",
        )
        run.add_argument(
            "--log-dir",
            default=None,
            help="accepted for the SR-IOV network device plugin's DaemonSets; densedev logs to stderr, "
            "where the kubelet and kubectl logs read it",
        )
        run.add_argument(
            "--cdi-annotations",
            action="store_true",
            help="also return cdi.k8s.io/ annotations, for runtimes that do not read the CDI devices field",
        )
        run.add_argument(
            "--devinfo-dir",
            type=Path,
            default=Path("/var/run/k8s.cni.cncf.io/devinfo/dp"),
            help="device-info files for Multus/SR-IOV CNI ('' disables)",
        )
        _add_resource_prefix(run)
        run.add_argument(
            "--node-name",
            default=os.environ.get("NODE_NAME") or None,
            help="this node's name, for pools served through DRA (default $NODE_NAME)",
        )
        run.add_argument(
            "--kubeconfig",
            type=Path,
            default=None,
            help="kubeconfig for the API server DRA publishes to (default: the in-cluster service account)",
        )
        run.add_argument(
            "--kubelet-plugins-dir",
            type=Path,
            default=Path("/var/lib/kubelet/plugins"),
            help="where the DRA plugin socket and its claims checkpoint live",
        )
        run.add_argument(
            "--kubelet-registry-dir",
            type=Path,
            default=Path("/var/lib/kubelet/plugins_registry"),
            help="the kubelet's plugin registry (DRA registration)",
        )
        run.add_argument(
            "--dra-taints",
            action="store_true",
            help="taint unhealthy DRA devices NoSchedule instead of withdrawing them from their "
            "ResourceSlice",
        )
        run.add_argument(
            "--dra-write-qps",
            type=_rate,
            default=WRITE_QPS,
            help="ResourceSlice writes per second for the whole node, a token bucket (0: no limit)",
        )
        run.add_argument(
            "--dra-write-burst",
            type=_int_at_least(1),
            default=WRITE_BURST,
            help="ResourceSlice writes the bucket lets go at once (a node's whole start fits in the default)",
        )
        run.add_argument(
            "--pod-resources-socket",
            type=Path,
            default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
            help="the kubelet's PodResources API: which devices running pods hold ('' for the checkpoint "
            "only)",
        )
        run.add_argument(
            "--metrics-addr",
            type=_metrics_addr,
            default=None,
            help="serve /metrics, /healthz, /readyz on HOST:PORT (e.g. :9477)",
        )
        run.add_argument(
            "--start-timeout",
            type=_seconds,
            default=60.0,
            help="seconds without any pool served before /readyz and the exit code report the failure",
        )
        run.add_argument(
            "--wait-for-lock",
            action="store_true",
            help="when another densedev serves this kubelet directory (a DaemonSet rolling update with "
            "maxSurge 1), scan and prepare beside it, then serve as soon as it has stopped, instead of "
            "refusing to start",
        )
        run.add_argument("--no-netlink", action="store_true", help="do not watch netlink (simulated nodes)")
        run.add_argument(
            "--netns",
            default=None,
            help="watch links and uevents in this named network namespace (tests, benches)",
        )
        run.add_argument(
            "--netlink-rcvbuf",
            type=_positive_int,
            default=None,
            help="receive buffer of each netlink socket in bytes (default 8 MiB; fault tests shrink it)",
        )

    if wanted("scan"):
        scan = _sub(
            sub,
            "scan",
            "print the devices discovery finds (and pools with --config)",
            "densedev scan --config /etc/pcidp/config.json",
        )
        _add_sysfs_root(scan)
        scan.add_argument("--config", type=Path, default=None, help="also show each pool's selection")
        _add_resource_prefix(scan)
        scan.add_argument("--json", action="store_true", help="print JSON (schema in docs/config.md)")
        scan.add_argument(
            "--verbose",
            action="store_true",
            help="with --config, list every excluded device of each reason (default: a count and 3 examples)",
        )

    if wanted("check-config"):
        check = _sub(
            sub,
            "check-config",
            "validate a config file and print every problem",
            "densedev check-config /etc/pcidp/config.json",
        )
        check.add_argument("file", type=Path, help="the config file")
        check.add_argument(
            "--strict",
            action="store_true",
            help="treat warnings as errors (e.g. what the SR-IOV network device plugin would refuse)",
        )
        _add_resource_prefix(check)

    if wanted("simulate"):
        sim = _sub(
            sub,
            "simulate",
            "write a simulated SR-IOV/RDMA sysfs tree and a matching config",
            "densedev simulate --out /tmp/node --pfs 4 --vfs-per-pf 64 --rdma",
        )
        sim.add_argument("--out", type=Path, required=True, help="directory to create (refused if it exists)")
        sim.add_argument("--force", action="store_true", help="replace an existing simulated node at --out")
        _add_node_shape(sim, least=0)
        sim.add_argument("--rdma", action="store_true", help="give every function an RDMA device")
        sim.add_argument(
            "--numa-nodes", type=_int_at_least(1), default=2, help="NUMA nodes to spread NICs on"
        )

    if wanted("simulate-kernel"):
        kern = _sub(
            sub,
            "simulate-kernel",
            "answer driver rebinds on a simulated node as the kernel would, until stopped",
            "densedev simulate-kernel --sysfs-root /tmp/node --dev-root /tmp/node-dev",
            level="warning",  # its one printed line says it is ready
        )
        _add_sysfs_root(kern)
        kern.add_argument(
            "--dev-root",
            type=Path,
            required=True,
            help="where /dev/vfio/<group> nodes appear when vfio-pci binds",
        )
        kern.add_argument(
            "--uevent-netns",
            default=None,
            help="send the kernel's bind/unbind and netdev add/remove uevents in this network namespace",
        )

    if wanted("demo"):
        # The live view is the demo's output; device warnings are its content, so it logs errors only.
        demo = _sub(
            sub,
            "demo",
            "run the plugin on a simulated node against the kubelet emulator",
            "densedev demo --seconds 20",
            level="error",
        )
        _add_seconds(demo)
        _add_node_shape(demo, least=1)
        demo.add_argument("--flip-interval", type=_seconds, default=0.5, help="seconds between health flips")
        demo.add_argument(
            "--dra",
            action="store_true",
            help="serve the node through DRA: ResourceSlices at an API-server stand-in, claims prepared "
            "by a DRA kubelet emulator",
        )
        demo.add_argument(
            "--workdir",
            type=Path,
            default=None,
            help="keep the simulated node here and reuse it next time (default: a temp dir, removed)",
        )

    if wanted("kubelet-emulator"):
        emu = _sub(
            sub,
            "kubelet-emulator",
            "serve a stand-in kubelet in DIR to try run end to end: registrations, device lists, allocations",
            "densedev kubelet-emulator /tmp/kubelet --allocate intel.com/sriov_ens1f0=2",
            level="warning",  # its printed lines are its output
        )
        emu.add_argument("dir", type=Path, help="the device-plugin directory to serve kubelet.sock in")
        emu.add_argument(
            "--allocate",
            action="append",
            default=[],
            type=_allocation,
            metavar="RESOURCE=COUNT",
            help="once listed, allocate COUNT healthy devices of RESOURCE and print the env (repeatable)",
        )
        _add_seconds(emu)
    if command not in _OWN_COMMANDS:
        from .dra import commands as dra_commands

        dra_commands.add_parsers(sub, _add_common, DEFAULT_PREFIX)  # dra-slices, dra-manifests
    return parser


def _setup_logging(args: argparse.Namespace) -> None:
    from .ops.logs import setup_logging

    setup_logging(args.log_level, args.log_format)


def _cmd_check(args: argparse.Namespace) -> int:
    from .pools import config
    from .printable import escape

    shown = escape(str(args.file))
    try:
        # One read: the file may change (or be a FIFO's other end) between two.
        cfg = config.load(args.file, default_prefix=args.resource_prefix)
    except config.ConfigError as exc:
        for p in exc.problems:
            print(f"{shown}: {p}")
        return 1
    label = "error" if args.strict else "warning"
    for w in cfg.warnings:
        print(f"{shown}: {label}: {w}")
    if args.strict and cfg.warnings:
        return 1
    print(f"{shown}: OK")
    return 0


def _cmd_scan(args: argparse.Namespace) -> int:
    from .node import scanner as discovery
    from .pools import config as config_mod
    from .pools import select as selectors

    # The Scanner's scan: a device whose files do not answer is left out with one warning (node.stuck).
    table = discovery.Scanner(args.sysfs_root).scan()
    for w in table.warnings:
        log.warning("scan: %s", w)
    if args.config is None:
        if args.json:
            json.dump({"devices": [_device_json(d) for d in table.devices]}, sys.stdout, indent=1)
            print()
        else:
            _print_escaped(discovery.format_devices(table))
        return 0
    try:
        cfg = config_mod.load(args.config, default_prefix=args.resource_prefix)
    except config_mod.ConfigError as exc:
        for p in exc.problems:
            print(f"{args.config}: {p}", file=sys.stderr)
        return 1
    result = selectors.explain(cfg, table.devices)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        _print_escaped(
            selectors.format_explain(result, max_excluded=len(table.devices) if args.verbose else 3)
        )
    return 0


def _print_escaped(text: str) -> None:
    """Print a report line by line with control characters escaped.

    Names come from sysfs, and the kernel's dev_valid_name() lets an interface name hold an escape
    sequence: a report must not hand it to the operator's terminal (JSON output escapes by itself).
    """
    from .printable import escape

    print("\n".join(escape(line) for line in text.split("\n")))


def _device_json(d: Any) -> dict[str, Any]:
    """One device of ``scan --json``: every Device field, plus the names ``scan --config --json`` uses.

    ``device_code`` and ``numa`` (null when unknown) mean the same in both outputs; ``device`` and
    ``numa_node`` stay for readers of the earlier form.
    """
    out: dict[str, Any] = d._asdict()
    out["device_code"] = d.device
    out["numa"] = d.numa_node if d.numa_node >= 0 else None
    return out


def _cmd_simulate_kernel(args: argparse.Namespace) -> int:
    from .testing import simkernel

    if not (args.sysfs_root / ".simnode").is_dir():
        # Never on a real /sys: the simulated kernel writes into the tree it serves.
        raise CommandError(f"{args.sysfs_root} is not a simulated node (no .simnode/; see densedev simulate)")
    try:
        return simkernel.serve_process(args.sysfs_root, args.dev_root, args.uevent_netns)
    except OSError as exc:  # no inotify watches left, an unwritable tree
        raise CommandError(f"cannot serve {args.sysfs_root}: {exc.strerror or exc}") from None


def _cmd_simulate(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from .testing import simnode

    out: Path = args.out
    replace = _check_simulate_target(out, args.force)
    parent = out.absolute().parent
    try:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise CommandError(f"cannot write {out}: {parent} is not a directory") from None
        # Built beside the target and renamed into place: an interrupted run leaves no half-built node
        # under --out, and the tree's own symlinks are relative, so it survives the rename.
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
    except OSError as exc:
        raise CommandError(f"cannot write {out}: {exc.strerror}") from None
    progress = simnode.BuildProgress(sys.stderr, "building the simulated node")
    try:
        with _sigterm_interrupts():
            layout = simnode.simulate(
                work,
                args.pfs,
                args.vfs_per_pf,
                args.vendor,
                args.rdma,
                args.numa_nodes,
                progress=progress,
            )
            if replace:
                trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
                os.rename(out, trash / "node")
                os.rename(work, out)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(work, out)  # replaces an empty directory, as rename(2) allows
    except ValueError as exc:  # sizes that do not fit a PCI domain
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        progress.done()
        shutil.rmtree(work, ignore_errors=True)
    nvfs = sum(len(pf.vf_addresses) for pf in layout.pfs)
    print(f"simulated node in {out}: {len(layout.pfs)} PFs, {nvfs} VFs; config {out / 'config.json'}")
    return 0


def _check_simulate_target(out: Path, force: bool) -> bool:
    """Return whether ``out`` holds a simulated node to replace; raise when it must not be touched."""
    if out.is_symlink():
        raise CommandError(f"--out {out} is a symbolic link; give the real directory")
    if not out.exists():
        return False
    if not out.is_dir():
        raise CommandError(f"--out {out} exists and is not a directory")
    if not any(out.iterdir()):
        return False
    # Only a tree simulate wrote (it keeps .simnode/ at its root) is ever deleted, even with --force.
    if not (out / ".simnode").is_dir():
        raise CommandError(f"--out {out} exists and is not a simulated node; choose another directory")
    if not force:
        raise CommandError(f"--out {out} already holds a simulated node; add --force to replace it")
    return True


class _Interrupted(BaseException):
    """SIGTERM turned into an exception, so ``finally`` blocks clean up as for Ctrl-C."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    def raise_interrupted(signum: int, frame: object) -> None:
        raise _Interrupted()

    old = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


async def _serve(args: argparse.Namespace, ahead: ScanAhead | None = None) -> int:
    import asyncio

    from .daemon import Daemon, DaemonSettings
    from .dra import DraSettings
    from .ops.preflight import InstanceLock, LockHeld, PreflightError, kubelet_dir_problem
    from .pools import config as config_mod

    problem = kubelet_dir_problem(args.kubelet_dir)
    if problem is not None:
        raise CommandError(f"--kubelet-dir {problem}", 2)
    if args.config is None:
        args.config = default_config()
        log.info("config file %s (no --config given)", args.config)
    try:
        cfg = config_mod.load(args.config, default_prefix=args.resource_prefix)
    except config_mod.ConfigError as exc:
        for p in exc.problems:
            log.error("invalid config %s: %s", args.config, p)
        return 2
    if any(p.api is PoolApi.DRA for p in cfg.pools):
        from .dra import apiclient

        # The API client library (~0.4-0.7 s of imports) while the scan-ahead child reads sysfs: the
        # driver makes its client right after the scan, and the first slices waited on this import.
        took = apiclient.preload()
        log.debug("API client library imported in %.3f s", took)
    lock = InstanceLock(args.kubelet_dir)
    held: LockHeld | None = None
    try:
        unlocked = lock.acquire()
    except LockHeld as exc:
        if not args.wait_for_lock:
            raise CommandError(str(exc)) from None
        held, unlocked = exc, None
    except PreflightError as exc:
        raise CommandError(str(exc)) from None
    if unlocked is not None:
        log.warning("%s; a second daemon on this directory would not be refused", unlocked)
    settings = DaemonSettings(
        sysfs_root=args.sysfs_root,
        kubelet_dir=args.kubelet_dir,
        dev_root=args.dev_root,
        cdi_dir=args.cdi_dir if args.cdi_dir is not None or not args.use_cdi else Path(CDI_DIR),
        cdi_annotations=args.cdi_annotations,
        devinfo_dir=args.devinfo_dir if str(args.devinfo_dir) not in ("", ".") else None,
        resource_prefix=args.resource_prefix,
        config_path=args.config,
        metrics_addr=args.metrics_addr,
        netlink=not args.no_netlink,
        netns=args.netns,
        pod_resources_socket=args.pod_resources_socket
        if str(args.pod_resources_socket) not in ("", ".")
        else None,
        start_timeout_s=args.start_timeout,
        dra=DraSettings(
            node_name=args.node_name,
            kubeconfig=args.kubeconfig,
            plugins_dir=args.kubelet_plugins_dir,
            registry_dir=args.kubelet_registry_dir,
            taints=args.dra_taints,
            write_qps=args.dra_write_qps,
            write_burst=args.dra_write_burst,
        ),
    )
    if args.netlink_rcvbuf is not None:
        settings = settings._replace(netlink_rcvbuf=args.netlink_rcvbuf)
    daemon = Daemon(settings, cfg, scan_ahead=ahead)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, daemon.request_reload)
    # The start runs as a task beside the wait for a stop signal: whatever it waits for (the scanning
    # child, a sysfs read that does not answer, the kubelet), SIGTERM ends it at once (issue 23, item 3).
    starting = asyncio.ensure_future(daemon.start() if held is None else _start_after(daemon, lock, held))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        try:
            await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
            await starting
        except asyncio.CancelledError:
            if not stop.is_set():
                raise  # not ours: the run itself is cancelled
            log.info("stopped while starting")
            await daemon.stop()
            return 0
        except OSError as exc:
            # A busy or forbidden metrics port, an unreadable directory: the environment, not a bug.
            await daemon.stop()
            raise CommandError(f"cannot start: {exc.strerror or exc}" + _filename(exc)) from None
        # Off since _dispatch; what start-up made is frozen now (Daemon.start: gc.freeze).  With DRA
        # pools it stays off until the first publish is done (bounded): every slice is read back twice
        # then (the create's answer, its watch event), and the collector walking the growing mirror
        # was ~1 s of a 65,536-device start.  A stop signal ends the wait.
        publishing = asyncio.ensure_future(daemon.first_published())
        await asyncio.wait((publishing, stopping), timeout=GC_HELD_FOR_PUBLISH_S,
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
        # The publish's garbage collected once (not the start's objects, frozen), what lives frozen too.
        gc.collect()
        gc.freeze()
        gc.enable()
        try:
            await stop.wait()
        finally:
            await daemon.stop()
    finally:
        stopping.cancel()
        lock.release()
    return daemon.exit_code()


async def _start_after(daemon: Daemon, lock: InstanceLock, held: LockHeld) -> None:
    """Prepare beside the daemon holding the lock, wait for it to let go, then start at once.

    The lock is the guard that no device is offered by two daemons: the old one lets go only once its
    sockets are gone (``_serve``'s ``finally``), and nothing here serves, registers or reads what pods
    hold before it is ours.  Cancelled (SIGTERM) at any point, it leaves the old daemon's files alone.
    """
    import asyncio

    log.info("%s; standing by (--wait-for-lock): preparing, then serving once it has stopped", held)
    await daemon.prepare()
    log.info(
        "prepared beside pid %s: %d devices scanned; waiting for its lock", held.holder, len(daemon.devices)
    )
    keeping = asyncio.ensure_future(daemon.stand_by())
    # The cyclic GC (off for the start, _dispatch) runs while standing by: a wait may last as long as
    # the rollout stalls, rescanning every few seconds.
    gc.enable()
    try:
        unlocked = await lock.wait()
    finally:
        gc.disable()
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
    if unlocked is not None:
        log.warning("%s; a second daemon on this directory would not be refused", unlocked)
    log.info("the lock is ours (pid %s has stopped): serving", held.holder)
    await daemon.start()


def _filename(exc: OSError) -> str:
    return f": {exc.filename}" if exc.filename else ""


# The daemon scans in worker threads (densedev.workers), which hold the GIL while they turn what they
# read into rows.  The event loop's thread, woken by a netlink event, asks for the GIL only after
# waiting sys.getswitchinterval() (CPython's default 5 ms), so a health message could wait that long
# during a scan; 1 ms keeps it to about a millisecond for a few more GIL hand-overs per scan.
SWITCH_INTERVAL_S = 0.001
GC_HELD_FOR_PUBLISH_S = 30.0  # the collector waits at most this long for the first DRA publish


def _reader_gone() -> int:
    """The reader of stdout went away (``densedev scan | head``): end quietly, as a C tool would.

    What is still buffered would raise BrokenPipeError again when the interpreter flushes stdout at exit
    ("Exception ignored ..."), so stdout is pointed at /dev/null first (the way Python's documentation
    of SIGPIPE recommends).  The status is the shell's for a command ended by SIGPIPE, so a script
    with ``set -o pipefail`` sees the same as with ``ls | head``.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None, *, scan_ahead: ScanAhead | None = None) -> int:
    """Entry point of the ``densedev`` command: every expected failure is one line and an exit code.

    ``scan_ahead`` is the child the entry point forked for ``run``'s first scan (``densedev.__main__``).
    """
    argv, notes = go_plugin_argv(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command_word(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        from .dra import commands as dra_commands

        parser.error(f"a command is required: one of {', '.join((*_OWN_COMMANDS, *dra_commands.COMMANDS))}")
    _setup_logging(args)
    for note in notes:
        log.warning("%s", note)
    if getattr(args, "log_dir", None) is not None:
        log.info("--log-dir %s is not used: densedev logs to stderr, as Kubernetes expects", args.log_dir)
    # gRPC core writes its own lines (chttp2 GOAWAY notes, add_port errors) straight to stderr in its
    # own format; the daemon reports what matters itself, so they are off unless the user sets
    # GRPC_VERBOSITY (DEBUG, INFO, ERROR) to see them.  Read by gRPC core when it first initialises.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        code = _dispatch(args, scan_ahead)
        sys.stdout.flush()  # inside the try: a reader gone before the last buffer is flushed
        return code
    except CommandError as exc:
        _fail(args, str(exc))
        return exc.code
    except (KeyboardInterrupt, _Interrupted):
        _fail(args, "interrupted")
        return 130
    except BrokenPipeError:
        return _reader_gone()
    except OSError as exc:
        if args.command == "run":
            raise
        # A path the OS refuses (unwritable --out, a file where a directory should be): the user's to
        # fix, so one line naming it rather than a traceback.
        from .printable import escape

        where = f": {escape(str(exc.filename))}" if exc.filename else ""
        _fail(args, f"{exc.strerror or exc}{where}")
        return 1


def _fail(args: argparse.Namespace, message: str) -> None:
    """Say why the command failed in one line: in the daemon's log format for run, plainly otherwise."""
    if args.command == "run":
        log.error("%s", message)
    else:
        print(f"densedev {args.command}: error: {message}", file=sys.stderr)


def _dispatch(args: argparse.Namespace, scan_ahead: ScanAhead | None = None) -> int:
    if args.command == "check-config":
        return _cmd_check(args)
    if args.command == "scan":
        return _cmd_scan(args)
    if args.command == "simulate":
        return _cmd_simulate(args)
    if args.command == "simulate-kernel":
        return _cmd_simulate_kernel(args)
    if args.command not in _OWN_COMMANDS:
        from .dra import commands as dra_commands

        return dra_commands.COMMANDS[args.command](args)
    # uvloop (and asyncio under it, ~30 ms of imports) only for the commands that run an event loop.
    if args.command == "run":
        # What start-up makes (modules, the device table, pools, encoded lists) lives as long as the
        # daemon, so each pass of CPython's cyclic GC over it is wasted: ~90 collections before the
        # first list at 4,096 VFs, a tenth of the start's CPU.  Off until the daemon has started and
        # frozen those objects (_serve turns it back on); on again here whatever happened.
        gc.disable()
        # The first scan reads sysfs in a child process while this one imports the rest (node.ahead):
        # the entry point's, if it scans the root the flags name, else one forked now.
        ahead = scan_ahead
        if ahead is None or not ahead.scans(args.sysfs_root):
            if ahead is not None:
                ahead.cancel()
            ahead = ScanAhead.start(args.sysfs_root)
        try:
            import uvloop

            log.info("densedev %s starting (implementation=%s)", __version__, accel.IMPLEMENTATION)
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            return uvloop.run(_serve(args, ahead))
        finally:
            if ahead is not None:
                ahead.cancel()  # not taken (a bad config, a second daemon): the child goes too
            gc.enable()
    if args.command == "kubelet-emulator":
        import uvloop

        from .emulator_cli import run_emulator

        try:
            return uvloop.run(run_emulator(args))
        except BrokenPipeError:
            raise
        except OSError as exc:  # an unwritable DIR, a socket path over 107 bytes
            raise CommandError(str(exc)) from None
    if args.command == "demo":
        import uvloop

        from .demo import run_demo

        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            return uvloop.run(run_demo(args))
        except BrokenPipeError:
            raise
        except OSError as exc:  # an unwritable --workdir, a full /dev/shm
            raise CommandError(
                f"{exc.strerror or exc}{_filename(exc)}" if exc.strerror else str(exc)
            ) from None
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())

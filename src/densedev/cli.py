"""The ``densedev`` command: flags and environment → settings; runs the daemon, scan, simulate, demo."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import uvloop

from . import __version__, accel
from .dra import commands as dra_commands

log = logging.getLogger("densedev.cli")

DEFAULT_PREFIX = "intel.com"  # the SR-IOV network device plugin's default resourcePrefix


def _add_common(p: argparse.ArgumentParser, level: str = "info") -> None:
    p.add_argument("--log-level", default=os.environ.get("DENSEDEV_LOG_LEVEL", level))
    p.add_argument(
        "--log-format", choices=("kv", "json"), default=os.environ.get("DENSEDEV_LOG_FORMAT", "kv")
    )


def _positive_int(text: str) -> int:
    """Parse a positive integer argument (argparse reports a ValueError as one usage line)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of every sub-command."""
    parser = argparse.ArgumentParser(prog="densedev", description=__doc__)
    parser.add_argument(
        "--version",
        action="version",
        version=f"densedev {__version__} ({accel.IMPLEMENTATION}: {accel.DETAIL})",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the device plugin daemon")
    _add_common(run)
    run.add_argument("--config", type=Path, default=Path("/etc/pcidp/config.json"))
    run.add_argument("--sysfs-root", type=Path, default=Path("/sys"))
    run.add_argument("--kubelet-dir", type=Path, default=Path("/var/lib/kubelet/device-plugins"))
    run.add_argument("--dev-root", type=Path, default=Path("/dev"))
    run.add_argument("--cdi-dir", type=Path, default=None, help="write CDI specs here (e.g. /var/run/cdi)")
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
    run.add_argument("--resource-prefix", default=DEFAULT_PREFIX)
    run.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        help="the kubelet's PodResources API: which devices running pods hold ('' for the checkpoint only)",
    )
    run.add_argument("--metrics-addr", default=None, help="serve /metrics, /healthz, /readyz on HOST:PORT")
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

    scan = sub.add_parser("scan", help="print the devices discovery finds (and pools with --config)")
    _add_common(scan)
    scan.add_argument("--sysfs-root", type=Path, default=Path("/sys"))
    scan.add_argument("--config", type=Path, default=None)
    scan.add_argument("--resource-prefix", default=DEFAULT_PREFIX)
    scan.add_argument("--json", action="store_true")

    check = sub.add_parser("check-config", help="validate a config file and print every problem")
    _add_common(check)
    check.add_argument("file", type=Path)
    check.add_argument("--resource-prefix", default=DEFAULT_PREFIX)

    sim = sub.add_parser("simulate", help="write a simulated SR-IOV/RDMA sysfs tree and a matching config")
    _add_common(sim)
    sim.add_argument("--out", type=Path, required=True)
    sim.add_argument("--pfs", type=int, default=16)
    sim.add_argument("--vfs-per-pf", type=int, default=256)
    sim.add_argument("--vendor", choices=("mellanox", "intel"), default="mellanox")
    sim.add_argument("--rdma", action="store_true")
    sim.add_argument("--numa-nodes", type=int, default=2)

    demo = sub.add_parser("demo", help="run the plugin on a simulated node against the kubelet emulator")
    _add_common(demo, "error")  # the live view is the demo's output; device warnings are its content
    demo.add_argument("--seconds", type=float, default=0.0, help="stop after N seconds (0: until Ctrl-C)")
    demo.add_argument("--pfs", type=int, default=16)
    demo.add_argument("--vfs-per-pf", type=int, default=256)
    demo.add_argument("--vendor", choices=("mellanox", "intel"), default="mellanox")
    demo.add_argument("--flip-interval", type=float, default=0.5, help="seconds between health flips")
    demo.add_argument("--workdir", type=Path, default=None, help="keep the simulated node here")
    dra_commands.add_parsers(sub, _add_common, DEFAULT_PREFIX)  # dra-slices, dra-manifests
    return parser


def _setup_logging(args: argparse.Namespace) -> None:
    from .logs import setup_logging

    setup_logging(args.log_level, args.log_format)


def _cmd_check(args: argparse.Namespace) -> int:
    from . import config
    from .printable import escape

    shown = escape(str(args.file))
    try:
        # One read: the file may change (or be a FIFO's other end) between two.
        cfg = config.load(args.file, default_prefix=args.resource_prefix)
    except config.ConfigError as exc:
        for p in exc.problems:
            print(f"{shown}: {p}")
        return 1
    for w in cfg.warnings:
        print(f"{shown}: warning: {w}")
    print(f"{shown}: OK")
    return 0


def _cmd_scan(args: argparse.Namespace) -> int:
    from . import config as config_mod
    from . import discovery, selectors

    table = discovery.scan(args.sysfs_root)
    for w in table.warnings:
        log.warning("scan: %s", w)
    if args.config is None:
        if args.json:
            json.dump({"devices": [d._asdict() for d in table.devices]}, sys.stdout, indent=1)
            print()
        else:
            print(discovery.format_table(table))
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
        print(selectors.format_table(result))
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from .testing import simnode

    layout = simnode.simulate(args.out, args.pfs, args.vfs_per_pf, args.vendor, args.rdma, args.numa_nodes)
    nvfs = sum(len(pf.vf_addresses) for pf in layout.pfs)
    print(
        f"simulated node in {args.out}: {len(layout.pfs)} PFs, {nvfs} VFs; config {args.out / 'config.json'}"
    )
    return 0


async def _serve(args: argparse.Namespace) -> int:
    from . import config as config_mod
    from .manager import Daemon, DaemonSettings

    try:
        cfg = config_mod.load(args.config, default_prefix=args.resource_prefix)
    except config_mod.ConfigError as exc:
        for p in exc.problems:
            log.error("invalid config %s: %s", args.config, p)
        return 2
    settings = DaemonSettings(
        sysfs_root=args.sysfs_root,
        kubelet_dir=args.kubelet_dir,
        dev_root=args.dev_root,
        cdi_dir=args.cdi_dir,
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
    )
    if args.netlink_rcvbuf is not None:
        settings = dataclasses.replace(settings, netlink_rcvbuf=args.netlink_rcvbuf)
    daemon = Daemon(settings, cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, daemon.request_reload)
    await daemon.start()
    try:
        await stop.wait()
    finally:
        await daemon.stop()
    return 0


# The daemon scans in worker threads (asyncio.to_thread), which hold the GIL while they turn what they
# read into rows.  The event loop's thread, woken by a netlink event, asks for the GIL only after
# waiting sys.getswitchinterval() (CPython's default 5 ms), so a health message could wait that long
# during a scan; 1 ms keeps it to about a millisecond for a few more GIL hand-overs per scan.
SWITCH_INTERVAL_S = 0.001


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``densedev`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _setup_logging(args)
    except ValueError as exc:  # a log level or format the user mistyped: usage and one line, exit 2
        parser.error(str(exc))
    simple = {
        "check-config": _cmd_check,
        "scan": _cmd_scan,
        "simulate": _cmd_simulate,
        **dra_commands.COMMANDS,
    }
    if args.command in simple:
        command = simple[args.command]
        try:
            code = command(args)
            sys.stdout.flush()  # inside the try: a reader gone before the last buffer is flushed
        except BrokenPipeError:
            return _reader_gone()
        except OSError as exc:
            # A path the OS refuses (unwritable --out, a file where a directory should be): the user's
            # to fix, so one line naming it rather than a traceback.
            from .printable import escape

            where = f": {escape(str(exc.filename))}" if exc.filename else ""
            print(f"densedev {args.command}: {exc.strerror or exc}{where}", file=sys.stderr)
            return 1
        return code
    if args.command == "run":
        log.info("densedev %s starting (implementation=%s)", __version__, accel.IMPLEMENTATION)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        return uvloop.run(_serve(args))
    if args.command == "demo":
        from .demo import run_demo

        sys.setswitchinterval(SWITCH_INTERVAL_S)
        return uvloop.run(run_demo(args))
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())

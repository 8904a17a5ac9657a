"""The ``densedev`` command's entry point (and ``python -m densedev``): the first scan starts, then the
command loads with the collector off.

``densedev run`` forks the child that reads its first scan (``node.ahead``) here, before the command
module and its ~40 ms of imports (argparse, logging, the accelerator, the models) load: the child then
scans while this process imports everything, not only what comes after the flags.  The sysfs root is
read from the raw arguments (``--sysfs-root DIR`` or ``--sysfs-root=DIR``, else the default); the
command checks it against the flags it parses, and a root spelled otherwise (an abbreviated flag, a
trailing slash) only costs a second fork there.  A command that ends before taking the scan (bad
flags, ``--help``) kills and reaps the child on its way out.

Loading the command imports ~120 modules before it reads a flag, and CPython's cyclic collector would
walk their new objects a few dozen times meanwhile: ~4 ms of every start (``python -c 'import
densedev.cli'`` with and without ``gc.disable()``, 12 runs each: medians 52.2 and 48.1 ms).  Nothing
made while loading is garbage, so nothing is lost by not collecting; the collector is back on before
the command runs (``densedev run`` keeps it off until the daemon has started and frozen what start-up
made: cli._dispatch).
"""

from __future__ import annotations

import gc
import sys

# typing.TYPE_CHECKING without importing typing (and re, enum) before the collector is off: mypy reads
# a module-level TYPE_CHECKING this way too.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from .node.ahead import ScanAhead

_ROOT_FLAG = "--sysfs-root"


def early_scan_root(argv: Sequence[str]) -> str | None:
    """The sysfs root ``densedev run`` will scan, read from raw arguments; None for another command.

    The command is read as the command module reads it (``argv.command_word``); a run asking for help
    scans nothing.  The last ``--sysfs-root`` wins, as with argparse.
    """
    from .argv import command_word, go_plugin_argv

    argv = go_plugin_argv(argv)[0]  # the Go plugin's command line is a run's
    if command_word(argv) != "run":
        return None
    if "-h" in argv or "--help" in argv:
        return None
    from .node.layout import SYSFS_ROOT

    root = SYSFS_ROOT
    for i, arg in enumerate(argv):
        if arg == _ROOT_FLAG and i + 1 < len(argv):
            root = argv[i + 1]
        elif arg.startswith(_ROOT_FLAG + "="):
            root = arg.partition("=")[2]
    return root


def _scan_ahead(argv: Sequence[str]) -> ScanAhead | None:
    """Fork the first scan's child now when the command is ``run`` (None otherwise, or if it cannot)."""
    root = early_scan_root(argv)
    if root is None:
        return None
    from .node.ahead import ScanAhead

    return ScanAhead.start(root)


def main() -> int:
    """Start the first scan if the command is ``run``, load the command with the collector off, run it."""
    was_enabled = gc.isenabled()
    gc.disable()
    ahead = None
    try:
        try:
            ahead = _scan_ahead(sys.argv[1:])
            from .cli import main as command
        finally:
            if was_enabled:
                gc.enable()
        return command(scan_ahead=ahead)
    finally:
        if ahead is not None:
            ahead.cancel()  # not taken (bad flags, a bad config): the child goes too


if __name__ == "__main__":
    sys.exit(main())

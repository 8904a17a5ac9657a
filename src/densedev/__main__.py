"""The ``densedev`` command's entry point (and ``python -m densedev``): the collector off while it loads.

Loading the command imports ~120 modules before it reads a flag (argparse, logging, the accelerator,
the models), and CPython's cyclic collector would walk their new objects a few dozen times meanwhile:
~4 ms of every start (``python -c 'import densedev.cli'`` with and without ``gc.disable()``, 12 runs
each: medians 52.2 and 48.1 ms).  Nothing made while loading is garbage, so nothing is lost by not
collecting; the collector is back on before the command runs (``densedev run`` keeps it off until the
daemon has started and frozen what start-up made: cli._dispatch).
"""

from __future__ import annotations

import gc
import sys


def main() -> int:
    """Load the command with the collector off, then run it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        from .cli import main as command
    finally:
        if was_enabled:
            gc.enable()
    return command()


if __name__ == "__main__":
    sys.exit(main())

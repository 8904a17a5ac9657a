"""The one seam between densedev and its accelerator: the Cython ``_fast`` or its Python twin.

Everything else imports hot-path functions from here.  ``DENSEDEV_NO_EXTENSIONS=1`` forces the twin
(as yarl's ``YARL_NO_EXTENSIONS`` does); a missing or broken build falls back to it too, and
``IMPLEMENTATION`` says which one runs so logs and metrics can report it.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

from ._mirrored import MIRRORED

# Read here and nowhere else (setup.py's build switch aside): tests and benchmarks ask this module.
NO_EXTENSIONS = os.environ.get("DENSEDEV_NO_EXTENSIONS", "") not in ("", "0")
FALLBACK_REASON = ""  # why the twin runs though the extension was not turned off ("" otherwise)


def _twin() -> ModuleType:
    # Imported only when it runs: the twin is ~10 ms of imports a node with the extension never uses.
    from . import _fast_py

    return _fast_py


def _choose() -> tuple[ModuleType, str, str]:
    global FALLBACK_REASON
    if NO_EXTENSIONS:
        return _twin(), "python", "DENSEDEV_NO_EXTENSIONS is set"  # asked for: silent
    try:
        from . import _fast  # type: ignore[attr-defined]
    except ImportError as exc:
        # Here only, as logging below: the child reading the first scan (node.ahead) loads this module
        # first thing, and needs neither on the path that works.
        import importlib.util

        if importlib.util.find_spec(f"{__package__}._fast") is None:
            FALLBACK_REASON = "not built"
        else:
            # A .so that exists but does not load (wrong Python ABI, a missing symbol, a truncated
            # file) would otherwise make every figure and every node silently the twin's: say so once.
            FALLBACK_REASON = f"the built extension does not load: {exc}"
            import logging

            logging.getLogger(__name__).warning(
                "running the plain-Python twin: %s (rebuild it, or set DENSEDEV_NO_EXTENSIONS=1)",
                FALLBACK_REASON,
            )
        return _twin(), "python", f"no extension: {FALLBACK_REASON}"
    return _fast, "cython", os.path.basename(_fast.__file__ or "_fast")


# DETAIL says which file runs, or why the twin does (``densedev --version`` prints it): a wheel built
# for another interpreter or without a compiler shows here instead of only running slower.
impl, IMPLEMENTATION, DETAIL = _choose()

# Hot-path functions, re-exported by name: _mirrored.MIRRORED says which (the one list of them).
globals().update((name, getattr(impl, name)) for name in MIRRORED)

if TYPE_CHECKING:
    # _fast.pyi types both implementations (the twin's signatures, which a test checks it against).
    from ._fast import *  # noqa: F403

__all__ = ["DETAIL", "FALLBACK_REASON", "IMPLEMENTATION", "NO_EXTENSIONS", "impl"]
__all__ += MIRRORED  # the mirrored functions

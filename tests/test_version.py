"""``densedev --version`` names the implementation that runs and, for the extension, its file."""

from __future__ import annotations

import os
import subprocess
import sys

from densedev import __version__, accel


def version(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "densedev.cli", "--version"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return done.stdout.strip()


def test_version_shows_the_extension_file_or_why_the_twin_runs(child_env: dict[str, str]) -> None:
    if accel.IMPLEMENTATION == "cython":
        # The file's name carries the interpreter and platform it was built for (the image's check).
        name = os.path.basename(accel.impl.__file__ or "")
        assert name.startswith("_fast.cpython-") and name.endswith(".so")
        assert version(child_env) == f"densedev {__version__} (cython: {name})"
    forced = {**child_env, "DENSEDEV_NO_EXTENSIONS": "1"}
    assert version(forced) == f"densedev {__version__} (python: DENSEDEV_NO_EXTENSIONS is set)"

"""A fresh interpreter for a test: one that has imported nothing yet, or has no thread but its own."""

from __future__ import annotations

import subprocess
import sys

GUARD_S = 60.0  # hang guard only


def fresh_interpreter(
    code: str, *argv: str, env: dict[str, str] | None = None, timeout: float = GUARD_S
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter with ``argv``; it must exit 0 (its stderr's tail says why not)."""
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done

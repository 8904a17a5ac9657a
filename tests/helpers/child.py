"""A ``densedev`` daemon in a child process, its stderr lines collected as they come."""

from __future__ import annotations

import asyncio
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

GUARD = 60.0  # hang guard only


def run_args(node: Path, kdir: Path, *extra: str, log_level: str = "info") -> list[str]:
    """``densedev run``'s arguments for a simulated node and a kubelet dir (no netlink, no device-info)."""
    return [
        "--config",
        str(node / "config.json"),
        "--sysfs-root",
        str(node),
        "--kubelet-dir",
        str(kdir),
        "--no-netlink",
        "--devinfo-dir",
        "",
        "--log-level",
        log_level,
        *extra,
    ]


class Child:
    """``densedev run`` in a child process, its stderr lines collected by a thread as they come."""

    def __init__(
        self, args: list[str], env: dict[str, str], wrapper: Sequence[str] = (), entry_point: bool = False
    ) -> None:
        # entry_point: ``python -m densedev ARGS`` (the installed command, as an image runs it), else
        # ``python -m densedev.cli run ARGS``.
        command = ["densedev"] if entry_point else ["densedev.cli", "run"]
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", *command, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._q.put(line.rstrip("\n"))

    async def line_with(self, text: str) -> str:
        """Wait (on the loop) for a stderr line containing ``text``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GUARD
        while loop.time() < deadline:
            for line in self.lines:
                if text in line:
                    return line
            try:
                while True:
                    self.lines.append(self._q.get_nowait())
            except queue.Empty:
                pass
            if self.proc.poll() is not None and self._q.empty() and not self._reader.is_alive():
                break
            await asyncio.sleep(0.02)
        raise AssertionError(f"no line with {text!r} in {self.lines}")

    def stop(self) -> int:
        """SIGTERM the daemon and return its exit code once every line is read."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=GUARD)
        self._reader.join(GUARD)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        while not self._q.empty():
            self.lines.append(self._q.get_nowait())
        return code

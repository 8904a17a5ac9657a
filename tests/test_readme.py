"""The README's walk-through, run as written (only the /tmp directory is replaced by the test's own)."""

from __future__ import annotations

import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
GUARD = 60.0  # hang guard only


def walkthrough() -> list[list[str]]:
    """Return the commands of the README block marked as the walk-through, split as a shell would."""
    text = README.read_text()
    block = re.search(r"<!-- walkthrough:[^>]*-->\n```sh\n(.*?)```", text, re.S)
    assert block is not None, "the README lost its walk-through block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_walkthrough_works_as_written(sock_dir: Path, child_env: dict[str, str]) -> None:
    commands = walkthrough()
    assert [c[:2] for c in commands] == [
        ["densedev", "simulate"],
        ["densedev", "kubelet-emulator"],
        ["densedev", "run"],
    ]

    def local(cmd: list[str]) -> list[str]:
        args = [a.replace("/tmp/densedev-try", str(sock_dir)) for a in cmd[1:]]
        return [sys.executable, "-m", "densedev.cli", *args]

    simulate = subprocess.run(
        local(commands[0]), capture_output=True, text=True, timeout=GUARD, env=child_env
    )
    assert simulate.returncode == 0, simulate.stderr
    emulator = subprocess.Popen(local(commands[1]), stdout=subprocess.PIPE, text=True, env=child_env)
    daemon: subprocess.Popen[str] | None = None
    try:
        lines: queue.Queue[str] = queue.Queue()
        assert emulator.stdout is not None
        reader = threading.Thread(target=lambda: [lines.put(x) for x in emulator.stdout], daemon=True)  # type: ignore[union-attr]
        reader.start()
        assert lines.get(timeout=GUARD).startswith("kubelet emulator listening on")
        daemon = subprocess.Popen(local(commands[2]), stderr=subprocess.PIPE, text=True, env=child_env)
        seen: list[str] = []
        try:
            while not any(line.startswith("allocated ") for line in seen):
                seen.append(lines.get(timeout=GUARD))
        finally:
            daemon.send_signal(signal.SIGTERM)
            _, daemon_err = daemon.communicate(timeout=GUARD)
            emulator.send_signal(signal.SIGTERM)
            emulator.wait(timeout=GUARD)
            reader.join(GUARD)
            emulator.stdout.close()
    finally:
        # Whatever failed above (a line that never came, a stop that timed out): no child outlives the test.
        for proc in (daemon, emulator):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert daemon.returncode == 0, daemon_err
    assert emulator.returncode == 0
    assert "intel.com/sriov_ens1f0: 8 devices, 8 healthy\n" in seen
    allocated = next(line for line in seen if line.startswith("allocated "))
    assert "of intel.com/sriov_ens1f0: PCIDEVICE_INTEL_COM_SRIOV_ENS1F0=0000:" in allocated
    assert "Traceback" not in daemon_err

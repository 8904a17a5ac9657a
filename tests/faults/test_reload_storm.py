"""Fault: a reload storm against a real daemon process (issue 12, section 6).

``densedev run`` runs as its own process on a simulated node, registered with the kubelet emulator.
The test writes its config file 200 times in about 2 seconds, valid and invalid files alternating
(nesting 100,000 deep, a FIFO renamed into place, a name ending in a newline, a file over the size
limit, broken UTF-8, truncated JSON, control characters, 2,000 full VF ranges beside an unknown key),
and sends SIGHUP after every write.  The last file is valid.  Then exactly its pools are served: one
socket per pool plus ``kubelet.sock``, each with the devices it selects, and the daemon holds as many
file descriptors and threads as it did before the storm in the same configuration.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.node import GUARD_S, PREFIX

from densedev.testing import simnode
from densedev.testing.kubelet import KubeletEmulator

pytestmark = pytest.mark.faults

WRITES = 200
STORM_S = 2.0
# No periodic reconcile while the test runs: a scan in a worker thread at the wrong moment could start a
# second executor thread or hold a directory open, and the counts compared must be the reloads' alone.
QUIET = {"rdmaPollSeconds": 0.5, "reconcileSeconds": 3600}


class Storm:
    """A 4-PF simulated node, its config file, and the files the storm writes over it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.sysfs = tmp / "sys"
        self.layout = simnode.build_node(self.sysfs, pfs=4, vfs_per_pf=8)
        self.config = tmp / "config.json"
        self.kubelet_dir = Path(tempfile.mkdtemp(prefix="dd-", dir="/tmp"))  # sun_path is short
        self.log = tmp / "daemon.log"
        self.serial = 0

    def pfs(self) -> list[simnode.SimPF]:
        return list(self.layout.pfs)

    def valid(self, i: int) -> dict[str, Any]:
        """A valid config that differs with ``i``: pools come, go and change their VF ranges."""
        pfs = self.pfs()
        pools = [
            {"resourceName": f"pf{k}", "resourcePrefix": PREFIX, "selectors": {"pfNames": [pfs[k].netdev]}}
            for k in range(4)
            if (i >> k) & 1 or k == 0
        ]
        pools[0]["selectors"]["pfNames"] = [f"{pfs[0].netdev}#0-{i % 8}"]
        return {"resourceList": pools, **QUIET}

    def final(self) -> dict[str, Any]:
        """The storm's last file: a pool only it has, so reaching it proves the last reload applied."""
        pfs = self.pfs()
        return {
            "resourceList": [
                {"resourceName": "pf1", "resourcePrefix": PREFIX, "selectors": {"pfNames": [pfs[1].netdev]}},
                {
                    "resourceName": "final",
                    "resourcePrefix": PREFIX,
                    "selectors": {"pfNames": [f"{pfs[3].netdev}#1-5", f"{pfs[2].netdev}#7"]},
                },
            ],
            **QUIET,
        }

    def expected(self) -> dict[str, set[str]]:
        pfs = self.pfs()
        return {
            f"{PREFIX}/pf1": set(pfs[1].vf_addresses),
            f"{PREFIX}/final": {*pfs[3].vf_addresses[1:6], pfs[2].vf_addresses[7]},
        }

    def put(self, data: bytes | str | dict[str, Any] | None) -> None:
        """Swap a new file in by rename, as a ConfigMap update does; None swaps in a FIFO."""
        self.serial += 1
        tmp = self.tmp / f".config.{self.serial}"
        if data is None:
            os.mkfifo(tmp)
        elif isinstance(data, dict):
            tmp.write_text(json.dumps(data))
        else:
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        tmp.replace(self.config)

    def invalid(self, i: int) -> bytes | str | None:
        """The ``i``-th bad file: every kind of bad input the loader must refuse in one clear line."""
        pf = self.pfs()[0].netdev
        kinds: list[bytes | str | None] = [
            "[" * 100_000 + "]" * 100_000,
            None,  # a FIFO: opening it would wait for a writer forever
            json.dumps({"resourceList": [{"resourceName": "vf\n", "resourcePrefix": PREFIX}]}),
            b'{"resourceList": []}' + b" " * (1 << 20),
            b'{"resourceList": [{"resourceName": "\xff\xfe"}]}',
            '{"resourceList": [{"resourceName": "pf0", "selectors": {"pfNames": ["',
            json.dumps({"resourceList": [{"resourceName": "pf0", "selectors": {"drivers": ["a\x1b[2J"]}}]}),
            json.dumps(
                {
                    "resourceList": [
                        {"resourceName": "pf0", "selectors": {"pfNames": [f"{pf}#0-65535"] * 2000}, "bad": 1}
                    ]
                }
            ),
        ]
        return kinds[i % len(kinds)]

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "densedev.cli",
            "run",
            "--config",
            str(self.config),
            "--sysfs-root",
            str(self.sysfs),
            "--kubelet-dir",
            str(self.kubelet_dir),
            "--devinfo-dir",
            "",
            "--resource-prefix",
            PREFIX,
            "--no-netlink",
        ]

    def sockets(self) -> set[str]:
        out = set()
        for entry in os.scandir(self.kubelet_dir):
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                out.add(entry.name)
        return out


def usage(pid: int) -> tuple[int, int]:
    """Return the open file descriptors and threads of a process, from /proc."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


@pytest.fixture
def storm(tmp_path: Path) -> Iterator[Storm]:
    s = Storm(tmp_path)
    yield s
    shutil.rmtree(s.kubelet_dir, ignore_errors=True)


async def test_reload_storm_ends_on_the_last_valid_config_with_nothing_leaked(
    storm: Storm, child_env: dict[str, str]
) -> None:
    storm.put(storm.valid(0b1111))

    async def settled(
        emu: KubeletEmulator, proc: subprocess.Popen[bytes], expected: dict[str, set[str]]
    ) -> None:
        """Wait until the emulator holds exactly ``expected`` and the socket files agree."""

        def done() -> bool:
            assert proc.poll() is None, "the daemon exited"
            live = {r for r in emu.resources() if not emu.stream_ended(r)}
            return (
                live == set(expected)
                and all(set(emu.devices(r)) == ids for r, ids in expected.items())
                and len(storm.sockets()) == len(expected) + 1
            )

        await emu.wait_for(done, GUARD_S)

    async def stable(pid: int) -> tuple[int, int]:
        """Return the process's fds and threads once ten readings 50 ms apart agree."""
        readings = [usage(pid)]
        deadline = time.monotonic() + GUARD_S
        while (len(readings) < 10 or len(set(readings[-10:])) > 1) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            readings.append(usage(pid))
        return readings[-1]

    async def steady(pid: int, want: tuple[int, int]) -> tuple[int, int]:
        """Wait (bounded) until the process holds ``want``'s fds and no more threads than it may.

        asyncio's default executor starts worker threads on demand up to its bound and keeps them (a
        busy machine runs more reads at once), so threads may grow by that bound, never per reload:
        200 reloads leaking one each would be far past it.
        """
        fds, threads = want
        headroom = min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's default max_workers
        deadline = time.monotonic() + GUARD_S
        now = usage(pid)
        while not (now[0] == fds and now[1] <= threads + headroom) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            now = usage(pid)
        return now

    emu = KubeletEmulator(storm.kubelet_dir)
    await emu.start()
    with storm.log.open("wb") as log:
        # subprocess (vfork), not the loop's spawner: see densedev.testing.netns on gRPC and fork.
        proc = subprocess.Popen(storm.argv(), env=child_env, stdout=log, stderr=log)
    try:
        first = {f"{PREFIX}/pf{k}" for k in range(4)}
        await emu.wait_for(lambda: first <= set(emu.resources()), GUARD_S)
        # Warm up in the final configuration (and through every kind of bad file once), so the
        # baseline counts what that configuration holds once the daemon has reloaded a few times.
        for i in range(8):
            storm.put(storm.invalid(i))
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.05)
        storm.put(storm.final())
        proc.send_signal(signal.SIGHUP)
        await settled(emu, proc, storm.expected())
        baseline = await stable(proc.pid)

        t0 = time.monotonic()
        for i in range(WRITES):
            last = i == WRITES - 1
            storm.put(storm.final() if last else storm.valid(i) if i % 2 else storm.invalid(i // 2))
            proc.send_signal(signal.SIGHUP)
            # A write every 10 ms, on a schedule rather than after a fixed pause, so the storm lasts
            # about 2 s however long each write took.
            await asyncio.sleep(max(0.0, t0 + (i + 1) * STORM_S / WRITES - time.monotonic()))

        await settled(emu, proc, storm.expected())
        assert "kubelet.sock" in storm.sockets()
        # The storm's valid files were applied on the way (every one has pf0, which the file before
        # the storm had not): this end state was reached by reloading, not by ignoring the storm.
        assert emu.registrations(f"{PREFIX}/pf0") >= 2 and emu.stream_ended(f"{PREFIX}/pf0")
        fds, threads = await steady(proc.pid, baseline)
        assert fds == baseline[0] and threads <= baseline[1] + min(32, (os.cpu_count() or 1) + 4)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, GUARD_S)
        await emu.stop()
    assert code == 0
    text = storm.log.read_text(errors="replace")
    # Every bad file was refused in clear lines; none raised, none left a traceback or a dead task.
    assert "config reload refused" in text
    assert text.count('msg="config reloaded"') >= 3, text[-3000:]
    assert "exc=" not in text and "Traceback" not in text, text[-3000:]
    assert "config reload failed" not in text and "applying the reloaded config failed" not in text

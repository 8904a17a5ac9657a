"""Files and sockets are safe whatever the umask and whatever is planted (issue 12, section 4).

Every test runs the real writers against real directories: a real umask of 000, real symlinks planted
where densedev writes, and resource names no config loader would let through (the writers are the last
line before the filesystem, so they are tested on their own).
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers.devices import NET, dev, pool_of

from densedev import files
from densedev._proto import api_pb2
from densedev.alloc import cdi, devinfo, leftovers
from densedev.alloc.respond import AllocationSettings, PoolAllocator
from densedev.kubelet.feed import PoolFeed
from densedev.kubelet.server import PluginServer
from densedev.kubelet.sockets import socket_name_for
from densedev.model import PoolConfig, RequestError, Selector

VICTIM = b"precious\n"


@pytest.fixture
def umask_000() -> Iterator[None]:
    """The process umask set to 000 for the test (as an operator's shell or a container may have it)."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def net_allocator(tmp_path: Path, config: PoolConfig = NET, **kw: Any) -> PoolAllocator:
    s = AllocationSettings(
        cdi_dir=kw.get("cdi_dir", tmp_path / "run" / "cdi"),
        devinfo_dir=kw.get("devinfo_dir", tmp_path / "run" / "k8s" / "devinfo" / "dp"),
        dev_root=tmp_path / "dev",
    )
    return PoolAllocator(pool_of(config, [dev("0000:3b:00.2"), dev("0000:3b:00.3")]), s, lambda _id: True)


class Pool:
    """A minimal PoolService for a server: every Allocate succeeds."""

    def options(self) -> tuple[bool, bool]:
        return False, False

    def allocate(self, ids: Any) -> api_pb2.ContainerAllocateResponse:
        return api_pb2.ContainerAllocateResponse()

    def preferred(self, available: Any, must_include: Any, size: int) -> list[str]:
        return []

    def prestart(self, ids: Any) -> None:
        return None


# -- modes under umask 000 ------------------------------------------------------------------------


def test_specs_device_info_and_directories_get_explicit_modes_under_umask_000(
    tmp_path: Path, umask_000: None
) -> None:
    alloc = net_allocator(tmp_path)
    alloc.allocate(["0000:3b:00.2"])
    spec = tmp_path / "run" / "cdi" / "densedev-nvidia.com-mlnx_sriov_netdevice.json"
    info_dir = tmp_path / "run" / "k8s" / "devinfo" / "dp"
    info = info_dir / "nvidia.com-mlnx_sriov_netdevice-0000:3b:00.2-device.json"
    assert mode(spec) == files.FILE_MODE == 0o644
    assert mode(info) == 0o644
    # Every directory densedev created (the whole missing chain), none left 0777.
    for d in ("run", "run/cdi", "run/k8s", "run/k8s/devinfo", "run/k8s/devinfo/dp"):
        assert mode(tmp_path / d) == files.DIR_MODE == 0o755, d
    # The ownership record and any other file in those directories are 0644 as well.
    for d in (spec.parent, info.parent):
        for p in d.iterdir():
            assert mode(p) == 0o644, p


def test_an_unchanged_file_with_a_loose_mode_is_tightened(tmp_path: Path, umask_000: None) -> None:
    d = tmp_path / "cdi"
    d.mkdir()
    assert files.write_atomic(d, "densedev-x.json", b"{}\n")
    os.chmod(d / "densedev-x.json", 0o666)
    assert not files.write_atomic(d, "densedev-x.json", b"{}\n")  # same content: not rewritten
    assert mode(d / "densedev-x.json") == 0o644


async def test_pool_socket_is_0600_under_umask_000(sock_dir: Path, umask_000: None) -> None:
    feed = PoolFeed()
    feed.publish(b"")
    server = PluginServer("example.com/vf", sock_dir / "plugins" / "densedev-vf.sock", feed, Pool())
    await server.start()
    try:
        assert stat.S_ISSOCK(os.lstat(server.socket_path).st_mode)
        assert mode(server.socket_path) == files.SOCKET_MODE == 0o600
        assert mode(sock_dir / "plugins") == 0o755
        # Still served (root, the kubelet, may connect).
        async with grpc.aio.insecure_channel(f"unix:{server.socket_path}") as ch:
            call = ch.unary_unary(
                "/v1beta1.DevicePlugin/GetDevicePluginOptions",
                request_serializer=api_pb2.Empty.SerializeToString,
                response_deserializer=api_pb2.DevicePluginOptions.FromString,
            )
            await asyncio.wait_for(call(api_pb2.Empty()), 10)
    finally:
        await server.stop()
    # The process umask is untouched by the server (it was narrowed only around the bind).
    assert os.umask(0) == 0


# -- planted symlinks -----------------------------------------------------------------------------


def test_symlink_planted_at_the_old_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    info_dir = tmp_path / "devinfo"
    info_dir.mkdir()
    spec_name = "densedev-nvidia.com-mlnx_sriov_netdevice.json"
    info_name = "nvidia.com-mlnx_sriov_netdevice-0000:3b:00.2-device.json"
    # The temporary names the writer used to take: ".<name>.<pid>.tmp".
    for d, name in ((cdi_dir, spec_name), (info_dir, info_name), (info_dir, devinfo.OWNED_RECORD)):
        os.symlink(victim, d / f".{name}.{os.getpid()}.tmp")
    alloc = net_allocator(tmp_path, cdi_dir=cdi_dir, devinfo_dir=info_dir)
    alloc.allocate(["0000:3b:00.2"])
    assert victim.read_bytes() == VICTIM
    assert stat.S_ISREG(os.lstat(cdi_dir / spec_name).st_mode)
    assert stat.S_ISREG(os.lstat(info_dir / info_name).st_mode)
    assert b"mlnx_sriov_netdevice" in (cdi_dir / spec_name).read_bytes()


def test_symlink_planted_at_the_final_name_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    spec = cdi_dir / "densedev-nvidia.com-mlnx_sriov_netdevice.json"
    os.symlink(victim, spec)
    alloc = net_allocator(tmp_path, cdi_dir=cdi_dir)
    assert victim.read_bytes() == VICTIM
    assert stat.S_ISREG(os.lstat(spec).st_mode)
    # A symlink whose target holds exactly our bytes is replaced all the same (never "already there").
    data = spec.read_bytes()
    spec.unlink()
    victim.write_bytes(data)
    os.symlink(victim, spec)
    assert files.write_atomic(cdi_dir, spec.name, data)
    assert stat.S_ISREG(os.lstat(spec).st_mode)
    alloc.close(remove_cdi=True)
    assert victim.read_bytes() == data and not spec.exists()


def test_a_fifo_at_the_final_name_does_not_hang_the_writer(tmp_path: Path) -> None:
    d = tmp_path / "cdi"
    d.mkdir()
    os.mkfifo(d / "densedev-x.json")
    assert files.write_atomic(d, "densedev-x.json", b"{}\n")
    assert (d / "densedev-x.json").read_bytes() == b"{}\n"


def test_directories_replaced_by_symlinks_are_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Files in the target that look like ours: nothing may remove or overwrite them.
    decoy_spec = elsewhere / "densedev-nvidia.com-mlnx_sriov_netdevice.json"
    decoy_info = elsewhere / "nvidia.com-mlnx_sriov_netdevice-0000:3b:00.2-device.json"
    decoy_old = elsewhere / "densedev-example.com-gone.json"
    for p in (decoy_spec, decoy_info, decoy_old):
        p.write_bytes(VICTIM)
    cdi_dir = tmp_path / "cdi"
    info_dir = tmp_path / "devinfo"
    os.symlink(elsewhere, cdi_dir)
    os.symlink(elsewhere, info_dir)
    alloc = net_allocator(tmp_path, cdi_dir=cdi_dir, devinfo_dir=info_dir)
    with pytest.raises(RequestError, match=r"cannot write CDI spec") as e:
        alloc.allocate(["0000:3b:00.2"])
    assert e.value.kind == RequestError.PRECONDITION
    alloc.close(remove_cdi=True)
    assert leftovers.prune_cdi(cdi_dir, [], {}).removed == ()
    with pytest.raises(OSError):
        files.write_atomic(info_dir, "x-device.json", b"{}")
    # CDI off: the device-info directory alone is refused too.
    alloc = net_allocator(tmp_path, cdi_dir=None, devinfo_dir=info_dir)
    with pytest.raises(RequestError, match="cannot write device-info"):
        alloc.allocate(["0000:3b:00.2"])
    alloc.close()
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(
        p.name for p in (decoy_spec, decoy_info, decoy_old)
    )
    assert all(p.read_bytes() == VICTIM for p in (decoy_spec, decoy_info, decoy_old))


async def test_kubelet_dir_replaced_by_a_symlink_or_a_symlink_at_the_socket_is_refused(
    sock_dir: Path,
) -> None:
    victim = sock_dir / "victim"
    victim.write_bytes(VICTIM)
    real = sock_dir / "real"
    real.mkdir()
    (sock_dir / "plugins").symlink_to(real)
    os.symlink(victim, real / "densedev-vf.sock")

    feed = PoolFeed()
    feed.publish(b"")
    # The kubelet directory itself is a symlink: nothing is bound or removed through it.
    server = PluginServer("example.com/vf", sock_dir / "plugins" / "densedev-vf.sock", feed, Pool())
    with pytest.raises(OSError):
        await server.start()
    # The directory is real but a symlink sits at the socket's name: refused, not removed.
    server = PluginServer("example.com/vf", real / "densedev-vf.sock", feed, Pool())
    with pytest.raises(OSError):
        await server.start()
    assert victim.read_bytes() == VICTIM
    assert os.path.islink(real / "densedev-vf.sock")


# -- names from a config never leave their directory ----------------------------------------------

HOSTILE = [
    ("../../../escape", "x.com"),
    ("..", ".."),
    ("a/../../b", "../../etc"),
    ("name\nwith\x00ctl", "p.com\n"),
    ("/abs/path", "/"),
    ("x" * 300, "y" * 300),
]


@pytest.mark.parametrize(("name", "prefix"), HOSTILE)
def test_names_from_a_config_stay_inside_their_directories(
    tmp_path: Path, sock_dir: Path, name: str, prefix: str
) -> None:
    root = tmp_path / "root"
    cdi_dir, info_dir = root / "a" / "cdi", root / "b" / "devinfo"
    config = PoolConfig(name, prefix, selectors=(Selector(),))
    alloc = net_allocator(tmp_path, config=config, cdi_dir=cdi_dir, devinfo_dir=info_dir)
    try:
        alloc.allocate(["0000:3b:00.2"])
    except RequestError as e:
        # A name too long for one file name cannot be written: refused, nothing escapes.
        assert "File name too long" in e.message or "longer than" in e.message, e.message
    every = [p for p in tmp_path.rglob("*") if not p.is_dir()]
    for p in every:
        assert p.parent in (cdi_dir, info_dir), p
    for p in (*cdi_dir.glob("*"), *info_dir.glob("*")):
        assert os.path.realpath(p).startswith(str(tmp_path) + "/")
        assert not any(ord(c) < 0x20 for c in p.name), p
    sock = socket_name_for(f"{prefix}/{name}", sock_dir)
    assert files.check_name(sock) == sock and (sock_dir / sock).parent == sock_dir
    assert cdi.spec_file_name(f"{prefix}/{name}") == files.check_name(cdi.spec_file_name(f"{prefix}/{name}"))
    alloc.close(remove_cdi=True)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "a\nb", "a\x00b", "x" * 256])
def test_check_name_refuses_what_would_leave_or_break_a_directory(bad: str) -> None:
    with pytest.raises(files.UnsafeNameError):
        files.check_name(bad)
    with pytest.raises(files.UnsafeNameError):
        files.write_atomic(Path("/nonexistent-densedev"), bad, b"")

"""FUSE passthrough (docs/architecture.md#passthrough): large files of a posix store are read by
the kernel straight from the store's file, through real mounts. Every test checks that the
daemon saw no read of the file, and the kernel's rules for mixing opens (fuse/passthrough.h):
a writer of a file open through passthrough joins it with direct I/O (its writes reach the
daemon), a file replaced in the store while open is opened anew under another inode, and an
upgrade hands the table on.
Skips with one line where the kernel has no passthrough (Linux 6.9+) or the test is not root."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

import test_fleet as fleet
from test_transport import uring  # noqa: F401 (a fixture)
from cubefs_harness import (BINARY, CubeFactory, CubeMount, environment_problem,
                            run_command)

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")

BIG = 40 << 20  # over cache.stream_min_bytes (32 MiB): passed through


def kernel_has_passthrough() -> bool:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 9) and os.geteuid() == 0


needs_passthrough = pytest.mark.skipif(
    not kernel_has_passthrough(),
    reason="FUSE passthrough needs Linux 6.9+ and a daemon with CAP_SYS_ADMIN (root)")


def health(mount: CubeMount) -> dict:
    r = run_command([str(BINARY), "status", str(mount.mountpoint), "--json"], env=mount.env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def reads_served(mount: CubeMount) -> float:
    return mount.metrics().value("cubetorchfs_fuse_ops_total", op="read")


def write_big(path: Path, seed: int) -> str:
    data = hashlib.sha256(str(seed).encode()).digest() * (BIG // 32)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def sha_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    return root


@needs_passthrough
def test_a_large_file_is_read_by_the_kernel_without_the_daemon(cube: CubeFactory,
                                                               store: Path) -> None:
    sha = write_big(store / "shard.tar", 1)
    (store / "small.bin").write_bytes(b"s" * 5000)
    mount = cube.mount(store, {"fuse": {"passthrough": "on"}})
    assert health(mount)["passthrough"] is True
    before = reads_served(mount)
    assert sha_of(mount.path("shard.tar")) == sha
    # mmap goes to the store's file too.
    import mmap
    with open(mount.path("shard.tar"), "rb") as f, mmap.mmap(f.fileno(), 0,
                                                            prot=mmap.PROT_READ) as m:
        assert hashlib.sha256(m[:]).hexdigest() == sha
    assert reads_served(mount) == before, "the daemon served reads of a passthrough file"
    # A small file still goes through the daemon (and its cache).
    assert mount.path("small.bin").read_bytes() == b"s" * 5000
    assert reads_served(mount) > before
    m = mount.metrics()
    assert m.value("cubetorchfs_passthrough_opens_total") >= 2
    # The last close gives the registration back.
    assert m.value("cubetorchfs_passthrough_backing_files") == 0


@needs_passthrough
def test_writers_and_replaced_files_follow_the_kernels_rules(cube: CubeFactory,
                                                             store: Path) -> None:
    write_big(store / "ckpt.bin", 2)
    # passthrough auto; no attribute or entry caching, so that the replacement is seen at once.
    mount = cube.mount(store, {"fuse": {"attr_timeout_s": 0, "entry_timeout_s": 0}})
    reader = open(mount.path("ckpt.bin"), "rb")
    try:
        reader.read(4096)
        # A second reader shares the registration.
        with open(mount.path("ckpt.bin"), "rb") as second:
            assert len(second.read(1 << 20)) == 1 << 20
        assert mount.metrics().value("cubetorchfs_passthrough_backing_files") == 1
        # A writer joins the reader (direct I/O: its writes go through the daemon's write
        # path, which writes the store's file in place).
        before = mount.metrics().value("cubetorchfs_fuse_ops_total", op="write")
        with open(mount.path("ckpt.bin"), "r+b") as w:
            w.write(b"w")
        assert (store / "ckpt.bin").read_bytes()[:1] == b"w"
        assert mount.metrics().value("cubetorchfs_fuse_ops_total", op="write") > before
        # Replaced in the store: the new file is opened anew (another inode), never read from
        # the old registration.
        new_sha = write_big(store / "ckpt.tmp", 3)
        os.rename(store / "ckpt.tmp", store / "ckpt.bin")
        assert sha_of(mount.path("ckpt.bin")) == new_sha
        # The open reader goes on reading its own file.
        assert len(reader.read(1 << 20)) == 1 << 20
    finally:
        reader.close()
    # Once the old opens are closed, the new file still opens and reads whole, and can be
    # written.
    assert sha_of(mount.path("ckpt.bin")) == new_sha
    with open(mount.path("ckpt.bin"), "r+b") as w:
        w.write(b"x")
    assert (store / "ckpt.bin").read_bytes()[:1] == b"x"


@needs_passthrough
def test_passthrough_off_reads_through_the_daemon(cube: CubeFactory, store: Path) -> None:
    sha = write_big(store / "shard.tar", 4)
    mount = cube.mount(store, {"fuse": {"passthrough": "off"}})
    assert health(mount)["passthrough"] is False
    before = reads_served(mount)
    assert sha_of(mount.path("shard.tar")) == sha
    assert reads_served(mount) > before


@needs_passthrough
def test_an_upgrade_hands_the_passthrough_opens_on(cube: CubeFactory, store: Path) -> None:
    sha = write_big(store / "shard.tar", 5)
    mount = cube.mount(store)
    reader = open(mount.path("shard.tar"), "rb")
    try:
        first = reader.read(1 << 20)
        r = fleet.upgrade(mount)
        assert r.returncode == 0 and "upgraded" in r.stdout, (r.stdout, r.stderr)
        # The new process knows the open: another open shares its registration (a new one
        # would make the kernel fail it), and so does a writer (with direct I/O).
        with open(mount.path("shard.tar"), "rb") as second:
            assert hashlib.sha256(first + second.read()[1 << 20:]).hexdigest() == sha
        with open(mount.path("shard.tar"), "r+b") as w:
            assert len(w.read(4096)) == 4096
        rest = reader.read()
        assert hashlib.sha256(first + rest).hexdigest() == sha
    finally:
        reader.close()
    # The close of the handle the old process opened gives the registration back.
    assert mount.metrics().value("cubetorchfs_passthrough_backing_files") == 0
    with open(mount.path("shard.tar"), "r+b") as w:
        w.write(b"y")


@needs_passthrough
def test_passthrough_on_mounts_where_the_kernel_offers_it(cube: CubeFactory, store: Path) -> None:
    """`on` mounts and reports passthrough where the kernel offers it to a root daemon. (Its
    refusal, exit 2 with one line, needs a kernel without passthrough or a daemon without
    CAP_SYS_ADMIN that can still mount: neither can be made on this machine.)"""
    mount = cube.mount(store, {"fuse": {"passthrough": "on"}})
    assert health(mount)["passthrough"] is True


@needs_passthrough
def test_passthrough_on_io_uring(cube: CubeFactory, store: Path, uring: None) -> None:
    """The open reply that names the registration goes to an io_uring entry just as well."""
    sha = write_big(store / "shard.tar", 6)
    mount = cube.mount(store, {"fuse": {"io_uring": "on", "passthrough": "on"}})
    h = health(mount)
    assert (h["transport"], h["passthrough"]) == ("io_uring", True)
    before = reads_served(mount)
    assert sha_of(mount.path("shard.tar")) == sha
    assert reads_served(mount) == before

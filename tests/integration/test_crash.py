"""What a kill -9 of the daemon leaves the processes reading its mount. The daemon keeps its
inode records in a memfd its supervisor holds; the next daemon adopts them (fs/inode_table.h),
so every inode number the kernel holds goes on naming its file: descriptors opened before the
crash read on and fstat, directories opened before list on, and the kernel's cached pages of a
file stay good (reading them again asks no daemon)."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
import signal
from pathlib import Path

import pytest

from cubefs_harness import (BINARY, CubeFactory, CubeMount, environment_problem, run_command,
                            wait_until)

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")

PROFILES = ["", "ai_prefetch"]


def log_text(mount: CubeMount) -> str:
    return "\n".join(p.read_text(errors="replace") for p in mount.workdir.rglob("*.log"))


def kill_and_wait(mount: CubeMount) -> int:
    pid = mount.read_control()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: mount.read_control().get("pid") not in (None, pid), 30), \
        "no new daemon after kill -9"
    return mount.read_control()["pid"]


def content(i: int, size: int) -> bytes:
    return bytes((i * 31 + k * 7) % 251 for k in range(256)) * (size // 256)


@pytest.mark.parametrize("profile", PROFILES)
def test_descriptors_opened_before_a_kill_9_read_on(cube: CubeFactory, tmp_path: Path,
                                                    profile: str) -> None:
    src = tmp_path / "src"
    names = [f"class{c}/{'a-file-name-longer-than-23-bytes-' if c else 'f'}{i}.bin"
             for c in range(2) for i in range(4)]
    want = {}
    for i, name in enumerate(names):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        want[name] = content(i, 1024 * 1024 + 256 * i)
        (src / name).write_bytes(want[name])
    mount = cube.mount(src, {"profile": profile})
    held = {name: open(mount.path(name), "rb") for name in names}  # noqa: SIM115
    listing = os.scandir(mount.path("class1"))
    try:
        halves = {name: f.read(len(want[name]) // 2) for name, f in held.items()}
        first = next(listing).name
        before = {name: os.fstat(f.fileno()) for name, f in held.items()}

        kill_and_wait(mount)
        kill_and_wait(mount)  # a second crash, of the daemon that adopted the records

        for name, f in held.items():
            # The kernel's pages go, so every read below asks the new daemon.
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        for name, f in held.items():
            st = os.fstat(f.fileno())
            assert (st.st_ino, st.st_size) == (before[name].st_ino, before[name].st_size), name
            got = halves[name] + f.read()
            assert got == want[name], f"{name}: the descriptor opened before the crash"
            f.seek(0)
            assert f.read(4096) == want[name][:4096], name
        rest = sorted([first] + [e.name for e in listing])
        assert rest == sorted(Path(n).name for n in names if n.startswith("class1/"))
        # The same names, looked up again, are the same inodes.
        for name, f in held.items():
            assert os.stat(mount.path(name)).st_ino == os.fstat(f.fileno()).st_ino, name
            assert mount.path(name).read_bytes() == want[name], name
    finally:
        listing.close()
        for f in held.values():
            f.close()
    log = log_text(mount)
    assert log.count("inode records of the process before in") == 2, log[-4000:]
    assert "ESTALE" not in log


def test_pages_the_kernel_held_before_a_kill_9_are_read_with_no_request(
        cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    want = {f"f{i}.bin": content(i, 64 * 1024) for i in range(20)}
    for name, data in want.items():
        (src / name).write_bytes(data)
    # ai_prefetch keeps the kernel's cache of a file across opens of the same version.
    mount = cube.mount(src, {"profile": "ai_prefetch"})
    for name, data in want.items():
        assert mount.path(name).read_bytes() == data
    kill_and_wait(mount)
    # The next daemon has either adopted the records, or (without them) dropped the kernel's
    # names of the files, whose pages then go with their old inodes.
    assert wait_until(lambda: "inode records of the process before" in log_text(mount)
                      or "names under the root listed" in log_text(mount), 30)
    reads_before = mount.metrics().value("cubetorchfs_fuse_ops_total", op="read")
    for name, data in want.items():
        assert mount.path(name).read_bytes() == data
    reads_after = mount.metrics().value("cubetorchfs_fuse_ops_total", op="read")
    assert reads_after == reads_before, "the kernel's pages were dropped by the restart"


@pytest.mark.parametrize("profile", PROFILES)
def test_a_writer_whose_unflushed_bytes_died_with_the_daemon_is_told(
        cube: CubeFactory, tmp_path: Path, profile: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "other.bin").write_bytes(b"o" * 4096)
    mount = cube.mount(src, {"profile": profile})
    reader = open(mount.path("other.bin"), "rb")  # noqa: SIM115
    fd = os.open(mount.path("w.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        assert os.write(fd, b"a" * (1 << 20)) == 1 << 20  # reaches the daemon, not the store
        kill_and_wait(mount)
        # Its first megabyte died with the daemon: a later write, fsync or close must not
        # report success for a file with a hole where those bytes were.
        with pytest.raises(OSError) as failed:
            os.write(fd, b"b" * (1 << 20))
            os.fsync(fd)
            os.close(fd)
            fd = -1
        assert failed.value.errno in (errno.ESTALE, errno.EIO), failed.value
        # A file only read goes on.
        assert reader.read() == b"o" * 4096
    finally:
        reader.close()
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    # Written again from the start, it reaches the store whole.
    mount.path("w.bin").write_bytes(b"c" * 1000)
    assert (src / "w.bin").read_bytes() == b"c" * 1000


@pytest.mark.parametrize("profile", PROFILES)
def test_kills_during_renames_and_creates_leave_every_name_reading_its_own_bytes(
        cube: CubeFactory, tmp_path: Path, profile: str) -> None:
    """The records being changed when the daemon dies are the ones a wrong adoption would get
    wrong: a torn name, a parent half moved. Three kill -9s land in a stream of renames,
    creates and unlinks through the mount; afterwards every name the store has reads, through
    the mount, exactly the store's bytes, and the mount lists what the store lists."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    for i in range(200):
        (src / "a" / f"f{i:03d}").write_bytes(f"id{i:03d}".encode() * 64)
    mount = cube.mount(src, {"profile": profile})
    stop = threading.Event()
    done = {"ops": 0}

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            i = rng.randrange(200)
            names = [mount.path(f"{d}/{p}{i:03d}") for d in ("a", "b") for p in ("f", "g")]
            try:
                op = rng.randrange(4)
                if op == 0:  # a rename, across directories too
                    src_p, dst_p = rng.sample(names, 2)
                    os.rename(src_p, dst_p)
                elif op == 1:  # a new file of its own
                    name = mount.path(f"b/new-{seed}-{rng.randrange(50):02d}-a-long-name-x")
                    name.write_bytes(name.name.encode() * 8)
                elif op == 2:
                    os.unlink(mount.path(f"b/new-{seed}-{rng.randrange(50):02d}-a-long-name-x"))
                else:
                    os.stat(rng.choice(names))
                done["ops"] += 1
            except OSError:
                pass  # absent names, and the requests the dying daemon had taken

    workers = [threading.Thread(target=churn, args=(k,), daemon=True) for k in range(3)]
    for w in workers:
        w.start()
    try:
        for _ in range(3):
            time.sleep(0.7)
            kill_and_wait(mount)
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert done["ops"] > 100, done
    for d in ("a", "b"):
        assert sorted(os.listdir(mount.path(d))) == sorted(os.listdir(src / d)), d
        for name in os.listdir(src / d):
            want = (src / d / name).read_bytes()
            assert mount.path(f"{d}/{name}").read_bytes() == want, f"{d}/{name}"
    # Every file is where one of the renames left it, with its own bytes.
    ids = sorted((p.read_bytes()[:5] for d in ("a", "b") for p in (src / d).iterdir()
                  if not p.name.startswith("new-")))
    assert ids == sorted(f"id{i:03d}".encode() for i in range(200))


def store_reads_reading_all(mount: CubeMount, want: dict[str, bytes]) -> float:
    """Reads every file of `want` through the mount, byte-exact; the store reads it took."""
    before = mount.metrics().value("cubetorchfs_backend_requests_total", op="read")
    for name, data in want.items():
        assert mount.path(name).read_bytes() == data, name
    return mount.metrics().value("cubetorchfs_backend_requests_total", op="read") - before


def test_the_ram_cache_outlives_a_kill_9_and_an_upgrade(cube: CubeFactory,
                                                       tmp_path: Path) -> None:
    """The default profile keeps what it fetched in the daemon's RAM cache only (no page-cache
    stores). Its buffers live in a memfd the supervisor holds (cache/cache_arena.h): after two
    kill -9s the next daemon serves every file again with no read reaching the store, and
    never the bytes of a version the store no longer has (a file changed in the store, a file
    written through the mount). An upgrade keeps it as well."""
    src = tmp_path / "src"
    src.mkdir()
    sizes = [1500, 3000, 64 * 1024, 300 * 1024, 5 * 1024 * 1024 + 77]  # small, page-sized, chunked
    want = {f"d{i % 3}/f{i}.bin": content(i, sizes[i % len(sizes)] // 256 * 256 or 256)
            for i in range(40)}
    for name, data in want.items():
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_bytes(data)
    # All of it fits the LRU (half the budget; the window has the other half).
    mount = cube.mount(src, {"profile": "", "cache": {"memory_bytes": "256MiB"}})
    for name, data in want.items():
        assert mount.path(name).read_bytes() == data, name
    # Changed in the store behind the daemon's back (same size, another mtime), and written
    # through the mount: the cached bytes of both are of a version gone.
    changed, written = "d0/f0.bin", "d1/f1.bin"
    want[changed] = bytes(reversed(want[changed]))
    (src / changed).write_bytes(want[changed])
    os.utime(src / changed, ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
    want[written] = b"w" * 1000
    mount.path(written).write_bytes(want[written])

    kill_and_wait(mount)
    kill_and_wait(mount)  # a second crash, of the daemon that adopted the cache
    time.sleep(1.2)  # fuse.attr_timeout_s: the change in the store is seen from now on
    assert wait_until(lambda: log_text(mount).count("cached again") == 2, 30), \
        log_text(mount)[-3000:]
    reads = store_reads_reading_all(mount, want)
    log = log_text(mount)
    # The changed file alone is read from the store (the written one is in the cache at its
    # new version); every other file, and every chunk of the large ones, comes from RAM.
    assert reads <= 2, (reads, log[-3000:])
    assert log.count("cached chunks") == 2, log[-4000:]

    # An upgrade hands the cache to the next binary too (this one: the same form).
    up = run_command([str(BINARY), "upgrade", str(mount.mountpoint), "--timeout", "60"],
                     timeout=90, env=mount.env())
    assert up.returncode == 0, up.stderr
    # (Cached again by a thread of its own while the mount serves: a few microseconds here.)
    assert wait_until(lambda: log_text(mount).count("cached again") == 3, 30), \
        log_text(mount)[-3000:]
    reads = store_reads_reading_all(mount, want)
    assert reads == 0, (reads, log_text(mount)[-3000:])
    assert "after the upgrade, found" in log_text(mount)

"""The write path through a real mount over the posix backend: checkpoints, the durability
contract (fsync, close, kill -9), POSIX semantics against a plain directory, backend failures.

Every test that mounts runs under both the default profile and `ai_prefetch` (where the kernel
skips open/release: FUSE no_open), since the two reach the daemon differently.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from cubefs_harness import (CubeFactory, CubeMount, bounded, environment_problem, errno_of,
                            run_command, wait_until)

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")

PROFILES = ["", "ai_prefetch"]
MIB = 1 << 20


def mount_rw(cube: CubeFactory, root: Path, profile: str,
             extra: Optional[dict[str, Any]] = None) -> CubeMount:
    overrides: dict[str, Any] = {"profile": profile}
    if extra:
        overrides.update(extra)
    return cube.mount(root, overrides)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_checkpoint(directory: Path, shards: int, shard_bytes: int, seed: int) -> dict[str, bytes]:
    """torch.distributed.checkpoint's FileSystemWriter pattern: `shards` files written by 4
    threads (each fsynced), then .metadata.tmp written, fsynced and renamed to .metadata, and
    the directory fsynced. Returns what was written, by name."""
    directory.mkdir(parents=True, exist_ok=True)
    want: dict[str, bytes] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(t, shards, 4):
                name = f"__{i}_0.distcp"
                data = hashlib.shake_256(f"{seed}:{i}".encode()).digest(shard_bytes)
                with open(directory / name, "wb") as f:
                    for off in range(0, len(data), 3 * MIB + 17):  # odd-sized writes
                        f.write(data[off:off + 3 * MIB + 17])
                    f.flush()
                    os.fsync(f.fileno())
                with lock:
                    want[name] = data
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    meta = repr(sorted((k, sha(v)) for k, v in want.items())).encode()
    with open(directory / ".metadata.tmp", "wb") as f:
        f.write(meta)
        f.flush()
        os.fsync(f.fileno())
    os.rename(directory / ".metadata.tmp", directory / ".metadata")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    want[".metadata"] = meta
    return want


def read_tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("profile", PROFILES)
def test_checkpoint_pattern_byte_exact(cube: CubeFactory, tmp_path: Path, profile: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    mount = mount_rw(cube, root, profile)
    want = bounded(write_checkpoint, mount.path("ckpt/step_100"), 16, 4 * MIB, 1, timeout=120,
                   what="write the checkpoint")
    assert sum(len(v) for k, v in want.items() if k != ".metadata") == 64 * MIB
    assert read_tree(root / "ckpt/step_100") == want, "direct from the backend"
    assert bounded(read_tree, mount.path("ckpt/step_100"), what="read back") == want
    assert not (root / "ckpt/step_100/.metadata.tmp").exists()
    # A fresh mount (empty caches, fresh kernel state) sees the same bytes.
    mount.cleanup()
    again = mount_rw(cube, root, profile)
    assert bounded(read_tree, again.path("ckpt/step_100"), what="read after remount") == want


TORCH_SCRIPT = r"""
import sys, torch
path, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(3)
state = {"w": torch.randn(512, 1024), "b": torch.arange(1000, dtype=torch.int64),
         "nested": {"h": torch.randn(33, 7, dtype=torch.float64)}}
if mode == "save":
    torch.save(state, path)
else:
    got = torch.load(path)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert torch.equal(got["nested"]["h"], state["nested"]["h"])
print("ok")
"""


@pytest.mark.parametrize("profile", PROFILES)
def test_torch_save_and_load_through_the_mount(cube: CubeFactory, tmp_path: Path,
                                               profile: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    mount = mount_rw(cube, root, profile)
    script = tmp_path / "t.py"
    script.write_text(TORCH_SCRIPT)
    for mode in ("save", "load"):
        r = run_command(["/usr/bin/python3", str(script), str(mount.path("model.pt")), mode],
                        timeout=120)
        assert r.returncode == 0 and "ok" in r.stdout, (mode, r.stderr[-2000:])
    # The same bytes direct from the backend, loadable there too.
    r = run_command(["/usr/bin/python3", str(script), str(root / "model.pt"), "load"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# --------------------------------------------------------------------------- durability


FSYNC_WRITER = r"""
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
data = bytes((i * 7 + 3) % 251 for i in range(256)) * (size // 256)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, data)
os.fsync(fd)
print("fsynced", flush=True)
sys.stdin.read()  # holds the file open until killed
"""


@pytest.mark.parametrize("profile", PROFILES)
def test_kill_9_after_fsync_loses_nothing(cube: CubeFactory, tmp_path: Path, profile: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    mount = mount_rw(cube, root, profile)
    size = 8 * MIB
    want = bytes((i * 7 + 3) % 251 for i in range(256)) * (size // 256)
    script = tmp_path / "w.py"
    script.write_text(FSYNC_WRITER)
    writer = subprocess.Popen([sys.executable, str(script), str(mount.path("shard.bin")),
                               str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        line = bounded(writer.stdout.readline, timeout=60, what="writer fsync")  # type: ignore
        assert line.strip() == "fsynced"
        pid = mount.read_control()["pid"]
        os.kill(pid, signal.SIGKILL)  # the daemon dies with the file still open
        # Its supervisor starts another on the same mount (daemon/supervisor.h).
        assert wait_until(lambda: mount.read_control().get("pid") not in (None, pid), 15)
    finally:
        writer.kill()
        writer.wait(timeout=10)
    assert (root / "shard.bin").read_bytes() == want, "fsynced bytes missing from the backend"
    # Read through the same mount, served by the new daemon: nothing to remount.
    assert bounded(mount.path("shard.bin").read_bytes, what="read after the restart") == want


@pytest.mark.parametrize("profile", PROFILES)
def test_close_makes_data_visible_in_the_backend(cube: CubeFactory, tmp_path: Path,
                                                 profile: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    mount = mount_rw(cube, root, profile)
    data = os.urandom(3 * MIB + 5)
    mount.path("c.bin").write_bytes(data)  # open, write, close: no fsync
    assert (root / "c.bin").read_bytes() == data


# --------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("profile", PROFILES)
def test_concurrent_writers_and_an_overwrite_seen_by_a_reader(cube: CubeFactory, tmp_path: Path,
                                                              profile: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / "old.bin").write_bytes(b"A" * 100_000)
    mount = mount_rw(cube, root, profile)
    # The reader caches the old bytes first (daemon RAM cache and kernel page cache).
    assert mount.path("old.bin").read_bytes() == b"A" * 100_000
    want = {f"w{i}.bin": os.urandom(1 * MIB + i * 4097) for i in range(8)}

    def put(name: str) -> None:
        with open(mount.path(name), "wb") as f:
            for off in range(0, len(want[name]), 65536):
                f.write(want[name][off:off + 65536])

    threads = [threading.Thread(target=put, args=(n,)) for n in want]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for name, data in want.items():
        assert mount.path(name).read_bytes() == data, name
        assert (root / name).read_bytes() == data, name
    # Overwrite in place with the same size: a reader must get the new bytes.
    with open(mount.path("old.bin"), "r+b") as f:
        f.write(b"B" * 100_000)
    assert mount.path("old.bin").read_bytes() == b"B" * 100_000
    assert (root / "old.bin").read_bytes() == b"B" * 100_000


@pytest.mark.parametrize("profile", PROFILES)
def test_truncate_append_sparse_rename_unlink(cube: CubeFactory, tmp_path: Path,
                                              profile: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / "target").write_bytes(b"old target")
    mount = mount_rw(cube, root, profile)
    m = mount.mountpoint

    def both(rel: str) -> tuple[bytes, bytes]:
        return (m / rel).read_bytes(), (root / rel).read_bytes()

    (m / "f").write_bytes(b"0123456789")
    os.truncate(m / "f", 4)
    assert both("f") == (b"0123", b"0123")
    os.truncate(m / "f", 8)
    assert both("f") == (b"0123\0\0\0\0",) * 2
    with open(m / "f", "ab") as f:
        f.write(b"tail")
    assert both("f") == (b"0123\0\0\0\0tail",) * 2
    with open(m / "f", "wb") as f:  # O_TRUNC
        f.write(b"new")
    assert both("f") == (b"new", b"new")
    with open(m / "sparse", "wb") as f:
        f.seek(5 * MIB)
        f.write(b"end")
    assert os.stat(m / "sparse").st_size == 5 * MIB + 3
    assert both("sparse") == (b"\0" * (5 * MIB) + b"end",) * 2
    os.rename(m / "f", m / "target")  # over an existing file
    assert both("target") == (b"new", b"new")
    assert not (m / "f").exists() and not (root / "f").exists()
    # Unlink of an open file: the descriptor keeps working, the name is gone.
    fd = os.open(m / "target", os.O_RDWR)
    try:
        os.unlink(m / "target")
        assert not (m / "target").exists() and not (root / "target").exists()
        assert os.pwrite(fd, b"XY", 0) == 2
        assert os.pread(fd, 10, 0) == b"XYw"
    finally:
        os.close(fd)
    assert sorted(os.listdir(m)) == ["sparse"]


@pytest.mark.parametrize("profile", PROFILES)
def test_a_descriptor_of_a_file_renamed_over_keeps_the_old_file(cube: CubeFactory,
                                                                  tmp_path: Path,
                                                                  profile: str) -> None:
    """The replaced file stays what its open descriptors read and write (as after unlink):
    nothing written through them reaches the file that has the name now."""
    root = tmp_path / "store"
    root.mkdir()
    (root / "meta").write_bytes(b"old metadata")
    mount = mount_rw(cube, root, profile)
    m = mount.mountpoint
    fd = os.open(m / "meta", os.O_RDWR)
    try:
        assert os.pread(fd, 3, 0) == b"old"
        (m / "meta.tmp").write_bytes(b"new metadata")
        os.rename(m / "meta.tmp", m / "meta")
        assert (root / "meta").read_bytes() == b"new metadata"
        assert os.pwrite(fd, b"OLD", 0) == 3
        os.ftruncate(fd, 5)
        os.fsync(fd)
        assert os.pread(fd, 20, 0) == b"OLD m"
    finally:
        os.close(fd)
    assert (root / "meta").read_bytes() == b"new metadata"
    assert (m / "meta").read_bytes() == b"new metadata"
    assert sorted(os.listdir(root)) == ["meta"]


# --------------------------------------------------------------------------- errno suite


def posix_cases(base: Path) -> dict[str, Callable[[], Any]]:
    """Common misuse; each case runs in a fresh copy of the same small tree under `base`."""
    return {
        "mkdir existing": lambda: os.mkdir(base / "dir"),
        "mkdir under file": lambda: os.mkdir(base / "file/x"),
        "mkdir missing parent": lambda: os.mkdir(base / "nope/x"),
        "create excl existing": lambda: os.open(base / "file", os.O_CREAT | os.O_EXCL | os.O_WRONLY),
        "open missing": lambda: os.open(base / "missing", os.O_WRONLY),
        "open dir for write": lambda: os.open(base / "dir", os.O_WRONLY),
        "open under file": lambda: os.open(base / "file/x", os.O_CREAT | os.O_WRONLY),
        "rmdir nonempty": lambda: os.rmdir(base / "dir"),
        "rmdir file": lambda: os.rmdir(base / "file"),
        "rmdir missing": lambda: os.rmdir(base / "missing"),
        "unlink dir": lambda: os.unlink(base / "dir"),
        "unlink missing": lambda: os.unlink(base / "missing"),
        "rename missing": lambda: os.rename(base / "missing", base / "x"),
        "rename file over dir": lambda: os.rename(base / "file", base / "dir"),
        "rename dir over file": lambda: os.rename(base / "empty", base / "file"),
        "rename dir over nonempty dir": lambda: os.rename(base / "empty", base / "dir"),
        "rename dir into itself": lambda: os.rename(base / "dir", base / "dir/sub/x"),
        "truncate dir": lambda: os.truncate(base / "dir", 0),
        "link dir": lambda: os.link(base / "dir", base / "dirlink"),
        "symlink existing": lambda: os.symlink("t", base / "file"),
        "rename ok": lambda: os.rename(base / "file", base / "renamed"),
        "rename dir ok": lambda: os.rename(base / "dir", base / "dir2"),
        "rmdir empty ok": lambda: os.rmdir(base / "empty"),
        "rename over empty dir ok": lambda: os.rename(base / "dir/sub", base / "empty"),
        "link ok": lambda: os.link(base / "file", base / "hard"),
        "symlink ok": lambda: os.symlink("file", base / "sym"),
    }


def make_tree(base: Path) -> None:
    (base / "dir/sub").mkdir(parents=True)
    (base / "dir/sub/f").write_bytes(b"x")
    (base / "empty").mkdir()
    (base / "file").write_bytes(b"data")


def outcome(fn: Callable[[], Any]) -> str:
    try:
        r = fn()
        if isinstance(r, int):
            os.close(r)
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))


@pytest.mark.parametrize("profile", PROFILES)
def test_posix_errno_suite_matches_a_plain_directory(cube: CubeFactory, tmp_path: Path,
                                                     profile: str) -> None:
    plain = tmp_path / "plain"
    store = tmp_path / "store"
    plain.mkdir()
    store.mkdir()
    mount = mount_rw(cube, store, profile)
    names = list(posix_cases(plain))
    expected, got = {}, {}
    for i, name in enumerate(names):
        for base, out in ((plain / f"c{i}", expected), (mount.path(f"c{i}"), got)):
            make_tree(base)
            out[name] = bounded(outcome, posix_cases(base)[name], timeout=20, what=name)
    mismatched = {n: (expected[n], got[n]) for n in names if expected[n] != got[n]}
    assert not mismatched, f"(plain directory, mount): {mismatched}"
    # and the trees the cases left behind are the same
    assert sorted(str(p.relative_to(plain)) for p in plain.rglob("*")) == \
        sorted(str(p.relative_to(store)) for p in store.rglob("*"))


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("profile", PROFILES)
def test_injected_backend_errors_surface_and_nothing_false_is_reported(
        cube: CubeFactory, tmp_path: Path, profile: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    mount = mount_rw(cube, root, profile,
                     {"backend": {"inject": {"error_rate": 0.2, "seed": 11}}})
    reported: dict[str, bytes] = {}
    failures: dict[str, int] = {}
    for i in range(40):
        name = f"f{i}.bin"
        data = os.urandom(200_000 + i)
        try:
            fd = os.open(mount.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            reported[name] = data
        except OSError as exc:
            failures[name] = exc.errno or 0
    assert failures, "an error rate of 0.2 over 40 files must fail some"
    assert set(failures.values()) <= {errno.EIO}, failures
    assert reported, "and let some through"
    for name, data in reported.items():
        assert (root / name).read_bytes() == data, f"{name} reported written but not in the store"


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    target = tmp_path / "tiny"
    target.mkdir()
    r = run_command(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)])
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield target
    finally:
        run_command(["umount", "-l", str(target)])


@pytest.mark.parametrize("profile", PROFILES)
def test_full_backend_gives_enospc(cube: CubeFactory, tiny_tmpfs: Path, profile: str) -> None:
    mount = mount_rw(cube, tiny_tmpfs, profile)
    data = os.urandom(3 * MIB)
    written = 0
    err = None
    fd = os.open(mount.path("big.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while written < len(data):
            written += os.write(fd, data[written:written + 128 * 1024])
        os.fsync(fd)
    except OSError as exc:
        err = exc.errno
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    assert err == errno.ENOSPC, f"expected ENOSPC, got {err} after {written} bytes"
    stored = (tiny_tmpfs / "big.bin").read_bytes()
    assert stored == data[:len(stored)]
    assert len(stored) == written, "bytes reported written are missing (or extra)"
    # The mount keeps working once there is room again. The daemon holds an unlinked file
    # open until the kernel forgets its inode (POSIX: open descriptors keep working), which
    # follows the unlink of a closed file at once, but on another FUSE thread.
    os.unlink(mount.path("big.bin"))
    assert wait_until(lambda: os.statvfs(tiny_tmpfs).f_bfree * os.statvfs(tiny_tmpfs).f_frsize
                      > 512 * 1024, 10), "the unlinked file's space was never released"
    mount.path("small").write_bytes(b"fits")
    assert (tiny_tmpfs / "small").read_bytes() == b"fits"


@pytest.mark.parametrize("profile", PROFILES)
def test_paths_longer_than_path_max_work(cube: CubeFactory, tmp_path: Path, profile: str) -> None:
    """A tree deeper than PATH_MAX, built and used with paths relative to open directories as
    the kernel allows: the daemon's store paths outgrow PATH_MAX and must still work."""
    src = tmp_path / "src"
    src.mkdir()
    mount = mount_rw(cube, src, profile)
    name = "d" * 250
    fd = os.open(mount.path(), os.O_RDONLY | os.O_DIRECTORY)
    depth = 0
    try:
        for depth in range(1, 25):  # 24 x 251 bytes: about 6 KB below the mount
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        leaf = os.open("leaf", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
        os.write(leaf, b"deep bytes")
        os.fsync(leaf)
        os.close(leaf)
        assert os.stat("leaf", dir_fd=fd).st_size == 10
        r = os.open("leaf", os.O_RDONLY, dir_fd=fd)
        assert os.read(r, 64) == b"deep bytes"
        os.close(r)
        os.rename("leaf", "leaf2", src_dir_fd=fd, dst_dir_fd=fd)
        assert os.stat("leaf2", dir_fd=fd).st_size == 10
        os.unlink("leaf2", dir_fd=fd)
        with pytest.raises(FileNotFoundError):
            os.stat("leaf2", dir_fd=fd)
    finally:
        os.close(fd)
    # The store holds the same tree, deeper than PATH_MAX.
    assert len(str(src)) + depth * (len(name) + 1) > 4096
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        assert os.listdir(fd) == []
    finally:
        os.close(fd)


def test_open_and_stat_after_reads_ask_the_store_nothing(cube: CubeFactory, tmp_path: Path) -> None:
    """On a writable mount every read invalidates the file's atime in the kernel, and the next
    fstat (Python's open() makes one) reaches the daemon: within attr_timeout_s the daemon
    answers from the attributes it holds, so a second pass over read files costs no store
    request at all."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(30):
        (src / "d" / f"f{i:02d}").write_bytes(os.urandom(5000))
    mount = mount_rw(cube, src, "ai_prefetch")
    files = [mount.path(f"d/f{i:02d}") for i in range(30)]
    for f in files:  # first pass: lookups, reads from the store
        assert len(f.read_bytes()) == 5000

    def store_requests() -> float:
        m = mount.metrics()
        return m.value("cubetorchfs_backend_requests_total")  # every op, every status
    before = store_requests()
    for _ in range(3):  # further passes: open (fstat), read, fstat, stat
        for f in files:
            with open(f, "rb") as fh:
                assert len(fh.read()) == 5000
                assert os.fstat(fh.fileno()).st_size == 5000
            assert os.stat(f).st_size == 5000
    assert store_requests() == before


def test_directories_listed_ahead_show_changes_made_through_the_mount(cube: CubeFactory,
                                                                     tmp_path: Path) -> None:
    # Under ai_prefetch, listing a directory with subdirectories lists them ahead of the
    # kernel (fuse.list_ahead). A listing made before a change through the mount is not
    # handed out: every change is seen by the next readdir.
    root = tmp_path / "tree"
    for c in range(8):
        (root / f"class_{c}").mkdir(parents=True)
        (root / f"class_{c}" / "a.jpg").write_bytes(b"a")
    m = mount_rw(cube, root, "ai_prefetch")
    assert sorted(os.listdir(m.mountpoint)) == [f"class_{c}" for c in range(8)]
    assert wait_until(
        lambda: m.metrics().value("cubetorchfs_list_ahead_total", outcome="listed") >= 8,
        timeout=30)
    # Changes of every kind, in directories already listed ahead.
    (m.mountpoint / "class_1" / "new.jpg").write_bytes(b"n")
    os.mkdir(m.mountpoint / "class_2" / "sub")
    os.unlink(m.mountpoint / "class_3" / "a.jpg")
    os.rename(m.mountpoint / "class_4" / "a.jpg", m.mountpoint / "class_5" / "b.jpg")
    expected = {0: ["a.jpg"], 1: ["a.jpg", "new.jpg"], 2: ["a.jpg", "sub"], 3: [],
                4: [], 5: ["a.jpg", "b.jpg"], 6: ["a.jpg"], 7: ["a.jpg"]}
    for c, names in expected.items():
        assert sorted(os.listdir(m.mountpoint / f"class_{c}")) == names, c
    metrics = m.metrics()
    assert metrics.value("cubetorchfs_list_ahead_total", outcome="stale") >= 1, metrics.text
    # The store agrees with the mount.
    for c, names in expected.items():
        assert sorted(os.listdir(root / f"class_{c}")) == names, c

"""Integration tests that really mount cubetorchfs over a posix backend and check what a user
sees: bytes, stat results, errno values, exit statuses, the control file, /proc/mounts and the
Prometheus counters.

Every mount is unmounted even when a test fails (see conftest.py and cubefs_harness.py).
Run: /usr/bin/python3 -m pytest -q tests/integration
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from cubefs_harness import (BINARY, REPO_ROOT, START_TIMEOUT_S, CubeFactory, CubeMount,
                            LaunchResult, bounded, deep_merge, environment_problem, errno_of,
                            mount_entry, pid_alive, pid_cmdline, read_file_bytes, run_command)

_PROBLEM = environment_problem()
if _PROBLEM is not None:
    pytest.skip(f"cubetorchfs integration tests need a real mount: {_PROBLEM}",
                allow_module_level=True)

KIB = 1 << 10
MIB = 1 << 20
BIG_FILE_SIZE = 65 * MIB + 12_345  # over 64 MiB, not a multiple of any chunk size
MANY_FILES = 10_000
ZERO_TIMEOUTS = {"fuse": {"entry_timeout_s": 0, "attr_timeout_s": 0, "negative_timeout_s": 0}}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_of_path(path: os.PathLike[str] | str, read_size: int = MIB) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(read_size):
            digest.update(chunk)
    return digest.hexdigest()


def read_uncached(path: os.PathLike[str] | str) -> bytes:
    """Reads a file through a fresh open after dropping its kernel page cache, so the read
    reaches the daemon instead of being answered by the kernel."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while chunk := os.read(fd, MIB):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def random_files(rng: random.Random, count: int, low: int, high: int,
                 prefix: str = "f") -> dict[str, bytes]:
    return {f"{prefix}_{i:04d}.bin": rng.randbytes(rng.randint(low, high)) for i in range(count)}


# --------------------------------------------------------------------------- the source tree


@dataclass
class SourceTree:
    root: Path
    hashes: dict[str, str] = field(default_factory=dict)  # regular file -> sha256
    symlinks: dict[str, str] = field(default_factory=dict)  # symlink -> target
    big: str = "big.bin"
    many_dir: str = "many"


def build_source_tree(root: Path) -> SourceTree:
    """Nested dirs, empty files and dirs, sizes around page and chunk boundaries, a file over
    64 MiB, unicode and 255-byte names, odd modes and mtimes, symlinks of every kind, and
    10,000 files in one directory. All contents are random bytes."""
    rng = random.Random(20240601)
    tree = SourceTree(root=root)

    def put(rel: str, data: bytes, mode: Optional[int] = None) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if mode is not None:
            path.chmod(mode)
        tree.hashes[rel] = sha256(data)

    put("empty_file", b"")
    (root / "empty_dir").mkdir()
    put("nested/l1/l2/l3/l4/l5/l6/deep.bin", rng.randbytes(1000))
    put("nested/l1/l2/l3/l4/l5/l6/empty", b"")
    put("nested/l1/mid.bin", rng.randbytes(5000))
    for size in (1, 4095, 4096, 4097, 128 * KIB + 1, MIB - 1, MIB, 4 * MIB - 1, 4 * MIB,
                 4 * MIB + 1, 9 * MIB + 7):
        put(f"sizes/size_{size}.bin", rng.randbytes(size))

    big = bytearray()
    while len(big) < BIG_FILE_SIZE:
        big += rng.randbytes(min(8 * MIB, BIG_FILE_SIZE - len(big)))
    put(tree.big, bytes(big))
    del big

    put("unicode/日本語のファイル.txt", "こんにちは".encode() * 100)
    put("unicode/émoji 🚀 file.bin", rng.randbytes(3000))
    put("unicode/Ελληνικά/файл.dat", rng.randbytes(70_000))
    put("unicode/with space & 'quotes'.txt", b"spaces\n")
    put("long/" + "n" * 255, rng.randbytes(100))
    put("long/" + "é" * 127 + "x", rng.randbytes(200))  # 255 bytes of UTF-8
    put("long/" + "d" * 255 + "/" + "f" * 255, rng.randbytes(300))

    put("modes/exec.sh", b"#!/bin/sh\necho hi\n", 0o755)
    put("modes/private", rng.randbytes(10), 0o600)
    put("modes/readonly", rng.randbytes(10), 0o444)
    put("modes/dir700/inside", rng.randbytes(10))
    (root / "modes/dir700").chmod(0o700)

    put("mtimes/ns_precise", rng.randbytes(10))
    os.utime(root / "mtimes/ns_precise", ns=(1_600_000_000_123_456_789, 1_600_000_000_987_654_321))
    put("mtimes/epoch_plus_one", rng.randbytes(10))
    os.utime(root / "mtimes/epoch_plus_one", ns=(1_000_000_000, 1_000_000_000))
    put("mtimes/future", rng.randbytes(10))
    os.utime(root / "mtimes/future", ns=(4_000_000_000_000_000_000, 4_000_000_000_000_000_001))

    (root / "links").mkdir()
    tree.symlinks = {
        "links/rel_file": "../sizes/size_4097.bin",
        "links/rel_dir": "../nested/l1",
        "links/abs_file": str(root / tree.big),
        "links/abs_outside": "/etc/hostname",
        "links/dangling": "no/such/target",
        "links/unicode": "../unicode/日本語のファイル.txt",
        "links/long_target": "../long/" + "n" * 255,
    }
    for link, target in tree.symlinks.items():
        os.symlink(target, root / link)

    many = root / tree.many_dir
    many.mkdir()
    for i in range(MANY_FILES):
        data = rng.randbytes(rng.randint(0, 64))
        (many / f"f_{i:05d}").write_bytes(data)
        tree.hashes[f"{tree.many_dir}/f_{i:05d}"] = sha256(data)
    return tree


def all_entries(root: Path, rel: str = "") -> list[str]:
    """Every path under root (root itself as ""), without following symlinks."""
    entries = [rel]
    with os.scandir(root / rel if rel else root) as it:
        for entry in it:
            child = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                entries += all_entries(root, child)
            else:
                entries.append(child)
    return entries


def compare_trees(source: Path, mount: Path) -> list[str]:
    """Differences in type, mode, size, mtime_ns, symlink target and listing, as text."""
    problems = []
    for rel in all_entries(source):
        src_path, mnt_path = source / rel, mount / rel
        s = os.lstat(src_path)
        try:
            m = os.lstat(mnt_path)
        except OSError as exc:
            problems.append(f"{rel!r}: lstat through the mount failed: {exc}")
            continue
        if stat.S_IFMT(s.st_mode) != stat.S_IFMT(m.st_mode):
            problems.append(f"{rel!r}: file type {s.st_mode:o} != {m.st_mode:o}")
            continue
        if s.st_mode != m.st_mode:
            problems.append(f"{rel!r}: mode {s.st_mode:o} != {m.st_mode:o}")
        if not stat.S_ISDIR(s.st_mode) and s.st_size != m.st_size:
            problems.append(f"{rel!r}: size {s.st_size} != {m.st_size}")
        if s.st_mtime_ns != m.st_mtime_ns:
            problems.append(f"{rel!r}: mtime_ns {s.st_mtime_ns} != {m.st_mtime_ns}")
        if stat.S_ISLNK(s.st_mode) and os.readlink(src_path) != os.readlink(mnt_path):
            problems.append(f"{rel!r}: readlink {os.readlink(src_path)!r} != "
                            f"{os.readlink(mnt_path)!r}")
        if stat.S_ISDIR(s.st_mode) and sorted(os.listdir(src_path)) != sorted(os.listdir(mnt_path)):
            problems.append(f"{rel!r}: directory listings differ")
    return problems


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> SourceTree:
    return build_source_tree(tmp_path_factory.mktemp("tree") / "src")


@pytest.fixture(scope="module")
def tree_mount(module_cube: CubeFactory, source_tree: SourceTree) -> CubeMount:
    """One daemon over the generated tree, shared by the read-only tests of this module."""
    return module_cube.mount(source_tree.root)


@pytest.fixture
def small_src(tmp_path: Path) -> dict[str, Any]:
    """A few small files: {"root": Path, "files": {relpath: bytes}}."""
    rng = random.Random(7)
    files = random_files(rng, 5, 1, 20_000)
    files["sub/inner.bin"] = rng.randbytes(4321)
    root = tmp_path / "small_src"
    write_files(root, files)
    return {"root": root, "files": files}


def assert_reads(mount: CubeMount, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        got = bounded(read_file_bytes, mount.path(rel), timeout=20, what=f"read {rel}")
        assert got == data, f"{rel}: wrong bytes through the mount"


# --------------------------------------------------------------------------- command line


def test_version_and_help_exit_zero() -> None:
    version = run_command([str(BINARY), "--version"])
    assert version.returncode == 0, version.stderr
    assert "cubetorchfs 0.1.0" in version.stdout
    helptext = run_command([str(BINARY), "--help"])
    assert helptext.returncode == 0, helptext.stderr
    text = helptext.stdout + helptext.stderr
    assert "cubetorchfs" in text and "-c" in text


# --------------------------------------------------------------------------- the generated tree


def test_diff_r_matches_source(tree_mount: CubeMount, source_tree: SourceTree) -> None:
    result = run_command(["diff", "-r", "--no-dereference", str(source_tree.root),
                          str(tree_mount.mountpoint)], timeout=150)
    assert result.returncode == 0, f"diff -r found differences:\n{result.stdout[:3000]}" \
                                   f"{result.stderr[:2000]}"


def test_stat_matches_source(tree_mount: CubeMount, source_tree: SourceTree) -> None:
    problems = bounded(compare_trees, source_tree.root, tree_mount.mountpoint, timeout=120,
                       what="stat walk")
    assert not problems, f"{len(problems)} differences, first ones:\n" + "\n".join(problems[:25])


def test_symlinks_readlink_equal(tree_mount: CubeMount, source_tree: SourceTree) -> None:
    for link, target in source_tree.symlinks.items():
        assert os.readlink(tree_mount.path(link)) == target, link
    data = read_file_bytes(tree_mount.path("links/rel_file"))
    assert sha256(data) == source_tree.hashes["sizes/size_4097.bin"]


def test_big_file_and_unicode_contents(tree_mount: CubeMount, source_tree: SourceTree) -> None:
    for rel in (source_tree.big, "unicode/日本語のファイル.txt", "unicode/Ελληνικά/файл.dat",
                "long/" + "é" * 127 + "x", "long/" + "d" * 255 + "/" + "f" * 255, "empty_file"):
        digest = bounded(sha256_of_path, tree_mount.path(rel), timeout=60, what=f"read {rel}")
        assert digest == source_tree.hashes[rel], rel


def test_ten_thousand_files_in_one_directory(tree_mount: CubeMount,
                                             source_tree: SourceTree) -> None:
    many = tree_mount.path(source_tree.many_dir)
    names = bounded(os.listdir, many, timeout=60, what="listdir")
    assert len(names) == MANY_FILES
    assert sorted(names) == sorted(os.listdir(source_tree.root / source_tree.many_dir))
    for name in random.Random(3).sample(names, 200):
        assert sha256(read_file_bytes(many / name)) == \
            source_tree.hashes[f"{source_tree.many_dir}/{name}"]


def test_proc_mounts_entry(tree_mount: CubeMount) -> None:
    entry = mount_entry(tree_mount.mountpoint)
    assert entry is not None
    assert entry.fstype == "fuse.cubetorchfs"
    assert entry.source == f"cubetorchfs:{tree_mount.vol_name}"


def test_the_mounts_kernel_readahead_is_fuse_read_ahead(tree_mount: CubeMount,
                                                        source_tree: SourceTree,
                                                        cube: CubeFactory) -> None:
    """A FUSE mount gets 128 KiB of readahead; the daemon (root) sets fuse.read_ahead (8 MiB by
    default) and a big file still reads byte for byte."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the daemon sets /sys/class/bdi/*/read_ahead_kb)")

    def read_ahead_kb(mount: CubeMount) -> int:
        dev = os.stat(mount.path()).st_dev
        return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
                   .read_text())

    assert read_ahead_kb(tree_mount) == 8192
    small = cube.mount(source_tree.root, {"fuse": {"read_ahead": "256KiB"}})
    assert read_ahead_kb(small) == 256
    data = small.path(source_tree.big).read_bytes()
    assert hashlib.sha256(data).hexdigest() == source_tree.hashes[source_tree.big]


@pytest.mark.parametrize("profile", ["", "ai_prefetch"])
def test_read_only_mount_fails_writes_with_erofs(cube: CubeFactory, source_tree: SourceTree,
                                                 profile: str) -> None:
    """fuse.read_only keeps the store untouched, with or without the ai_prefetch profile (which
    does not imply it)."""
    mount = cube.mount(source_tree.root, {"profile": profile, "fuse": {"read_only": True}})
    mnt = mount.mountpoint
    existing = mnt / "sizes/size_4096.bin"

    def open_for_write() -> None:
        os.close(os.open(existing, os.O_WRONLY))

    attempts: dict[str, Callable[[], Any]] = {
        "create": lambda: os.close(os.open(mnt / "new_file", os.O_WRONLY | os.O_CREAT, 0o644)),
        "open O_WRONLY": open_for_write,
        "mkdir": lambda: os.mkdir(mnt / "new_dir"),
        "unlink": lambda: os.unlink(existing),
        "rmdir": lambda: os.rmdir(mnt / "empty_dir"),
        "rename": lambda: os.rename(existing, mnt / "renamed"),
        "symlink": lambda: os.symlink("target", mnt / "new_link"),
        "truncate": lambda: os.truncate(existing, 0),
        "chmod": lambda: os.chmod(existing, 0o600),
    }
    wrong = {}
    for name, attempt in attempts.items():
        err = bounded(errno_of, attempt, timeout=10, what=name)
        if err != errno.EROFS:
            wrong[name] = errno.errorcode.get(err, err) if err is not None else "succeeded"
    assert not wrong, f"expected EROFS, got {wrong}"
    assert sha256_of_path(source_tree.root / "sizes/size_4096.bin") == \
        source_tree.hashes["sizes/size_4096.bin"]
    assert not (source_tree.root / "new_file").exists()


@pytest.mark.parametrize("keep_cache", [False, True], ids=["no-keep-cache", "keep-cache"])
def test_a_read_only_mount_gets_one_flush_at_most(cube: CubeFactory, source_tree: SourceTree,
                                                 keep_cache: bool) -> None:
    # Nothing is ever written: the first close's FLUSH tells the kernel to send no more, so
    # a close never costs a round trip.
    mount = cube.mount(source_tree.root, {"profile": "ai_prefetch",
                                          "fuse": {"read_only": True, "keep_cache": keep_cache}})
    files = sorted(p for p in (mount.mountpoint / "sizes").iterdir() if p.is_file())
    assert len(files) >= 5
    for _ in range(3):
        for p in files:
            assert p.read_bytes() == (source_tree.root / "sizes" / p.name).read_bytes()
    flushes = mount.metrics().value("cubetorchfs_fuse_ops_total", op="flush")
    assert flushes <= 1, mount.metrics().text


# --------------------------------------------------------------------------- concurrency


def test_sixteen_concurrent_readers_byte_exact(cube: CubeFactory, source_tree: SourceTree) -> None:
    # A fresh daemon with a cache smaller than the big file: concurrent cold misses on the
    # same chunks, and evictions while other readers are still reading.
    mount = cube.mount(source_tree.root, {"cache": {"memory_bytes": "32MiB"}})
    big_src = source_tree.root / source_tree.big
    boundaries = [k * 4 * MIB for k in range(1, BIG_FILE_SIZE // (4 * MIB) + 1)]
    small = [rel for rel in source_tree.hashes if rel.startswith(("sizes/", "unicode/", "long/"))]
    many = sorted(rel for rel in source_tree.hashes if rel.startswith(source_tree.many_dir))
    barrier = threading.Barrier(16)
    failures: list[str] = []
    lock = threading.Lock()

    def fail(msg: str) -> None:
        with lock:
            failures.append(msg)

    def reader(index: int) -> None:
        rng = random.Random(index)
        try:
            barrier.wait(timeout=30)
            if index % 4 == 3:  # random preads, many of them across chunk boundaries
                with open(mount.path(source_tree.big), "rb", buffering=0) as f, \
                        open(big_src, "rb", buffering=0) as ref:
                    for _ in range(64):
                        offset = max(0, rng.choice(boundaries) - rng.randint(0, 8192)) \
                            if rng.random() < 0.7 else rng.randrange(BIG_FILE_SIZE)
                        length = rng.choice([1, 4096, 70_000, MIB + 3])
                        got = os.pread(f.fileno(), length, offset)
                        if got != os.pread(ref.fileno(), length, offset):
                            fail(f"reader {index}: pread({length}, {offset}) differs")
            else:  # whole big file, each reader with its own read size
                read_size = [4096, 65_536, 131_072, MIB, 3 * MIB + 17][index % 5]
                if sha256_of_path(mount.path(source_tree.big), read_size) != \
                        source_tree.hashes[source_tree.big]:
                    fail(f"reader {index}: big file sha256 differs (read size {read_size})")
            for rel in small + rng.sample(many, 150):
                if sha256_of_path(mount.path(rel)) != source_tree.hashes[rel]:
                    fail(f"reader {index}: {rel} sha256 differs")
        except Exception as exc:  # reported below, with the reader's number
            fail(f"reader {index}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(16)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "readers still running after 120 s (hang?)"
    assert not failures, "\n".join(failures[:20])
    assert pid_alive(mount.pid)


# --------------------------------------------------------------------------- streamed reads


def test_a_cold_large_file_streams_and_a_reread_is_cached(cube: CubeFactory,
                                                          tmp_path: Path) -> None:
    """cache.stream_min_bytes (32 MiB): a cold read of a large file goes from the store's file
    to the kernel, not into the RAM cache; reading the same bytes again caches them and a third
    read is served from RAM. A file rewritten in the store is streamed at its new version.
    stream_min_bytes 0 turns streaming off. Passthrough off: where the kernel has it, such an
    open is the kernel's to read (test_passthrough.py); streaming is what reads these files
    where it does not, and under profiles that send no opens."""
    rng = random.Random(7)
    src = tmp_path / "src"
    data = rng.randbytes(40 * MIB + 777)
    write_files(src, {"ckpt.bin": data, "small.bin": rng.randbytes(MIB)})
    big_cache = {"cache": {"memory_bytes": "512MiB"}, "fuse": {"passthrough": "off"}}
    mount = cube.mount(src, deep_merge(big_cache, ZERO_TIMEOUTS))
    streamed = "cubetorchfs_read_streamed_bytes_total"

    assert read_uncached(mount.path("ckpt.bin")) == data
    assert read_uncached(mount.path("small.bin")) is not None  # under the threshold: cached
    m = mount.metrics()
    assert m.value(streamed) == len(data)
    assert m.value("cubetorchfs_cache_bytes", tier="ram") == MIB, "only the small file cached"

    # The same bytes again: what reaches the daemon (fadvise drops most of the kernel's pages,
    # not always all) is cached now, never streamed twice.
    assert read_uncached(mount.path("ckpt.bin")) == data
    m = mount.metrics()
    assert m.value(streamed) == len(data)
    cached = m.value("cubetorchfs_cache_bytes", tier="ram") - MIB
    assert cached >= 4 * MIB, f"{cached} bytes of the re-read file cached"
    from_ram = m.value("cubetorchfs_read_bytes_total", source="ram")
    assert read_uncached(mount.path("ckpt.bin")) == data
    m = mount.metrics()
    assert m.value("cubetorchfs_read_bytes_total", source="ram") > from_ram
    assert m.value(streamed) == len(data)

    new = rng.randbytes(36 * MIB + 5)
    (src / "ckpt.bin").write_bytes(new)
    later = time.time_ns() + 10 * 10**9
    os.utime(src / "ckpt.bin", ns=(later, later))
    assert read_uncached(mount.path("ckpt.bin")) == new
    assert mount.metrics().value(streamed) == len(data) + len(new)

    off = cube.mount(src, {"cache": {"memory_bytes": "512MiB", "stream_min_bytes": 0}})
    assert read_uncached(off.path("ckpt.bin")) == new
    assert off.metrics().value(streamed) == 0
    assert off.metrics().value("cubetorchfs_cache_bytes", tier="ram") >= len(new)


def test_reads_without_an_open_stream_too(cube: CubeFactory, tmp_path: Path) -> None:
    """Under ai_prefetch (keep_cache: the kernel sends no open, reads come without a handle) a
    cold large file is streamed all the same, and the ghost queue still caches a re-read."""
    rng = random.Random(8)
    src = tmp_path / "src"
    data = rng.randbytes(36 * MIB + 4321)
    write_files(src, {"shard.tar": data})
    mount = cube.mount(src, {"profile": "ai_prefetch", "cache": {"memory_bytes": "512MiB"}})
    assert read_uncached(mount.path("shard.tar")) == data
    assert mount.metrics().value("cubetorchfs_read_streamed_bytes_total") == len(data)
    assert read_uncached(mount.path("shard.tar")) == data
    m = mount.metrics()
    assert m.value("cubetorchfs_read_streamed_bytes_total") == len(data)
    assert m.value("cubetorchfs_cache_bytes", tier="ram") >= 4 * MIB


def test_a_scan_under_the_training_profile_answers_the_lookups_that_follow(
        cube: CubeFactory, tmp_path: Path) -> None:
    """Under ai_prefetch every readdir is a readdirplus: listing a class directory of 1,500
    files (more than one getdents buffer) gives the kernel every entry, and opening each file
    afterwards costs no LOOKUP. The default profile keeps the kernel's own choice."""
    rng = random.Random(9)
    src = tmp_path / "src"
    files = {f"cls/img_{i:05d}.jpg": rng.randbytes(64) for i in range(1500)}
    write_files(src, files)
    for profile, most_lookups in (("ai_prefetch", 1), ("", None)):
        mount = cube.mount(src, {"profile": profile})
        names = os.listdir(mount.path("cls"))
        assert len(names) == 1500
        before = mount.metrics().value("cubetorchfs_fuse_ops_total", op="lookup")
        for name in names:
            assert mount.path(f"cls/{name}").read_bytes() == files[f"cls/{name}"]
        lookups = mount.metrics().value("cubetorchfs_fuse_ops_total", op="lookup") - before
        if most_lookups is not None:
            assert lookups <= most_lookups, f"{lookups} lookups after a readdirplus listing"
        else:
            assert lookups > 0, "the default profile's readdir is plus only at first"


# --------------------------------------------------------------------------- freshness


def test_file_changed_in_store_is_read_fresh(cube: CubeFactory, tmp_path: Path) -> None:
    rng = random.Random(11)
    src = tmp_path / "src"
    v1 = {"same_size.bin": rng.randbytes(100_000), "chunked.bin": rng.randbytes(9 * MIB + 5),
          "replaced.bin": rng.randbytes(50_000), "deleted.bin": rng.randbytes(10)}
    write_files(src, v1)
    mount = cube.mount(src, ZERO_TIMEOUTS)
    assert_reads(mount, v1)  # now cached in the daemon

    later = time.time_ns() + 10 * 10**9
    v2 = dict(v1)
    # Same size, new bytes, written in place (same inode), newer mtime.
    v2["same_size.bin"] = rng.randbytes(100_000)
    (src / "same_size.bin").write_bytes(v2["same_size.bin"])
    os.utime(src / "same_size.bin", ns=(later, later))
    # One MiB rewritten in the middle of a chunked file.
    patch = rng.randbytes(MIB)
    with open(src / "chunked.bin", "r+b") as f:
        f.seek(5 * MIB)
        f.write(patch)
    v2["chunked.bin"] = v1["chunked.bin"][:5 * MIB] + patch + v1["chunked.bin"][6 * MIB:]
    os.utime(src / "chunked.bin", ns=(later, later))
    # Replaced by a new inode of another size.
    v2["replaced.bin"] = rng.randbytes(77_777)
    (src / "replaced.tmp").write_bytes(v2["replaced.bin"])
    os.replace(src / "replaced.tmp", src / "replaced.bin")
    # Deleted, and a new file created.
    os.unlink(src / "deleted.bin")
    del v2["deleted.bin"]
    v2["created.bin"] = rng.randbytes(1234)
    (src / "created.bin").write_bytes(v2["created.bin"])

    assert_reads(mount, v2)
    assert errno_of(lambda: os.stat(mount.path("deleted.bin"))) == errno.ENOENT
    assert os.stat(mount.path("chunked.bin")).st_mtime_ns == later


# --------------------------------------------------------------------------- backend errors


def test_backend_error_rate_one_gives_eio_quickly(cube: CubeFactory, small_src: dict) -> None:
    mount = cube.mount(small_src["root"], {
        "backend": {"inject": {"latency_us": 0, "error_rate": 1.0, "seed": 1}}, **ZERO_TIMEOUTS})
    name = next(iter(small_src["files"]))
    start = time.monotonic()
    operations: dict[str, Callable[[], Any]] = {
        "stat": lambda: os.stat(mount.path(name)),
        "open+read": lambda: read_file_bytes(mount.path(name)),
        "listdir": lambda: os.listdir(mount.mountpoint / "sub"),
    }
    for what, operation in operations.items():
        err = bounded(errno_of, operation, timeout=10, what=what)
        assert err == errno.EIO, f"{what}: expected EIO, got {errno.errorcode.get(err, err)}"
    assert time.monotonic() - start < 15
    assert pid_alive(mount.pid) and mount.is_mounted()
    mount.metrics()  # still answering


def test_daemon_keeps_serving_through_backend_errors(cube: CubeFactory, tmp_path: Path) -> None:
    files = random_files(random.Random(5), 40, 1_000, 80_000)
    write_files(tmp_path / "src", files)
    # Zero timeouts: every open costs several backend requests (lookup, getattr, read), each
    # failing half the time, so most reads fail; the point is how they fail.
    mount = cube.mount(tmp_path / "src", {
        "backend": {"inject": {"error_rate": 0.5, "seed": 42}}, **ZERO_TIMEOUTS})

    def attempt(rel: str) -> Any:
        try:
            data = read_file_bytes(mount.path(rel))
        except OSError as exc:
            return errno.errorcode.get(exc.errno, exc.errno)
        return "ok" if data == files[rel] else "WRONG BYTES"

    outcomes: Counter[Any] = Counter()
    for _ in range(3):
        for rel in files:
            outcomes[bounded(attempt, rel, timeout=10, what=f"read {rel}")] += 1
    assert set(outcomes) <= {"ok", "EIO"}, f"every read must be right or EIO: {outcomes}"
    assert outcomes["EIO"] > 0, outcomes

    assert pid_alive(mount.pid) and mount.is_mounted()
    mount.metrics()
    # And it keeps serving: each file reads right within a few hundred tries (one try
    # succeeds with a probability of a few percent here; 400 failures in a row: ~1e-5).
    for rel in list(files)[:5]:
        results: Counter[Any] = Counter()
        for _ in range(400):
            result = bounded(attempt, rel, timeout=10, what=f"read {rel}")
            results[result] += 1
            if result == "ok":
                break
        assert result == "ok", f"{rel} never read right: {results}"
        assert set(results) <= {"ok", "EIO"}, results


# --------------------------------------------------------------------------- configs


def _bad_config_cases(tmp: Path) -> dict[str, tuple[Optional[dict], Optional[str], str]]:
    """case id -> (overrides, or raw config text; what the one stderr line must name)."""
    return {
        "malformed-json": (None, '{"volName": "broken", "backend": {"type": "posix",\n',
                           "config.json"),
        "unknown-cache-key": ({"cache": {"bogus_key": 1}}, None, "cache.bogus_key"),
        "unknown-fuse-key": ({"fuse": {"bogus": True}}, None, "fuse.bogus"),
        "unknown-backend-key": ({"backend": {"bogus": 1}}, None, "backend.bogus"),
        "bad-size-string": ({"cache": {"memory_bytes": "12 parsecs"}}, None, "cache.memory_bytes"),
        "negative-size": ({"cache": {"memory_bytes": -1}}, None, "cache.memory_bytes"),
        "size-of-wrong-type": ({"cache": {"chunk_bytes": [1, 2]}}, None, "cache.chunk_bytes"),
        "negative-timeout": ({"fuse": {"attr_timeout_s": -1}}, None, "fuse.attr_timeout_s"),
        "missing-root": ({"backend": {"root": str(tmp / "does-not-exist")}}, None, "backend.root"),
        "root-is-a-file": ({"backend": {"root": str(tmp / "a_regular_file")}}, None,
                           "backend.root"),
        "unknown-backend-type": ({"backend": {"type": "nfs"}}, None, "backend.type"),
        "error-rate-above-one": ({"backend": {"inject": {"error_rate": 1.5}}}, None,
                                 "backend.inject.error_rate"),
        "cubefs-without-master": ({"backend": {"type": "cubefs", "root": None}}, None,
                                  "masterAddr"),
        "cubefs-bad-master": (cubefs("localhost", "libcfs.so"), None, "masterAddr"),
        "cubefs-without-keys": ({**cubefs("127.0.0.1:1", "libcfs.so"), "secretKey": None}, None,
                                "secretKey"),
        # A missing library: refused before daemonizing (a path), or by dlopen after it (a
        # name looked up on the library path); a library that is not libcfs.
        "cubefs-missing-lib": (cubefs("127.0.0.1:1", str(tmp / "no-libcfs.so")), None,
                               "backend.cubefs.lib"),
        "cubefs-lib-not-on-path": (cubefs("127.0.0.1:1", "libcfs-not-installed.so"), None,
                                   "backend.cubefs.lib"),
        "cubefs-incompatible-lib": (cubefs("127.0.0.1:1", "libm.so.6"), None,
                                    "backend.cubefs.lib"),
    }


def cubefs(master: str, lib: str) -> dict[str, Any]:
    """A config of backend.type cubefs (no cluster: these configs are all refused)."""
    return {"masterAddr": master, "accessKey": "ak", "secretKey": "sk",
            "backend": {"type": "cubefs", "root": None, "cubefs": {"lib": lib}}}


def assert_refused(mount: CubeMount, result: LaunchResult, must_name: str) -> None:
    assert result.returncode == 2, (
        f"exit status {result.returncode}, expected 2; stderr: {result.stderr!r}")
    assert len(result.stderr_lines) == 1, f"expected one stderr line, got {result.stderr!r}"
    assert must_name in result.stderr_lines[0], (
        f"stderr does not name {must_name!r}: {result.stderr!r}")
    assert not mount.is_mounted(), "a refused config must not mount"
    assert not mount.control_file.exists()
    assert not mount.daemon_pids(), "a refused config must leave no daemon behind"


@pytest.mark.parametrize("case", list(_bad_config_cases(Path("/"))))
def test_bad_config_exits_2_naming_the_key(cube: CubeFactory, small_src: dict, tmp_path: Path,
                                           case: str) -> None:
    (tmp_path / "a_regular_file").write_bytes(b"x")
    overrides, raw, must_name = _bad_config_cases(tmp_path)[case]
    mount = cube.prepare(small_src["root"], overrides, raw_text=raw)
    assert_refused(mount, cube.launch(mount), must_name)


def test_missing_config_file_exits_2(cube: CubeFactory, small_src: dict, tmp_path: Path) -> None:
    mount = cube.prepare(small_src["root"])
    missing = str(tmp_path / "no-such-config.json")
    result = cube.launch(mount, ["-c", missing, str(mount.mountpoint)])
    assert_refused(mount, result, "no-such-config.json")


def test_unknown_top_level_key_only_warns(cube: CubeFactory, small_src: dict) -> None:
    mount = cube.mount(small_src["root"], {"frobnicateLevel": 3, "masterAddr": "10.0.0.1:17010",
                                           "owner": "ltptest"})
    assert_reads(mount, small_src["files"])
    logs = "".join(p.read_text(errors="replace") for p in (mount.workdir / "log").rglob("*")
                   if p.is_file())
    assert "frobnicateLevel" in mount.launch_result.stderr + logs, \
        "the unknown top-level key should be named in a warning (stderr or log)"


def test_yaml_config_mounts(cube: CubeFactory, small_src: dict) -> None:
    def yaml_text(m: CubeMount) -> str:
        return (f"# a hand-written YAML config\n"
                f"volName: {m.vol_name}\n"
                f"mountPoint: {m.mountpoint}\n"
                f"logDir: {m.workdir / 'log'}\n"
                f"logLevel: info\n"
                f"exporterPort: {m.metrics_port}\n"
                f"profPort: ''\n"
                f"backend:\n"
                f"  type: posix\n"
                f"  root: {small_src['root']}\n"
                f"cache:\n"
                f"  memory_bytes: 64MiB\n"
                f"  chunk_bytes: 4MiB\n"
                f"fuse:\n"
                f"  attr_timeout_s: 1\n")

    mount = cube.prepare(small_src["root"], fmt="yaml", raw_text=yaml_text)
    result = cube.launch(mount)
    assert result.returncode == 0, result.stderr
    assert mount.wait_ready()
    assert_reads(mount, small_src["files"])


def test_example_configs_are_accepted(cube: CubeFactory, small_src: dict) -> None:
    examples = REPO_ROOT / "conf" / "examples"
    sample = json.loads((examples / "config.json").read_text())
    try:
        import yaml  # python3-yaml; optional
    except ImportError:
        yaml = None
    if yaml is not None:
        assert yaml.safe_load((examples / "config.yaml").read_text()) == sample, \
            "conf/examples/config.yaml and config.json should say the same"
    mount = cube.prepare(small_src["root"])
    local = {"volName": mount.vol_name, "mountPoint": str(mount.mountpoint),
             "logDir": str(mount.workdir / "log"), "exporterPort": mount.metrics_port,
             "profPort": "", "backend": {"root": str(small_src["root"])},
             "prefetch": {"control_socket": str(mount.workdir / "ctl.sock")}}
    mount.config_path.write_text(json.dumps(deep_merge(sample, local), indent=2))
    result = cube.launch(mount)
    assert result.returncode == 0, result.stderr
    assert mount.wait_ready()
    assert_reads(mount, small_src["files"])


# --------------------------------------------------------------------------- lifecycle


def test_control_file_appears_and_fusermount_removes_it(cube: CubeFactory, small_src: dict) -> None:
    mount = cube.prepare(small_src["root"])
    result = cube.launch(mount)
    assert result.returncode == 0, result.stderr
    # The contract: when the command returns, the mount is ready and the control file written.
    assert mount.is_mounted(), "not mounted when the command returned"
    assert mount.control_file.exists(), "no control file when the command returned"
    info = mount.read_control()
    assert info["vol_name"] == mount.vol_name
    assert info["mount_point"] == str(mount.mountpoint)
    assert info["metrics_port"] == mount.metrics_port
    assert info["version"] == "0.1.0"
    assert {"prof", "local_ip", "control_socket", "pid"} <= set(info)
    assert pid_alive(info["pid"]) and str(mount.config_path) in pid_cmdline(info["pid"])
    mount.pid = info["pid"]
    assert_reads(mount, small_src["files"])

    unmount = mount.fusermount()
    assert unmount.returncode == 0, unmount.stderr
    assert mount.wait_gone(), "daemon, mount or control file still there after fusermount3 -u"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_unmounts_and_removes_control_file(cube: CubeFactory, small_src: dict,
                                                  signum: int) -> None:
    mount = cube.mount(small_src["root"])
    assert_reads(mount, small_src["files"])
    mount.signal(signum)
    assert mount.wait_gone(), "daemon, mount or control file still there after the signal"


def test_foreground_daemon_exits_zero_on_sigterm(cube: CubeFactory, small_src: dict) -> None:
    mount = cube.prepare(small_src["root"])
    proc = cube.start_foreground(mount)
    assert_reads(mount, small_src["files"])
    # The foreground process is the supervisor; the daemon serving the mount is its child.
    info = mount.read_control()
    assert info["supervisor_pid"] == proc.pid and info["pid"] != proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert mount.wait_gone()


def _installed_on_default_path() -> bool:
    """True if `cubetorchfs` on the shell's default PATH is our binary."""
    try:
        found = run_command(["env", "-i", "/bin/sh", "-c", "command -v cubetorchfs"]).stdout
    except subprocess.TimeoutExpired:
        return False
    return bool(found.strip()) and os.path.realpath(found.strip()) == os.path.realpath(BINARY)


def test_mount_t_fuse_cubetorchfs(cube: CubeFactory, small_src: dict, tmp_path: Path) -> None:
    """The fstab path: `mount -t fuse.cubetorchfs CONFIG MNT` -> mount.fuse3 -> /bin/sh ->
    `cubetorchfs CONFIG MNT -o rw,dev,suid`, then `umount MNT`.

    mount(8) runs its helpers without PATH, so /bin/sh finds `cubetorchfs` only on its default
    PATH. Unless it is installed there, the whole sequence runs in a private mount namespace
    where /usr/local/sbin is a directory holding a link to the binary; nothing outside that
    namespace changes, and the daemon is cleaned up by its config path as usual.
    """
    if os.geteuid() != 0:
        pytest.skip("mount(8) of a FUSE type needs root")
    if shutil.which("unshare") is None and not _installed_on_default_path():
        pytest.skip("cubetorchfs is not on the default PATH and unshare(1) is missing")
    mount = cube.prepare(small_src["root"])
    bindir = tmp_path / "sbin"
    bindir.mkdir()
    (bindir / "cubetorchfs").symlink_to(BINARY)
    script = "\n".join([
        "set -e",
        "" if _installed_on_default_path() else 'mount --bind "$BINDIR" /usr/local/sbin',
        'mount -t fuse.cubetorchfs "$CONFIG" "$MNT"',
        'echo "MOUNTS: $(grep " $MNT " /proc/self/mounts)"',
        'cd "$SRC"',
        'for f in $(find . -type f); do cmp "$f" "$MNT/$f"; echo "SAME: $f"; done',
        'umount "$MNT"',
        'echo "UNMOUNTED"',
    ])
    env = mount.env()
    env.update(BINDIR=str(bindir), CONFIG=str(mount.config_path), MNT=str(mount.mountpoint),
               SRC=str(small_src["root"]))
    command = ["/bin/sh", "-c", script]
    if not _installed_on_default_path():
        command = ["unshare", "--mount", "--propagation", "private"] + command
    result = run_command(command, timeout=START_TIMEOUT_S + 30, env=env)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stdout}{result.stderr}"
    mount_lines = [l for l in result.stdout.splitlines() if l.startswith("MOUNTS: ")]
    fields = mount_lines[0].split()[1:] if mount_lines else []
    assert fields[:3] == [f"cubetorchfs:{mount.vol_name}", str(mount.mountpoint),
                          "fuse.cubetorchfs"], result.stdout
    assert result.stdout.count("SAME: ") == len(small_src["files"]), result.stdout
    assert "UNMOUNTED" in result.stdout
    assert mount.wait_gone(), "daemon or control file still there after umount"


def test_mount_t_fuse_with_binary_path(cube: CubeFactory, small_src: dict) -> None:
    """`mount -t fuse BINARY#CONFIG MNT`: mount.fuse3 runs the binary by its full path."""
    if os.geteuid() != 0:
        pytest.skip("mount(8) of a FUSE type needs root")
    mount = cube.prepare(small_src["root"])
    args = ["mount", "-t", "fuse", f"{BINARY}#{mount.config_path}", str(mount.mountpoint)]
    result = run_command(args, timeout=START_TIMEOUT_S, env=mount.env())
    assert result.returncode == 0, f"{' '.join(args)} failed: {result.stdout}{result.stderr}"
    assert mount.wait_ready(10)
    entry = mount_entry(mount.mountpoint)
    assert entry is not None and entry.fstype == "fuse.cubetorchfs", entry
    assert entry.source == f"cubetorchfs:{mount.vol_name}", entry
    assert_reads(mount, small_src["files"])
    result = run_command(["umount", str(mount.mountpoint)])
    assert result.returncode == 0, result.stderr
    assert mount.wait_gone()


# --------------------------------------------------------------------------- metrics


def test_metrics_count_misses_hits_and_bytes(cube: CubeFactory, tmp_path: Path) -> None:
    files = random_files(random.Random(9), 8, 50_000, 120_000)
    total = sum(len(d) for d in files.values())
    write_files(tmp_path / "src", files)
    mount = cube.mount(tmp_path / "src")
    before = mount.metrics()

    for rel, data in files.items():  # first read of each file: a miss
        assert read_file_bytes(mount.path(rel)) == data
    first = mount.metrics()
    misses = first.value("cubetorchfs_reads_total", result="miss") - \
        before.value("cubetorchfs_reads_total", result="miss")
    assert misses >= len(files), first.text
    assert first.value("cubetorchfs_read_bytes_total", source="backend") - \
        before.value("cubetorchfs_read_bytes_total", source="backend") >= total
    assert first.value("cubetorchfs_cache_bytes", tier="ram") >= total

    for rel, data in files.items():  # again, past the kernel page cache: hits from RAM
        assert read_uncached(mount.path(rel)) == data
    second = mount.metrics()
    hits = second.value("cubetorchfs_reads_total", result="hit") - \
        first.value("cubetorchfs_reads_total", result="hit")
    assert hits >= len(files), f"hits {hits}\n{second.text}"
    assert second.value("cubetorchfs_reads_total", result="miss") == \
        first.value("cubetorchfs_reads_total", result="miss")
    assert second.value("cubetorchfs_read_bytes_total", source="ram") - \
        first.value("cubetorchfs_read_bytes_total", source="ram") >= total

    assert second.value("cubetorchfs_backend_requests_total") > 0
    assert second.label_values("cubetorchfs_backend_requests_total", "op")
    assert second.value("cubetorchfs_backend_request_seconds_count") > 0
    assert second.has("cubetorchfs_backend_request_seconds_bucket")
    assert second.value("cubetorchfs_fuse_ops_total", op="read") >= 2 * len(files), \
        f"fuse ops by op: {second.label_values('cubetorchfs_fuse_ops_total', 'op')}"
    assert second.value("cubetorchfs_fuse_op_seconds_count") > 0
    assert second.has("cubetorchfs_cache_evictions_total", tier="ram")


def test_ram_budget_is_never_exceeded(cube: CubeFactory, tmp_path: Path) -> None:
    budget = 16 * MIB
    files = random_files(random.Random(13), 256, 128 * KIB, 128 * KIB)  # 32 MiB in all
    write_files(tmp_path / "src", files)
    mount = cube.mount(tmp_path / "src", {"cache": {"memory_bytes": budget, "chunk_bytes": "1MiB"}})
    for _ in range(2):
        for i, (rel, data) in enumerate(files.items()):
            assert read_uncached(mount.path(rel)) == data
            if i % 32 == 31:
                assert mount.metrics().value("cubetorchfs_cache_bytes", tier="ram") <= budget
    metrics = mount.metrics()
    assert metrics.value("cubetorchfs_cache_bytes", tier="ram") <= budget
    assert metrics.value("cubetorchfs_cache_evictions_total", tier="ram") > 0


# --------------------------------------------------------------------------- PyTorch


class RawBytesDataset:
    """(relative path, raw bytes, class index) for every file of an ImageFolder-style tree."""

    def __init__(self, root: str) -> None:
        from torchvision.datasets import DatasetFolder

        self.root = root
        self.folder = DatasetFolder(root, loader=read_file_bytes, extensions=(".jpg",))

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> tuple[str, bytes, int]:
        path, target = self.folder.samples[index]
        data, _ = self.folder[index]
        return os.path.relpath(path, self.root), data, target


def keep_as_list(batch: list) -> list:
    return batch


def test_torch_dataloader_through_mount(cube: CubeFactory, tmp_path: Path) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    pytest.importorskip("torchvision.datasets")
    rng = random.Random(17)
    classes = ["n01440764", "n01443537", "n01484850", "n01491361"]
    files = {f"{c}/img_{i:03d}.jpg": rng.randbytes(rng.randint(2_000, 30_000))
             for c in classes for i in range(40)}
    write_files(tmp_path / "imagenet", files)
    mount = cube.mount(tmp_path / "imagenet", {"profile": "ai_prefetch"})

    dataset = RawBytesDataset(str(mount.mountpoint))
    assert len(dataset) == len(files)
    loader = torch_data.DataLoader(dataset, batch_size=16, shuffle=True, num_workers=2,
                                   collate_fn=keep_as_list, timeout=60)
    seen: dict[str, bytes] = {}
    scrapes = [mount.metrics()]
    # Three epochs: cold (from the store), cached (the kernel's page cache may answer), and
    # cached with the kernel's pages dropped first (the daemon's RAM cache must answer).
    for epoch in range(3):
        if epoch == 2:
            for rel in files:
                fd = os.open(mount.path(rel), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        seen.clear()
        for batch in loader:
            for rel, data, target in batch:
                assert rel not in seen, f"{rel} delivered twice in one epoch"
                assert classes[target] == rel.split("/")[0]
                seen[rel] = data
        assert seen.keys() == files.keys()
        bad = [rel for rel in files if seen[rel] != files[rel]]
        assert not bad, f"wrong bytes for {bad[:5]}"
        scrapes.append(mount.metrics())

    def delta(epoch: int, name: str, **labels: str) -> float:
        return scrapes[epoch + 1].value(name, **labels) - scrapes[epoch].value(name, **labels)

    # Cold: every file came from the store, each exactly once (one chunk each).
    total = sum(len(data) for data in files.values())
    store_reads = delta(0, "cubetorchfs_backend_requests_total", op="read")
    assert store_reads >= len(files), f"epoch 1 made {store_reads} store reads for {len(files)} files"
    assert delta(0, "cubetorchfs_read_bytes_total", source="backend") == total
    assert delta(0, "cubetorchfs_reads_total", result="miss") >= len(files)
    # Cached: nothing from the store in either later epoch.
    for epoch in (1, 2):
        assert delta(epoch, "cubetorchfs_backend_requests_total", op="read") == 0, (
            f"epoch {epoch + 1} read the store")
        assert delta(epoch, "cubetorchfs_read_bytes_total", source="backend") == 0
        assert delta(epoch, "cubetorchfs_reads_total", result="miss") == 0
    # With the kernel's pages gone, the reads reached the daemon and were RAM-cache hits.
    assert delta(2, "cubetorchfs_reads_total", result="hit") >= len(files)
    assert delta(2, "cubetorchfs_read_bytes_total", source="ram") == total

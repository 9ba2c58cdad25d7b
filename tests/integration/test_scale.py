"""Scale, CI-sized: a 200,000-file namespace (the synthetic store: 200 directories of 1,000
files, no disk) through a real mount under the training profile.

- Listing the root lists its directories ahead of the scan, each once.
- Listing every directory makes the kernel know every entry (readdirplus) and the daemon's
  inode table follow it (`cubetorchfs_inodes`); the memory that takes per known file is
  measured and bounded.
- An epoch over a subset, then a second one: the second makes no store request of any op
  (the data fits; the kernel holds the names, attributes and pages).
- When the kernel forgets (`drop_caches`), the inode table shrinks with it.
Renames and deletes that visit only what they change are unit tests (the synthetic store is
read-only): tests/fs/inode_table_test.cc, tests/cache/*_cache_test.cc.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cubefs_harness import CubeFactory

DIRS, PER_DIR = 200, 1000
FILES = DIRS * PER_DIR
EPOCH_DIRS = 20  # the epochs read 20,000 of the files
# What the daemon may hold per file the kernel knows, beyond its cache (docs/memory.md).
BYTES_PER_KNOWN_FILE = 240  # measured 165 on 2026-11-28 ((parent, name) records); 491 before


# The ASan pass of .ci/run swaps in an instrumented daemon.
SANITIZED = "ASAN_OPTIONS" in os.environ or "build-asan" in os.environ.get("CUBETORCHFS_BIN", "")


def dir_name(d: int) -> str:
    return f"n{d:08d}"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def store_requests(mount) -> float:
    return mount.metrics().value("cubetorchfs_backend_requests_total")


def read_all(paths: list[str]) -> int:
    def read(p: str) -> int:
        with open(p, "rb") as fh:
            return len(fh.read())
    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(read, paths, chunksize=256))


def drop_kernel_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2\n")  # dentries and inodes


@pytest.mark.skipif(os.geteuid() != 0, reason="drop_caches needs root")
def test_a_200k_file_namespace(cube: CubeFactory, tmp_path: Path) -> None:
    began = time.monotonic()
    mount = cube.mount(tmp_path, {
        "profile": "ai_prefetch",
        "backend": {"type": "synthetic", "root": None,
                    "synthetic": {"dirs": DIRS, "files_per_dir": PER_DIR,
                                  "min_bytes": 64, "max_bytes": 512}},
        "cache": {"memory_bytes": "256MiB"},
    })
    pid = mount.learn_pid()
    assert pid, "no daemon pid"
    assert mount.metrics().value("cubetorchfs_inodes") == 1  # the root
    rss0 = rss_bytes(pid)

    # The scan: the root, then every directory in name order, as ImageFolder does. Listing the
    # root lists its directories ahead of the scan (fuse.list_ahead).
    assert len(os.listdir(mount.path(""))) == DIRS
    names = {}
    for d in range(DIRS):
        names[d] = sorted(os.listdir(mount.path(dir_name(d))))
    assert sum(len(v) for v in names.values()) == FILES
    known = mount.metrics().value("cubetorchfs_inodes")
    assert FILES + DIRS <= known <= FILES + DIRS + 1, known
    m = mount.metrics()
    taken = m.value("cubetorchfs_list_ahead_total", outcome="taken")
    # Most listings were made ahead (a scan that catches up with the listers lists itself).
    assert taken >= DIRS / 2, m.text
    assert m.value("cubetorchfs_backend_requests_total", op="list") <= DIRS + 1 + 16, m.text
    per_file = (rss_bytes(pid) - rss0) / FILES
    print(f"scan of {FILES:,} files: {known:,.0f} inodes known, daemon RSS "
          f"{rss0 >> 20} -> {rss_bytes(pid) >> 20} MiB, {per_file:.0f} bytes per known file")
    if not SANITIZED:  # a sanitizer's shadow memory and redzones are not the daemon's own
        assert per_file <= BYTES_PER_KNOWN_FILE, f"{per_file:.0f} bytes per known file"

    # Two epochs over a subset: the second makes no store request at all.
    subset = [str(mount.path(f"{dir_name(d)}/{n}")) for d in range(EPOCH_DIRS) for n in names[d]]
    before = store_requests(mount)
    first = read_all(subset)
    epoch1 = store_requests(mount) - before
    assert epoch1 >= len(subset), epoch1  # every file read from the store once
    before = store_requests(mount)
    assert read_all(subset) == first
    m = mount.metrics()
    assert store_requests(mount) - before == 0, m.text
    print(f"epochs over {len(subset):,} files: {epoch1:,.0f} store requests, then 0")

    # The kernel forgets its dentries and inodes: the table follows.
    drop_kernel_caches()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = mount.metrics().value("cubetorchfs_inodes")
        if left < known / 10:
            break
        time.sleep(0.2)
    assert left < known / 10, f"{left:,.0f} of {known:,.0f} inodes left after the kernel forgot"
    print(f"after drop_caches: {left:,.0f} inodes known; whole test {time.monotonic() - began:.1f} s")

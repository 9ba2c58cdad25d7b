"""Prefetched files pushed into the kernel's page cache (FUSE_NOTIFY_STORE) through a real
mount: a published file the kernel knows is read with no READ request reaching the daemon, the
readers passing it count as hits, and a file whose pages were dropped before its read is read
from the daemon and counted as the miss it is, never as a hit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import CubeFactory, UnixHTTPConnection, call, environment_problem, wait_until
from test_control_api import make_tree, publish as publish_paths, start, stats

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")


def fuse_reads(mount: Any) -> float:
    return mount.metrics().value("cubetorchfs_fuse_ops_total", op="read")


def reads(mount: Any, result: str) -> float:
    return mount.metrics().value("cubetorchfs_reads_total", result=result)


def drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_prefetched_file_is_read_from_the_page_cache_with_no_read_request(
        cube: CubeFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_tree(src, 60, size=20_000)
    # evict_after_read: the daemon keeps no copy of a file once the kernel has it, so a read
    # of one whose pages were dropped is fetched again, a miss. (By default the LRU cache
    # keeps the copy, and such a read is a hit from RAM, counted as a page drop.)
    mount, sock, _ = start(cube, src, latency_us=2000, evict_after_read=True)
    # The scan a dataset makes: the kernel learns every inode (readdirplus).
    for d in sorted(mount.path().iterdir()):
        for e in os.scandir(d):
            e.stat()
    paths = [str(mount.path(str(f.relative_to(src)))) for f in files]
    conn = UnixHTTPConnection(sock)
    status, body = call(conn, "POST", "/v1/streams", {"name": "epoch", "pid": os.getpid()})
    assert status == 201, body
    sid = json.loads(body)["id"]

    def publish(batch: list[str], unread: int) -> None:
        status, body = call(conn, "POST", f"/v1/streams/{sid}/paths",
                            {"paths": batch, "unread": unread})
        assert status == 202, body

    publish(paths, unread=len(paths))

    def prefetch() -> dict[str, Any]:
        return stats(sock)["global"]["prefetch"]
    assert wait_until(lambda: prefetch()["stored"] == 60 and prefetch()["inflight"] == 0, 30), \
        prefetch()
    # The daemon keeps no copy: the kernel has the bytes.
    assert prefetch()["window_bytes"] == 0, prefetch()
    before = fuse_reads(mount)
    hits_before = reads(mount, "hit")
    for f, p in zip(files[10:], paths[10:]):
        assert Path(p).read_bytes() == f.read_bytes()
    assert fuse_reads(mount) == before, "a stored file's read reached the daemon"
    assert mount.metrics().value("cubetorchfs_backend_requests_total", op="read",
                                 status="ok") == 60

    # Ten lose their pages before their read: each read reaches the daemon and is fetched
    # again from the store, a miss; none is counted as a hit, then or when the readers pass.
    misses_before = reads(mount, "miss")
    for p in paths[:10]:
        drop_pages(p)
    for f, p in zip(files[:10], paths[:10]):
        assert Path(p).read_bytes() == f.read_bytes()
    assert fuse_reads(mount) >= before + 10
    assert reads(mount, "miss") - misses_before == 10
    assert reads(mount, "hit") == hits_before
    # The publisher says the readers are past all 60, and went on over the same files again
    # (20 times, all of them held by the kernel): every position passed with no read reaching
    # the daemon had the file's pages in the kernel, a hit; the ten reads that reached the
    # daemon consumed their own positions.
    publish(paths * 20, unread=1)
    publish(paths[:1], unread=1)  # a publish moves the readers' mark up to what came before it
    s = stats(sock)
    stream = [x for x in s["streams"] if x["id"] == sid][0]
    assert stream["reads"]["miss"] == 10 and stream["read"] == 10, stream
    assert stream["page_cache"] == 1250 and stream["reads"]["hit"] == 1250, stream
    assert stream["skipped"] == 0, stream
    assert reads(mount, "hit") - hits_before == 1250
    # The repeated files were in the kernel: none fetched again, and none read into the LRU
    # cache. The ten drops were of files the window held for their readers, not of files the
    # stream passed over as held: no page pressure.
    pf = s["global"]["prefetch"]
    assert pf["fetched"] == 60, pf
    assert not pf["page_pressure"] and pf["lru_filled"] == 0, pf
    # Each store read has its reason: the 60 prefetched ahead, and the ten misses.
    assert pf["store_reads"] == {"window": 60, "lru_fill": 0}, pf
    m = mount.metrics()
    assert m.value("cubetorchfs_prefetch_store_reads_total", reason="window") == 60
    assert m.value("cubetorchfs_prefetch_store_reads_total", reason="lru_fill") == 0
    assert m.value("cubetorchfs_backend_requests_total", op="read", status="ok") == 70


def test_a_file_the_kernel_does_not_know_is_served_from_the_window(
        cube: CubeFactory, tmp_path: Path) -> None:
    """No scan: the kernel has no inode to put the pages in, so the file waits in the window
    and its read reaches the daemon as before, a hit."""
    src = tmp_path / "src"
    files = make_tree(src, 8, size=20_000)
    mount, sock, _ = start(cube, src, latency_us=2000)
    paths = [str(mount.path(str(f.relative_to(src)))) for f in files]
    publish_paths(sock, paths)
    assert wait_until(lambda: stats(sock)["global"]["prefetch"]["fetched"] == 8, timeout=30)
    assert stats(sock)["global"]["prefetch"]["stored"] == 0
    for f, p in zip(files, paths):
        assert Path(p).read_bytes() == f.read_bytes()
    assert reads(mount, "hit") >= 8 and reads(mount, "miss") == 0


def test_a_kill_9_while_stores_race_the_readers_never_hangs_the_mount(
        cube: CubeFactory, tmp_path: Path) -> None:
    """Readers read the files the prefetcher is putting into the page cache at that moment:
    a store waits for the page lock a read holds until the read is answered. A kill -9 then
    must not leave the dead daemon unable to end (its store waiting on a read nobody answers)
    and the mount hung: three times, the next daemon serves within 15 s and every reader
    reads every file whole."""
    import threading

    src = tmp_path / "src"
    files = make_tree(src, 2000, size=12_000)
    mount, sock, _ = start(cube, src, latency_us=1000, max_inflight=32)
    for d in sorted(mount.path().iterdir()):  # the kernel learns every inode (readdirplus)
        for e in os.scandir(d):
            e.stat()
    paths = [str(mount.path(str(f.relative_to(src)))) for f in files]
    want = {p: f.read_bytes() for f, p in zip(files, paths)}
    failures: list[str] = []
    done = [0]
    lock = threading.Lock()

    def reader(k: int) -> None:
        for p in paths[k::4]:
            for _ in range(200):  # a read the dead daemon failed is read again
                try:
                    data = Path(p).read_bytes()
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                failures.append(p)
                continue
            if data != want[p]:
                failures.append(p)
            with lock:
                done[0] += 1

    for round_ in range(3):
        for p in paths:  # the pages go, the inodes stay: every file is stored again
            drop_pages(p)
        publish_paths(sock, paths, name=f"round{round_}")
        threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(4)]
        done[0] = 0
        for t in threads:
            t.start()
        assert wait_until(lambda: done[0] >= 300, 60), "the readers made no progress"
        pid = mount.read_control()["pid"]
        os.kill(pid, signal.SIGKILL)

        def served() -> bool:
            # In a child with a time limit: a hung mount fails the test, never hangs it.
            try:
                return mount.read_control().get("pid") != pid and subprocess.run(
                    ["stat", str(mount.path("class_0"))], capture_output=True,
                    timeout=2).returncode == 0
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return False
        assert wait_until(served, 15), f"no daemon serves 15 s after kill -9 number {round_ + 1}"
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a reader hung after the kill"
        assert failures == [], failures[:5]
        sock = mount.read_control()["control_socket"]

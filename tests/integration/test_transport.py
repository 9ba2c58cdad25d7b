"""The FUSE transports (docs/operations.md): /dev/fuse and FUSE over io_uring, through real
mounts. The io_uring tests turn the kernel's enable_uring on for themselves (root) and back off
after; they skip with one line where the kernel has no FUSE over io_uring (Linux 6.14+)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import test_fleet as fleet
from cubefs_harness import (BINARY, CubeFactory, CubeMount, environment_problem, run_command,
                            wait_until)

pytestmark = pytest.mark.skipif(environment_problem() is not None,
                                reason=environment_problem() or "")

URING_PARAM = Path("/sys/module/fuse/parameters/enable_uring")
store = fleet.store  # the training data set of test_fleet.py (a module fixture)


def set_uring(value: str) -> None:
    URING_PARAM.write_text(value + "\n")


@pytest.fixture
def uring() -> Iterator[None]:
    """The kernel offers FUSE over io_uring for the test; enable_uring is restored after."""
    if not URING_PARAM.exists():
        pytest.skip("this kernel has no FUSE over io_uring (Linux 6.14+ with CONFIG_FUSE_IO_URING)")
    before = URING_PARAM.read_text().strip()
    try:
        set_uring("Y")
    except OSError as e:
        pytest.skip(f"cannot turn FUSE over io_uring on ({e}): needs root")
    try:
        yield
    finally:
        set_uring(before)


def transport(mount: CubeMount) -> str:
    r = run_command([str(BINARY), "status", str(mount.mountpoint), "--json"], env=mount.env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["transport"]


def make_tree(root: Path, files: int = 200) -> dict[str, str]:
    digests = {}
    for i in range(files):
        p = root / f"d{i % 4}" / f"f{i:04d}"
        p.parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(1000 + 397 * i)
        p.write_bytes(data)
        digests[str(p.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return digests


def log_text(mount: CubeMount) -> str:
    return "".join(p.read_text(errors="replace") for p in (mount.workdir / "log").glob("*"))


def test_a_mount_on_io_uring_reads_writes_and_renames(cube: CubeFactory, tmp_path: Path,
                                                      uring: None) -> None:
    root = tmp_path / "store"
    digests = make_tree(root)
    mount = cube.mount(root, {"fuse": {"io_uring": "on"}})
    assert transport(mount) == "io_uring"
    assert "serving through FUSE over io_uring" in log_text(mount)
    for rel, sha in digests.items():
        assert hashlib.sha256(mount.path(rel).read_bytes()).hexdigest() == sha, rel
    big = os.urandom(9 << 20)  # more than one max_read request each way
    mount.path("big.bin").write_bytes(big)
    assert mount.path("big.bin").read_bytes() == big
    assert (root / "big.bin").read_bytes() == big
    mount.path("newdir").mkdir()
    mount.path("big.bin").rename(mount.path("newdir/moved.bin"))
    assert (root / "newdir" / "moved.bin").stat().st_size == len(big)
    mount.path("newdir/moved.bin").unlink()
    mount.path("newdir").rmdir()
    assert not (root / "newdir").exists()
    with pytest.raises(FileNotFoundError):
        mount.path("no/such/file").read_bytes()


@contextlib.contextmanager
def reading(mount: CubeMount, digests: dict[str, str], threads: int, what: str
            ) -> Iterator[tuple[dict[str, int], list[int]]]:
    """Threads that read the files in turn, checking every byte, until the block ends; then
    each must finish within 30 s (none hangs)."""
    rels = sorted(digests)
    errors: dict[str, int] = {}
    done = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def run(k: int) -> None:
        i = k
        while not stop.is_set():
            rel = rels[i % len(rels)]
            try:
                data = mount.path(rel).read_bytes()
                assert hashlib.sha256(data).hexdigest() == digests[rel], rel
                with lock:
                    done[0] += 1
            except OSError as e:
                with lock:
                    name = errno.errorcode.get(e.errno or 0, str(e.errno))
                    errors[name] = errors.get(name, 0) + 1
            i += 7

    ts = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(threads)]
    for t in ts:
        t.start()
    try:
        yield errors, done
    finally:
        stop.set()
        for t in ts:
            t.join(timeout=30)
    assert not any(t.is_alive() for t in ts), f"a reader hangs after {what} on io_uring"


def test_upgrades_under_load_on_io_uring_fail_no_read(cube: CubeFactory, tmp_path: Path,
                                                      uring: None) -> None:
    """An upgrade drains the io_uring queues into the entries' memfd; the next binary answers
    the requests it finds there: no read fails, none hangs."""
    root = tmp_path / "store"
    digests = make_tree(root)
    mount = cube.mount(root, {"fuse": {"io_uring": "on"}})
    with reading(mount, digests, 8, "an upgrade") as (errors, done):
        for k in range(3):
            time.sleep(0.7)
            r = fleet.upgrade(mount)
            assert r.returncode == 0 and "upgraded" in r.stdout, (r.stdout, r.stderr)
            assert mount.read_control()["generation"] == k + 1
        time.sleep(0.5)
    assert errors == {} and done[0] > 100, (errors, done)
    assert transport(mount) == "io_uring"
    assert "io_uring entries of the process before" in log_text(mount)


def test_kill_9_on_io_uring_hangs_no_reader(cube: CubeFactory, tmp_path: Path,
                                            uring: None) -> None:
    """A crash: the requests the dead process had been given and not taken are answered by the
    next one (from the entries' memfd), so no reader waits forever; a read in flight may fail
    as the kernel decides (docs/operations.md)."""
    root = tmp_path / "store"
    digests = make_tree(root)
    mount = cube.mount(root, {"fuse": {"io_uring": "on"}})
    with reading(mount, digests, 8, "a kill -9") as (errors, done):
        for _ in range(2):
            time.sleep(0.7)
            fleet.kill_daemon(mount)
        time.sleep(1.0)
        before = done[0]
        time.sleep(0.5)
        assert done[0] > before, "no read completes after the restarts"
    # The in-flight reads of each crash (8 readers), as on /dev/fuse: the kernel fails a request
    # given to the dying process's queue with ECANCELED; an inode of the dead process is ESTALE.
    assert set(errors) <= {"ECANCELED", "ESTALE", "ECONNABORTED", "ENOTCONN"}, errors
    assert sum(errors.values()) <= 2 * 3 * 8, errors


def test_training_on_io_uring_across_an_upgrade_and_a_kill_9(
        cube: CubeFactory, store: dict[str, Any], tmp_path: Path, uring: None) -> None:
    """An unmodified DataLoader loop (2 workers, the hook): the upgrade loses no sample, the
    crash at most those in flight, and the loop never hangs."""
    mount = cube.mount(store["root"], {"fuse": {"io_uring": "on"}})
    assert transport(mount) == "io_uring"
    with fleet.training(mount, tmp_path, epochs=2, pause=0.03) as (proc, progress):
        fleet.wait_for_batches(proc, progress, 10, "the upgrade")
        r = fleet.upgrade(mount)
        assert r.returncode == 0 and "upgraded" in r.stdout, (r.stdout, r.stderr)
        fleet.wait_for_batches(proc, progress, 30, "the crash")
        fleet.kill_daemon(mount)
        result = fleet.finish(proc)
    errors = fleet.check_samples(result, store["digests"], 2)
    assert errors[0] <= 2 * (2 * 2 * fleet.BATCH) and errors[1] == 0, errors
    assert mount.read_control()["generation"] == 2


def test_io_uring_on_fails_clearly_where_the_kernel_does_not_offer_it(
        cube: CubeFactory, tmp_path: Path) -> None:
    if not URING_PARAM.exists():
        pytest.skip("this kernel has no FUSE over io_uring (Linux 6.14+ with CONFIG_FUSE_IO_URING)")
    before = URING_PARAM.read_text().strip()
    root = tmp_path / "store"
    make_tree(root, files=3)
    try:
        set_uring("N")
        refused = cube.prepare(root, {"fuse": {"io_uring": "on"}})
        r = cube.launch(refused)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert "fuse.io_uring is on but the kernel does not offer FUSE over io_uring" in r.stderr
        assert not refused.is_mounted()
        auto = cube.mount(root)  # the default, auto: /dev/fuse where io_uring is not offered
        assert transport(auto) == "/dev/fuse"
        set_uring("Y")
        off = cube.mount(root, {"fuse": {"io_uring": "off"}})
        assert transport(off) == "/dev/fuse"
        on = cube.mount(root)  # auto, now offered
        assert transport(on) == "io_uring"
        bad = cube.prepare(root, {"fuse": {"io_uring": "sometimes"}})
        r = cube.launch(bad)
        assert r.returncode == 2 and "fuse.io_uring" in r.stderr, r.stderr
    finally:
        set_uring(before)


def test_an_upgrade_to_a_binary_without_io_uring_is_abandoned(cube: CubeFactory, tmp_path: Path,
                                                               uring: None) -> None:
    """A binary that does not serve io_uring mounts would read /dev/fuse while every request
    waits in the queues: the supervisor asks it first and goes on with the running version."""
    root = tmp_path / "store"
    digests = make_tree(root, files=20)
    installed = tmp_path / "bin" / "cubetorchfs"
    installed.parent.mkdir()
    shutil.copy2(BINARY, installed)
    mount = cube.prepare(root, {"fuse": {"io_uring": "on"}})
    r = subprocess.run([str(installed), "-c", str(mount.config_path), str(mount.mountpoint)],
                       env=mount.env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert mount.wait_ready()
    mount.learn_pid()
    assert transport(mount) == "io_uring"
    # An "older" binary: it runs, but knows nothing of io_uring.
    installed.unlink()
    installed.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo cubetorchfs 0.0.9; exit 0; }\n"
                         "exit 1\n")
    installed.chmod(0o755)
    first = mount.read_control()["pid"]
    fleet.upgrade(mount)
    assert wait_until(lambda: mount.read_control().get("pid") != first, 30)
    assert "cannot serve a mount on FUSE over io_uring" in log_text(mount)
    assert transport(mount) == "io_uring"
    for rel, sha in digests.items():
        assert hashlib.sha256(mount.path(rel).read_bytes()).hexdigest() == sha, rel

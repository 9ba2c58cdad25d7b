"""The CubeFS datanodes of the live cluster stop for 30 s (SIGSTOP: a partition, or nodes hung)
under a mount of the volume through CubeFS's SDK (backend.type cubefs). What is cached is
served; the rest waits on the SDK's own timeouts and retries; when the datanodes answer again
the same mount reads again, with no remount."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cluster import RUN_DIR, Cluster
from cubefs_harness import CubeFactory, bounded, run_command, BINARY, wait_until

OUTAGE_S = 30
FILES = 40


def datanode_pids() -> list[int]:
    pids = []
    for line in (RUN_DIR / "pids").read_text().splitlines():
        name, _, pid = line.partition(" ")
        if name.startswith("data"):  # data1..data3 (cluster.sh)
            pids.append(int(pid))
    return pids


def test_datanodes_stopped_for_30_s(cube: CubeFactory, cluster: Cluster, cfs_mount: Path,
                                    tmp_path: Path) -> None:
    base = cfs_mount / "outage"
    base.mkdir(exist_ok=True)
    want: dict[str, str] = {}
    for i in range(FILES):
        data = os.urandom(64 * 1024 + i)
        (base / f"f{i:02d}.bin").write_bytes(data)
        want[f"f{i:02d}.bin"] = hashlib.sha256(data).hexdigest()
    mount = cube.mount(tmp_path, cluster.native_config())
    for i in range(FILES // 2):  # the first half is cached
        assert hashlib.sha256(mount.path(f"outage/f{i:02d}.bin").read_bytes()).hexdigest() \
            == want[f"f{i:02d}.bin"]
    pids = datanode_pids()
    assert len(pids) == 3
    outcome: dict[str, Any] = {}

    def read_uncached() -> None:
        start = time.monotonic()
        try:
            data = mount.path(f"outage/f{FILES - 1:02d}.bin").read_bytes()
            outcome["result"] = hashlib.sha256(data).hexdigest() == want[f"f{FILES - 1:02d}.bin"]
        except OSError as e:
            outcome["result"] = os.strerror(e.errno or 0)
        outcome["seconds"] = time.monotonic() - start

    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    reader = threading.Thread(target=read_uncached, daemon=True)
    try:
        start = time.monotonic()
        for i in range(FILES // 2):  # cached: served at once
            assert hashlib.sha256(mount.path(f"outage/f{i:02d}.bin").read_bytes()).hexdigest() \
                == want[f"f{i:02d}.bin"]
        assert time.monotonic() - start < 2.0
        reader.start()
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped)))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        cluster.wait_writable()  # so that the tests after this one can write
    reader.join(120)
    assert not reader.is_alive(), "a read still waits 2 minutes after the datanodes came back"
    # While they were down the read waited (the SDK retries) or failed with EIO; never wrong bytes.
    assert outcome["result"] in (True, os.strerror(5)), outcome
    # The same mount reads everything again, with no remount.
    for i in range(FILES // 2, FILES):
        got = bounded(mount.path(f"outage/f{i:02d}.bin").read_bytes, timeout=120,
                      what="read after the datanodes came back")
        assert hashlib.sha256(got).hexdigest() == want[f"f{i:02d}.bin"]
    status = run_command([str(BINARY), "status", str(mount.mountpoint)], env=mount.env())
    assert status.returncode == 0, status
    print(f"cubefs outage: the uncached read gave {outcome['result']!r} after "
          f"{outcome['seconds']:.1f} s (datanodes down {OUTAGE_S} s)")

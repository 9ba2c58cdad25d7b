"""A store that stops answering for 30 s in the middle of an epoch, and comes back: an S3 server
frozen with SIGSTOP (connections stay open, no answer comes: what a hung or partitioned store
looks like). What is cached is served; the rest fails with EIO after the backend's timeout and
retries; the outage is logged once, naming the store; `cubetorchfs status` says so; when the
store answers again, reads, the hook and prefetching go on without a remount."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from cubefs_harness import (BINARY, CubeFactory, CubeMount, bounded, environment_problem,
                            errno_of, run_command, wait_until)
from s3_testlib import S3Server, s3_server_problem
from test_fleet import batches_done, finish, start_training
from test_s3 import mount_s3

_problem = environment_problem() or s3_server_problem()
pytestmark = pytest.mark.skipif(_problem is not None, reason=_problem or "")

OUTAGE_S = 30
FILES = 160
TIMEOUT_MS = 1000
RETRIES = 1


def status(mount: CubeMount) -> Any:
    return run_command([str(BINARY), "status", str(mount.mountpoint)], env=mount.env(),
                       timeout=60)


def log_text(mount: CubeMount) -> str:
    return "\n".join(p.read_text(errors="replace") for p in mount.workdir.rglob("*.log"))


def test_s3_store_stopped_for_30_s_mid_epoch(cube: CubeFactory, tmp_path: Path) -> None:
    server = S3Server(tmp_path / "s3").start()
    frozen = False
    try:
        client = server.client()
        client.create_bucket("outage")
        digests: dict[str, int] = {}
        for i in range(FILES):
            data = os.urandom(30_000 + i)
            client.put("outage", f"train/c{i % 4}/f{i:03d}.bin", data)
            digests[hashlib.sha256(data).hexdigest()] = i
        # A file no one reads or prefetches before the outage.
        aside = os.urandom(40_000)
        client.put("outage", "aside/never-read.bin", aside)
        client.close()
        mount = mount_s3(cube, tmp_path, server.endpoint, "outage",
                         timeout_ms=TIMEOUT_MS, retries=RETRIES)
        cached = mount.path("train/c0/f000.bin")
        cached_bytes = cached.read_bytes()
        assert status(mount).returncode == 0

        proc, progress = start_training(mount, tmp_path, epochs=2, pause=0.05)
        try:
            assert wait_until(lambda: batches_done(progress) >= 3 or proc.poll() is not None, 60)
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            os.kill(server.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            frozen = True
            stopped = time.monotonic()

            # What is cached is served. Its attributes may have expired: then the first request
            # to find the store silent waits for the timeout and the retries, once.
            one_timeout_s = (RETRIES + 1) * TIMEOUT_MS / 1000 * 4 + 5
            start = time.monotonic()
            assert cached.read_bytes() == cached_bytes
            first_cached_s = time.monotonic() - start
            assert first_cached_s < one_timeout_s, first_cached_s
            # What is not fails with EIO once the timeout and the retries are spent.
            start = time.monotonic()
            err = errno_of(lambda: bounded(mount.path("aside/never-read.bin").read_bytes,
                                           timeout=60, what="read while the store is down"))
            took = time.monotonic() - start
            assert err == errno.EIO, err
            assert took < one_timeout_s, took
            # The outage is known now: what is cached is served at once, its attributes expired
            # or not (no request waits for a store that does not answer).
            time.sleep(2)  # past the default profile's attribute timeout (1 s)
            start = time.monotonic()
            assert cached.read_bytes() == cached_bytes
            known_cached_s = time.monotonic() - start
            assert known_cached_s < 1.0, known_cached_s
            # Health says so, naming the store.
            down = status(mount)
            assert down.returncode == 1 and "NOT reachable" in down.stdout, down
            assert server.endpoint in down.stdout, down.stdout

            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped)))
            os.kill(server.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
            frozen = False
            back = time.monotonic()
            # The same mount reads again: no remount.
            data = bounded(mount.path("aside/never-read.bin").read_bytes, timeout=60,
                           what="read after the store came back")
            first_read_s = time.monotonic() - back
            assert data == aside
            assert wait_until(lambda: status(mount).returncode == 0, 30)
            result = finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

        # The epoch went on: every sample it read is the store's, and it failed only what it
        # asked for while the store was down.
        errors = [0, 0]
        seen: list[set[int]] = [set(), set()]
        for epoch, sha in result["samples"]:
            if isinstance(sha, dict):
                continue
            if sha.startswith("error:"):
                assert sha == "error:" + os.strerror(errno.EIO), sha
                errors[epoch] += 1
            else:
                assert sha in digests
                seen[epoch].add(digests[sha])
        assert len(seen[0]) + errors[0] == FILES and errors[0] < FILES
        # After it: no error, and the hook and prefetching are back.
        assert errors[1] == 0 and len(seen[1]) == FILES, errors
        second = next(s for e, s in result["samples"] if e == 1 and isinstance(s, dict))
        published = second["after"]["client"]["published"] - second["before"]["client"]["published"]
        assert published >= FILES - 32, second
        before, after = second["before"]["global"]["reads"], second["after"]["global"]["reads"]
        total = sum(after[k] - before[k] for k in ("hit", "late", "miss"))
        assert total > 0 and (after["hit"] - before["hit"]) / total >= 0.9, (before, after)

        # Logged once per outage, naming the store; and once when it came back.
        log = log_text(mount)
        assert log.count("does not answer") == 1, log[-3000:]
        assert f"store {server.endpoint}/outage does not answer" in log
        assert log.count("answers again") == 1
        print(f"outage: cached read {first_cached_s:.2f} s at its start, "
              f"{known_cached_s:.3f} s once known; EIO after {took:.1f} s; store back, "
              f"first read {first_read_s:.2f} s; samples failed per epoch {errors}")
    finally:
        if frozen and server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()

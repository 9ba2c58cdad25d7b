"""A real CubeFS cluster on loopback for the tests of tests/cubefs: started once per session with
cluster.sh (../shared/cubefs beside the repository, or the directory above $CUBEFS_BIN), always
stopped, and its run directory removed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
RUN_DIR = Path("/tmp/cubetorchfs-cubefs-tests")  # fixed: a crashed session's cluster is found
START_TIMEOUT_S = 240
STOP_TIMEOUT_S = 120


def cluster_script() -> Optional[Path]:
    """cluster.sh of the CubeFS to test against, or None."""
    candidates = []
    if os.environ.get("CUBEFS_BIN"):
        candidates.append(Path(os.environ["CUBEFS_BIN"]).resolve().parent / "cluster.sh")
    candidates.append(REPO.parent / "shared" / "cubefs" / "cluster.sh")
    for c in candidates:
        if c.is_file():
            return c
    return None


def cubefs_problem() -> Optional[str]:
    """Why no CubeFS cluster can run here, or None."""
    if cluster_script() is None:
        return ("no CubeFS to test against: ../shared/cubefs/cluster.sh is missing and "
                "CUBEFS_BIN is not set")
    if os.geteuid() != 0:
        return "a CubeFS cluster needs root"
    return None


class Cluster:
    """master, 3 metanodes, 3 datanodes and the ObjectNode (S3 on 17410), volume ltptest."""

    def __init__(self) -> None:
        script = cluster_script()
        assert script is not None
        self.script = script
        self.env: dict[str, str] = {}
        self.cfs_mounts: list[Path] = []

    def _run(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(self.script), *args], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def start(self) -> "Cluster":
        if (RUN_DIR / "pids").exists():  # left by a session that died: stop it first
            self._run("stop", str(RUN_DIR), timeout=STOP_TIMEOUT_S)
        shutil.rmtree(RUN_DIR, ignore_errors=True)
        r = self._run("start", str(RUN_DIR), timeout=START_TIMEOUT_S)
        if r.returncode != 0:
            self.stop()
            raise RuntimeError(f"cluster.sh start failed ({r.returncode}): {r.stderr[-2000:]}")
        out = self._run("env", str(RUN_DIR), timeout=60).stdout
        for line in out.splitlines():
            if line.startswith("export ") and "=" in line:
                k, _, v = line[len("export "):].partition("=")
                self.env[k] = v
        for k in ("CUBEFS_S3_ENDPOINT", "CUBEFS_ACCESS_KEY", "CUBEFS_SECRET_KEY", "CUBEFS_VOL"):
            if not self.env.get(k):
                self.stop()
                raise RuntimeError(f"cluster.sh env gave no {k}: {out!r}")
        return self

    def mount_cfs_client(self, mountpoint: Path) -> Path:
        """The volume through CubeFS's own FUSE client (unmounted by stop)."""
        mountpoint.mkdir(parents=True, exist_ok=True)
        r = self._run("mount", str(mountpoint), str(RUN_DIR), timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"cluster.sh mount failed: {r.stderr[-2000:]}")
        self.cfs_mounts.append(mountpoint)
        return mountpoint

    def stop(self) -> None:
        try:
            self._run("stop", str(RUN_DIR), timeout=STOP_TIMEOUT_S)
        finally:
            for m in self.cfs_mounts:  # should stop have left one behind
                subprocess.run(["fusermount3", "-u", "-z", str(m)], capture_output=True,
                               timeout=30)
            shutil.rmtree(RUN_DIR, ignore_errors=True)

    def data_partition_states(self) -> list[int]:
        """The status the master gives each data partition of the volume (2: read-write)."""
        url = (f"http://{self.env['CUBEFS_MASTER'].split(',')[0]}/client/partitions"
               f"?name={self.bucket}")
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.load(resp)
        return [dp["Status"] for dp in (body.get("data") or {}).get("DataPartitions") or []]

    def wait_writable(self, timeout: float = 120.0) -> None:
        """Waits (bounded) until the master gives every data partition of the volume as
        read-write again. After datanodes stop answering the master marks their partitions
        unavailable, and a CubeFS client started before it sees the heartbeats again takes that
        view for its first minute: every write fails with EIO ("no writable data partition").
        A test that stops datanodes calls this before the next test writes."""
        deadline = time.monotonic() + timeout
        states: list[int] = []
        while time.monotonic() < deadline:
            try:
                states = self.data_partition_states()
            except OSError:
                states = []
            if states and all(s == 2 for s in states):
                return
            time.sleep(0.5)
        raise AssertionError(f"the volume's data partitions are not all read-write {timeout:.0f} s "
                             f"after the datanodes came back: {states}")

    @property
    def s3_port(self) -> int:
        return int(self.env["CUBEFS_S3_ENDPOINT"].rsplit(":", 1)[1])

    @property
    def bucket(self) -> str:
        return self.env["CUBEFS_VOL"]

    def native_config(self) -> dict[str, object]:
        """The keys of a cubetorchfs config for the volume through libcfs.so (backend.type
        cubefs): the CubeFS client's own keys at the top level, the library beside cluster.sh."""
        lib = self.script.parent / "bin" / "libcfs.so"
        return {"masterAddr": self.env["CUBEFS_MASTER"], "owner": self.env["CUBEFS_OWNER"],
                "accessKey": self.env["CUBEFS_ACCESS_KEY"],
                "secretKey": self.env["CUBEFS_SECRET_KEY"],
                "backend": {"type": "cubefs", "root": None,
                            "cubefs": {"lib": str(lib), "volume": self.bucket}}}

    def s3_backend(self, **extra: object) -> dict[str, object]:
        """The backend section of a cubetorchfs config for the ObjectNode."""
        backend: dict[str, object] = {
            "type": "s3", "root": None, "endpoint": self.env["CUBEFS_S3_ENDPOINT"],
            "bucket": self.bucket, "region": "cfs_dev",
            "access_key": self.env["CUBEFS_ACCESS_KEY"],
            "secret_key": self.env["CUBEFS_SECRET_KEY"]}
        backend.update(extra)
        return backend

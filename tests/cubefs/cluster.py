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
from typing import Any, Optional

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


FLASH_NODES = ("127.0.0.1:18110", "127.0.0.1:18210")  # cluster.sh --flash; prof port = +1
FLASH_VIEW_REFRESH_S = 65  # CubeFS's clients and flashnodes ask the master again every minute


class Cluster:
    """master, 3 metanodes, 3 datanodes and the ObjectNode (S3 on 17410), volume ltptest; with
    `flash`, also CubeFS's distributed cache: 2 flashnodes, remote cache on for ltptest."""

    def __init__(self, flash: bool = False, run_dir: Path = RUN_DIR) -> None:
        script = cluster_script()
        assert script is not None
        self.script = script
        self.flash = flash
        self.run_dir = run_dir
        self.env: dict[str, str] = {}
        self.cfs_mounts: list[Path] = []
        self.flash_groups_changed: Optional[float] = None  # time.monotonic() of the change

    def _run(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(self.script), *args], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def start(self) -> "Cluster":
        if (self.run_dir / "pids").exists():  # left by a session that died: stop it first
            self._run("stop", str(self.run_dir), timeout=STOP_TIMEOUT_S)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        for attempt in (1, 2):
            r = self._run("start", str(self.run_dir), *(["--flash"] if self.flash else []),
                          timeout=START_TIMEOUT_S)
            if r.returncode == 0:
                break
            # Seen now and then right after another cluster stopped: "volume creation failed"
            # for its whole minute. A second start from scratch has gone through each time.
            self.stop()
            if attempt == 2:
                raise RuntimeError(f"cluster.sh start failed ({r.returncode}): {r.stderr[-2000:]}")
        out = self._run("env", str(self.run_dir), timeout=60).stdout
        for line in out.splitlines():
            if line.startswith("export ") and "=" in line:
                k, _, v = line[len("export "):].partition("=")
                self.env[k] = v
        for k in ("CUBEFS_S3_ENDPOINT", "CUBEFS_ACCESS_KEY", "CUBEFS_SECRET_KEY", "CUBEFS_VOL"):
            if not self.env.get(k):
                self.stop()
                raise RuntimeError(f"cluster.sh env gave no {k}: {out!r}")
        if self.flash:
            try:
                self.flash_group_per_node()
            except Exception:
                self.stop()
                raise
        return self

    def mount_cfs_client(self, mountpoint: Path) -> Path:
        """The volume through CubeFS's own FUSE client (unmounted by stop)."""
        mountpoint.mkdir(parents=True, exist_ok=True)
        r = self._run("mount", str(mountpoint), str(self.run_dir), timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"cluster.sh mount failed: {r.stderr[-2000:]}")
        self.cfs_mounts.append(mountpoint)
        return mountpoint

    def stop(self) -> None:
        try:
            self._run("stop", str(self.run_dir), timeout=STOP_TIMEOUT_S)
        finally:
            for m in self.cfs_mounts:  # should stop have left one behind
                subprocess.run(["fusermount3", "-u", "-z", str(m)], capture_output=True,
                               timeout=30)
            shutil.rmtree(self.run_dir, ignore_errors=True)

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

    # --- the distributed cache (flash=True)

    def cli(self, *args: str, timeout: float = 30) -> str:
        """cfs-cli against this cluster; raises with its output if it fails."""
        r = subprocess.run([str(self.script.parent / "bin" / "cfs-cli"), *args],
                           capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, env=dict(os.environ,
                                                              HOME=str(self.run_dir / "clihome")))
        if r.returncode != 0 or "Error" in r.stdout + r.stderr:
            raise RuntimeError(f"cfs-cli {' '.join(args)}: {(r.stdout + r.stderr)[-1000:]}")
        return r.stdout

    def flash_group_per_node(self) -> None:
        """Puts each flashnode in a FlashGroup of its own. cluster.sh puts both in one group,
        whose members a client takes in turn, each filling its own copy of a block; with a group
        each, a block has one place (its slot's group) and one fill. Idempotent."""
        deadline = time.monotonic() + 60
        groups: list[dict[str, Any]] = []
        while not groups:  # the master gives none for a moment after cluster.sh's set
            groups = json.loads(self._flash_client_view()).get("FlashGroups") or []
            if not groups and time.monotonic() > deadline:
                raise RuntimeError("the master gives the clients no FlashGroup 60 s after start")
            if not groups:
                time.sleep(0.5)
        if len(groups) >= len(FLASH_NODES):
            return
        self.flash_groups_changed = time.monotonic()
        group = str(groups[0]["i"])
        for addr in FLASH_NODES[1:]:
            self.cli("flashgroup", "nodeRemove", group, "--addr", addr, "-y")
            out = self.cli("flashgroup", "create")
            new = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                       if line.strip().startswith("ID:"))
            self.cli("flashgroup", "nodeAdd", new, "--zoneName", "default", "--addr", addr)
            self.cli("flashgroup", "set", new, "true")
        hosts = sorted(h for g in json.loads(self._flash_client_view())["FlashGroups"]
                       for h in g.get("h") or [])
        if hosts != sorted(FLASH_NODES):
            raise RuntimeError(f"the flash groups give the clients {hosts}, not {FLASH_NODES}")

    def wait_flash_view(self) -> None:
        """Waits until every client and flashnode has the FlashGroups of flash_group_per_node:
        each takes the master's view again once a minute (RefreshFlashNodesInterval), and
        until then reads go where the view at its start sent them."""
        if self.flash_groups_changed is not None:
            time.sleep(max(0.0, self.flash_groups_changed + FLASH_VIEW_REFRESH_S
                           - time.monotonic()))

    def _flash_client_view(self) -> str:
        out = self.cli("flashgroup", "client")
        return out[out.index("{"):]

    def server_pids(self, prefix: str) -> list[int]:
        """The pids of cluster.sh's servers whose name starts with `prefix` ("data", "flash")."""
        pids = []
        for line in (self.run_dir / "pids").read_text().splitlines():
            name, _, pid = line.partition(" ")
            if name.startswith(prefix) and name != "cfs-client":
                pids.append(int(pid))
        return pids

    @property
    def s3_port(self) -> int:
        return int(self.env["CUBEFS_S3_ENDPOINT"].rsplit(":", 1)[1])

    @property
    def bucket(self) -> str:
        return self.env["CUBEFS_VOL"]

    def native_config(self, remote_cache: bool = False) -> dict[str, object]:
        """The keys of a cubetorchfs config for the volume through libcfs.so (backend.type
        cubefs): the CubeFS client's own keys at the top level, the library beside cluster.sh
        (with remote_cache, the build that can read through the flash cache)."""
        lib = self.script.parent / "bin" / (
            "libcfs-remotecache.so" if remote_cache else "libcfs.so")
        return {"masterAddr": self.env["CUBEFS_MASTER"], "owner": self.env["CUBEFS_OWNER"],
                "accessKey": self.env["CUBEFS_ACCESS_KEY"],
                "secretKey": self.env["CUBEFS_SECRET_KEY"],
                "backend": {"type": "cubefs", "root": None,
                            "cubefs": {"lib": str(lib), "volume": self.bucket,
                                       "remote_cache": remote_cache}}}

    def s3_backend(self, **extra: object) -> dict[str, object]:
        """The backend section of a cubetorchfs config for the ObjectNode."""
        backend: dict[str, object] = {
            "type": "s3", "root": None, "endpoint": self.env["CUBEFS_S3_ENDPOINT"],
            "bucket": self.bucket, "region": "cfs_dev",
            "access_key": self.env["CUBEFS_ACCESS_KEY"],
            "secret_key": self.env["CUBEFS_SECRET_KEY"]}
        backend.update(extra)
        return backend

#!/usr/bin/python3
"""CubeFS benchmark: a real loopback CubeFS cluster (../shared/cubefs/cluster.sh), read cold and
warm through every way cubetorchfs can reach it, against the cluster's own clients.

  get            plain S3 GETs of every file from one keep-alive client (SigV4, Python): what
                 one request a file costs the ObjectNode, the reference for cold reads
  cfs-client     CubeFS's own FUSE client (a fresh mount per cold round)
  ctfs-s3        cubetorchfs over the ObjectNode (backend.type s3), profile ai_prefetch
  ctfs-cfs       cubetorchfs over cfs-client (backend.type posix), profile ai_prefetch
  ctfs-native    cubetorchfs over CubeFS's C SDK, libcfs.so (backend.type cubefs), ai_prefetch
  *+hook         the same three with `import cube_torch` in the reading process

Data: --files JPEGs (~110 KB, bench/benchlib.generate_jpegs) in --classes directories and
--large files of --large-mib, written once through cfs-client. The ObjectNode lags behind
cfs-client (docs/cubefs.md): the bench waits until it serves every file before measuring.

Each round, in turn for every system, after dropping the kernel's page cache and on a fresh
mount (empty caches): `cold` reads every small file once, in order, on one thread
(open/read/close by path, as a training loop without prefetch does), then the large files
with sequential 1 MiB reads; `warm` reads the small files again on the same mount (for
ctfs-s3 the daemon's store requests during it are counted: the target is 0). The `hook`
rows run one epoch of a DataLoader (ImageFolder, raw bytes, batch 32, 2 workers, shuffle) in
a fresh process against cfs-client without the hook, ctfs-s3 and ctfs-cfs with it.

Prints per system the median and min-max of files/s (and MB/s for large files) over --rounds,
then the ratios the targets name: cold ctfs-s3/get (>= 0.9), hook/cfs-client (>= 3),
warm/cfs-client (>= 5), the store requests of warm reads (0), and for ctfs-native against
cfs-client: cold >= 1.0, hook >= 3, large >= 0.9, warm >= 5.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import types
import urllib.request
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "cubefs"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.modules.setdefault("pytest", types.ModuleType("pytest"))  # s3_testlib imports the harness
from benchlib import drop_caches, generate_jpegs  # noqa: E402
from cluster import Cluster, cubefs_problem  # noqa: E402
from s3_testlib import S3Client  # noqa: E402

BIN = Path(os.environ.get("CUBETORCHFS_BIN", REPO / "build" / "bin" / "cubetorchfs"))


def log(msg: str) -> None:
    print(f"[cubefs_bench] {msg}", file=sys.stderr, flush=True)


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("cubetorchfs_backend_requests_total{"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def store_requests(port: int) -> float:
    return sum(metrics(port).values())


class Mounts:
    """Fresh cfs-client and cubetorchfs mounts, all unmounted at the end."""

    def __init__(self, cluster: Cluster, work: Path) -> None:
        self.cluster, self.work, self.count = cluster, work, 0
        self.ctfs: list[Path] = []

    def cfs_client(self) -> Path:
        self.count += 1
        return self.cluster.mount_cfs_client(self.work / f"cfs{self.count}")

    def cubetorchfs(self, backend: dict[str, object],
                    top: dict[str, object] | None = None) -> tuple[Path, int]:
        self.count += 1
        d = self.work / f"ctfs{self.count}"
        (d / "mnt").mkdir(parents=True)
        port = 19000 + self.count
        config = {"volName": f"bench{self.count}", "mountPoint": str(d / "mnt"),
                  "logDir": str(d), "exporterPort": port, "profile": "ai_prefetch",
                  "backend": backend, "cache": {"memory_bytes": "2GiB"},
                  "prefetch": {"control_socket": str(d / "ctl.sock")}}
        config.update(top or {})
        (d / "config.json").write_text(json.dumps(config))
        subprocess.run([str(BIN), "-c", str(d / "config.json"), str(d / "mnt")], check=True,
                       timeout=60)
        self.ctfs.append(d / "mnt")
        return d / "mnt", port

    def close(self) -> None:
        for m in self.ctfs:
            subprocess.run(["fusermount3", "-u", "-z", str(m)], capture_output=True, timeout=30)


def read_files(paths: list[Path]) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            n += len(f.read())
    return n


def read_large(paths: list[Path]) -> int:
    n = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                n += len(chunk)
    return n


EPOCH = """
import json, os, sys, time
if sys.argv[2] == "hook":
    import cube_torch
import torch, torchvision
root = sys.argv[1]
def raw(path):
    with open(path, "rb") as f:
        return torch.tensor(len(f.read()))
torch.manual_seed(1)
ds = torchvision.datasets.ImageFolder(root, loader=raw)
loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, num_workers=2)
start, n = time.monotonic(), 0
for x, y in loader:
    n += len(y)
print(json.dumps({"files": n, "seconds": time.monotonic() - start}))
"""


def epoch(root: Path, hook: bool, vol: str = "") -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO / "hooks"))
    if vol:
        env["VOL_NAME"] = vol
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(EPOCH), str(root),
                        "hook" if hook else "plain"], env=env, capture_output=True, text=True,
                       timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["files"] / out["seconds"]


def summary(samples: list[float]) -> str:
    return (f"{statistics.median(samples):9.1f}  ({min(samples):.1f}-{max(samples):.1f})"
            if samples else "        -")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--classes", type=int, default=20)
    ap.add_argument("--large", type=int, default=2)
    ap.add_argument("--large-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cubetorchfs-cubefs-bench"))
    args = ap.parse_args()
    problem = cubefs_problem()
    if problem:
        log(problem)
        return 2
    if not BIN.exists():
        log(f"{BIN} is missing: build first (scripts/build.sh)")
        return 2
    local = args.workdir / "jpegs"
    generate_jpegs(local / "train", args.files, args.classes, "cubefs_bench")
    work = Path(tempfile.mkdtemp(prefix="cubefs-bench-"))
    cluster = Cluster().start()
    mounts = Mounts(cluster, work)
    try:
        return run(args, cluster, mounts, local)
    finally:
        mounts.close()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, cluster: Cluster, mounts: Mounts, local: Path) -> int:
    cfs = mounts.cfs_client()
    log("copying the data set into the volume through cfs-client")
    shutil.copytree(local / "train", cfs / "train")
    (cfs / "large").mkdir()
    for i in range(args.large):
        (cfs / "large" / f"l{i}.bin").write_bytes(os.urandom(args.large_mib << 20))
    rel = sorted(p.relative_to(cfs).as_posix() for p in (cfs / "train").rglob("*.jpg"))
    large = [f"large/l{i}.bin" for i in range(args.large)]
    client = S3Client(cluster.s3_port, cluster.env["CUBEFS_ACCESS_KEY"],
                      cluster.env["CUBEFS_SECRET_KEY"], "cfs_dev")

    def get_all() -> int:
        n = 0
        for r in rel:
            status, body = client.request("GET", f"/{cluster.bucket}/{r}")
            if status != 200:
                raise RuntimeError(f"GET {r}: {status} {body[:200]!r}")
            n += len(body)
        return n

    log("waiting until the ObjectNode serves every file")
    deadline = time.monotonic() + 300
    while True:
        try:
            get_all()
            break
        except RuntimeError as e:
            if time.monotonic() > deadline:
                raise
            log(f"not yet: {e}")
            time.sleep(5)
    s3 = {k: v for k, v in cluster.s3_backend(staging_dir=str(mounts.work / "staging")).items()
          if v is not None}
    systems: dict[str, Callable[[], dict[str, float]]] = {}
    results: dict[str, dict[str, list[float]]] = {}

    def timed(fn: Callable[[], int]) -> tuple[float, int]:
        start = time.monotonic()
        n = fn()
        return time.monotonic() - start, n

    def mount_rows(root: Path, port: int = 0) -> dict[str, float]:
        small = [root / r for r in rel]
        t, _ = timed(lambda: read_files(small))
        tl, nl = timed(lambda: read_large([root / p for p in large]))
        before = store_requests(port) if port else 0.0
        tw, _ = timed(lambda: read_files(small))
        row = {"cold": len(rel) / t, "large": nl / tl / 1e6, "warm": len(rel) / tw}
        if port:
            row["warm_requests"] = store_requests(port) - before
        return row

    systems["get"] = lambda: {"cold": len(rel) / timed(get_all)[0]}
    systems["cfs-client"] = lambda: mount_rows(mounts.cfs_client())
    systems["ctfs-s3"] = lambda: mount_rows(*mounts.cubetorchfs(s3))
    systems["ctfs-cfs"] = lambda: mount_rows(
        *mounts.cubetorchfs({"type": "posix", "root": str(mounts.cfs_client())}))
    native_top = cluster.native_config()
    native = {k: v for k, v in native_top.pop("backend").items() if v is not None}  # type: ignore
    systems["ctfs-native"] = lambda: mount_rows(*mounts.cubetorchfs(native, native_top))
    systems["cfs-client epoch"] = lambda: {"hook": epoch(mounts.cfs_client() / "train", False)}

    def hooked(backend: dict[str, object],
               top: dict[str, object] | None = None) -> dict[str, float]:
        mnt, _ = mounts.cubetorchfs(backend, top)
        return {"hook": epoch(mnt / "train", True, vol=f"bench{mounts.count}")}

    systems["ctfs-s3+hook"] = lambda: hooked(s3)
    systems["ctfs-cfs+hook"] = lambda: hooked({"type": "posix",
                                                "root": str(mounts.cfs_client())})
    systems["ctfs-native+hook"] = lambda: hooked(native, native_top)
    for rnd in range(args.rounds):
        for name, fn in systems.items():
            drop_caches(log=None)  # raises where it cannot
            row = fn()
            log(f"round {rnd + 1}/{args.rounds} {name}: " +
                ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
            for k, v in row.items():
                results.setdefault(name, {}).setdefault(k, []).append(v)
        mounts.close()
        mounts.ctfs.clear()
    print(f"{'system':18} {'cold files/s':>24} {'large MB/s':>24} {'warm files/s':>24} "
          f"{'epoch files/s':>24}")
    for name, cols in results.items():
        print(f"{name:18} {summary(cols.get('cold', []))} {summary(cols.get('large', []))} "
              f"{summary(cols.get('warm', []))} {summary(cols.get('hook', []))}")

    def med(name: str, col: str) -> float:
        return statistics.median(results[name][col])

    print(f"ratios: cold ctfs-s3/get {med('ctfs-s3', 'cold') / med('get', 'cold'):.2f} "
          f"(>= 0.9), ctfs-cfs/cfs-client {med('ctfs-cfs', 'cold') / med('cfs-client', 'cold'):.2f}; "
          f"hook ctfs-s3/cfs-client {med('ctfs-s3+hook', 'hook') / med('cfs-client epoch', 'hook'):.2f} "
          f"and ctfs-cfs/cfs-client {med('ctfs-cfs+hook', 'hook') / med('cfs-client epoch', 'hook'):.2f} "
          f"(>= 3); warm ctfs-s3/cfs-client {med('ctfs-s3', 'warm') / med('cfs-client', 'warm'):.1f} "
          f"and ctfs-cfs/cfs-client {med('ctfs-cfs', 'warm') / med('cfs-client', 'warm'):.1f} (>= 5); "
          f"large ctfs-s3/cfs-client {med('ctfs-s3', 'large') / med('cfs-client', 'large'):.2f}; "
          f"store requests of warm reads (ctfs-s3) max {max(results['ctfs-s3']['warm_requests']):.0f} (0)")
    cfs = "cfs-client"
    print(f"native: cold ctfs-native/cfs-client {med('ctfs-native', 'cold') / med(cfs, 'cold'):.2f} "
          f"(>= 1.0), hook {med('ctfs-native+hook', 'hook') / med('cfs-client epoch', 'hook'):.2f} "
          f"(>= 3), large {med('ctfs-native', 'large') / med(cfs, 'large'):.2f} (>= 0.9), "
          f"warm {med('ctfs-native', 'warm') / med(cfs, 'warm'):.1f} (>= 5); store requests of "
          f"warm reads max {max(results['ctfs-native']['warm_requests']):.0f} (0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

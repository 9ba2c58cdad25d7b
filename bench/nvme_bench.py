#!/usr/bin/python3
"""NVMe-tier benchmark: a second epoch served from the NVMe tier vs from RAM.

Two mounts of the same files (~110 KB each) with a backend latency of --latency-us:
  ram   cache.memory_bytes large enough for every file, no NVMe tier
  nvme  cache.memory_bytes far too small (RAM evicts, demoting to the tier) + an NVMe tier
Epoch 1 reads every file once through each mount (filling the caches). Then rounds alternate
ram, nvme: drop the kernel's page cache (so reads reach the daemon, and the NVMe tier's chunk
files come from the disk), read every file with --threads threads, report files/s. The last
line is nvme/ram (target >= 0.8) and the backend reads of the measured epochs (must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchlib import drop_caches, free_port  # noqa: E402


def metric(port: int, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def epoch(root: Path, rels: list[str], threads: int) -> float:
    def read(rel: str) -> int:
        with open(root / rel, "rb") as f:
            return len(f.read())
    start = time.monotonic()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(read, rels))
    assert total > 0
    return len(rels) / (time.monotonic() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--latency-us", type=int, default=2000)
    p.add_argument("--workdir", default="/tmp/cubetorchfs-nvme-bench")
    p.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN", str(REPO / "build/bin/cubetorchfs")))
    args = p.parse_args()

    work = Path(args.workdir)
    data = work / "data"
    rng = random.Random(0)
    marker = data / f".complete-{args.files}"
    if not marker.exists():
        shutil.rmtree(data, ignore_errors=True)
        for i in range(args.files):
            d = data / f"d{i % 50:02d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"f{i:06d}.bin").write_bytes(rng.randbytes(max(1000, int(rng.gauss(110_000, 30_000)))))
        marker.touch()
    rels = sorted(str(f.relative_to(data)) for f in data.rglob("*.bin"))
    total_bytes = sum((data / r).stat().st_size for r in rels)

    mounts = {}
    try:
        for name in ("ram", "nvme"):
            mnt = work / f"mnt-{name}"
            mnt.mkdir(parents=True, exist_ok=True)
            port = free_port()
            cache = {"memory_bytes": f"{3 * total_bytes // (1 << 20) + 64}MiB"}
            if name == "nvme":
                shutil.rmtree(work / "nvme", ignore_errors=True)
                cache = {"memory_bytes": "32MiB", "disk_dir": str(work / "nvme"),
                         "disk_bytes": f"{2 * total_bytes // (1 << 20) + 64}MiB"}
            config = {"volName": f"nvmebench-{name}", "mountPoint": str(mnt), "exporterPort": port,
                      "profile": "ai_prefetch", "cache": cache,
                      "prefetch": {"enabled": False,
                                   "control_socket": f"/run/cubetorchfs/nvmebench-{name}.sock"},
                      "backend": {"type": "posix", "root": str(data),
                                  "inject": {"latency_us": args.latency_us}}}
            (work / f"{name}.json").write_text(json.dumps(config))
            env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work))
            subprocess.run([args.bin, "-c", str(work / f"{name}.json")], check=True, env=env, timeout=60)
            mounts[name] = (mnt, port)
            rate = epoch(mnt, rels, 32)  # epoch 1: fill the caches from the backend
            print(f"[nvme_bench] {name}: first epoch {rate:.0f} files/s from the backend", file=sys.stderr)
        time.sleep(2)  # let the NVMe writer finish its queue
        before = {n: metric(port, "cubetorchfs_backend_requests_total", op="read", status="ok")
                  for n, (_, port) in mounts.items()}
        results: dict[str, list[float]] = {"ram": [], "nvme": []}
        for r in range(args.rounds):
            for name in ("ram", "nvme"):
                # Page cache only: dentries and inodes stay, so lookups do not reach the store
                # and the measure is the data path (RAM tier vs NVMe tier). Raises without root.
                drop_caches(log=None, level=1)
                rate = epoch(mounts[name][0], rels, args.threads)
                results[name].append(rate)
                print(f"[nvme_bench] round {r + 1}: {name} {rate:.0f} files/s", file=sys.stderr)
        after = {n: metric(port, "cubetorchfs_backend_requests_total", op="read", status="ok")
                 for n, (_, port) in mounts.items()}
        disk_bytes = metric(mounts["nvme"][1], "cubetorchfs_read_bytes_total", source="disk")
    finally:
        for mnt, _ in mounts.values():
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False, timeout=30)

    print(f"nvme_bench (second epochs, page cache dropped) - nproc {os.cpu_count()}, {len(rels)} files, "
          f"{total_bytes / 1e6:.0f} MB, {args.threads} threads, {args.rounds} rounds")
    for name, rates in results.items():
        print(f"{name:5} {statistics.median(rates):8.0f} files/s  ({min(rates):.0f}-{max(rates):.0f})")
    ratio = statistics.median(results["nvme"]) / statistics.median(results["ram"])
    print(f"ratio: nvme/ram = {ratio:.2f} (target >= 0.8); backend reads during measured epochs: "
          f"ram {after['ram'] - before['ram']:.0f}, nvme {after['nvme'] - before['nvme']:.0f}; "
          f"bytes from NVMe {disk_bytes / 1e6:.0f} MB")


if __name__ == "__main__":
    main()

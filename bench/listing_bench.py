#!/usr/bin/env python3
"""A flat directory of 100 M names through the mount: how soon the first entries come, how
fast a whole listing goes, and what the daemon holds meanwhile.

    bench/listing_bench.py                          # 100 M names, the whole listing read
    bench/listing_bench.py --names 10000000 --local-names 200000

The directory is the synthetic store's (backend.type synthetic, one directory of --names
files: no disk holds 100 M files here). Measured:
  - `ls -f DIR | head -n 10`: the seconds until ls has printed its first 10 names and exits;
  - a whole `os.scandir` (up to --scan-limit names): entries a second, and the daemon's peak
    resident memory (VmHWM) against its cache budget;
  - the reference: the same scandir of a local tmpfs directory of --local-names empty files
    (what a user who copied the names to local storage would list), entries a second.
Prints one JSON line; bench/README.md has the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import free_port, unmount, vm_hwm_mib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def scan(directory: Path, limit: int) -> tuple[int, float]:
    began = time.monotonic()
    n = 0
    with os.scandir(directory) as it:
        for _ in it:
            n += 1
            if n >= limit:
                break
    return n, time.monotonic() - began


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--names", type=int, default=100_000_000, help="names in the flat directory")
    p.add_argument("--scan-limit", type=int, default=0,
                   help="names the whole listing reads at most (0: all)")
    p.add_argument("--local-names", type=int, default=200_000,
                   help="empty files of the local tmpfs reference (0: none)")
    p.add_argument("--memory-bytes", default="256MiB", help="the daemon's cache budget")
    p.add_argument("--bin", default=str(REPO / "build/bin/cubetorchfs"))
    args = p.parse_args()
    if args.names < 1 or args.names > 1_000_000_000:
        p.error("--names must be between 1 and 1,000,000,000")
    if not Path(args.bin).is_file():
        p.error(f"{args.bin}: no daemon binary (cmake --build build --target cubetorchfs)")
    row: dict[str, object] = {"names": args.names, "memory_bytes": args.memory_bytes}
    work = Path(tempfile.mkdtemp(prefix="listing_bench."))
    mnt = work / "mnt"
    mnt.mkdir()
    vol = f"listingbench{os.getpid()}"
    config = {"volName": vol, "mountPoint": str(mnt), "logDir": str(work / "log"),
              "exporterPort": free_port(),
              "backend": {"type": "synthetic", "synthetic": {
                  "dirs": 1, "files_per_dir": args.names, "min_bytes": 1, "max_bytes": 8}},
              "cache": {"memory_bytes": args.memory_bytes},
              "prefetch": {"control_socket": str(work / "ctl.sock")}}
    (work / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=vol)
    try:
        subprocess.run([args.bin, "-c", str(work / "config.json")], check=True, env=env,
                       timeout=120)
        pid = json.loads((work / f"cube_torch.config.{vol}").read_text())["pid"]
        row["vmhwm_mount_mib"] = round(vm_hwm_mib(pid), 1)
        flat = mnt / "n00000000"
        began = time.monotonic()
        out = subprocess.run(f"ls -f '{flat}' | head -n 10", shell=True, capture_output=True,
                             text=True, timeout=600)
        row["ls_head_s"] = round(time.monotonic() - began, 3)
        row["ls_head_lines"] = len(out.stdout.split())
        limit = args.scan_limit or args.names + 2
        n, secs = scan(flat, limit)
        row["scanned"] = n
        row["scan_s"] = round(secs, 1)
        row["scan_entries_per_s"] = round(n / secs)
        row["vmhwm_after_scan_mib"] = round(vm_hwm_mib(pid), 1)
        print(json.dumps(row), flush=True)
    finally:
        unmount(mnt)
    if args.local_names > 0:
        local = Path(tempfile.mkdtemp(prefix="listing_bench.", dir="/dev/shm")) / "flat"
        try:
            local.mkdir()
            for i in range(args.local_names):
                (local / f"n00000000_{i}.JPEG").touch()
            n, secs = scan(local, args.local_names + 2)
            row["local_names"] = n
            row["local_entries_per_s"] = round(n / secs)
            row["mount_over_local"] = round(row["scan_entries_per_s"] / row["local_entries_per_s"],
                                            3)
        finally:
            shutil.rmtree(local.parent, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A crash of the daemon while the kernel knows millions of names: how soon the mount answers
again, and what the new daemon holds.

    bench/crash_bench.py                              # 10 M names known (10,000 x 1,000)
    bench/crash_bench.py --dirs 1000 --files 1000     # 1 M

The store is the synthetic one (backend.type synthetic: --dirs directories of --files files;
no disk holds them). The kernel is made to know every name by listing each directory
(READDIRPLUS hands the kernel an inode per entry, as `ls -l` or a scan does), all but the
last directory's. Then `kill -9` of the serving process, and measured:
  - restart_s: from the kill until a stat of a file of the last directory answers (a lookup
    the kernel must send: the supervisor has started the next process, which replayed the
    mount's INIT and serves);
  - read_ok_s: until a file the kernel knew by the old process's inode number, and whose pages
    it no longer holds, reads back the bytes it had before (the new daemon adopted the old
    one's inode records, so the number still names the file; without them the kernel's open
    gets ESTALE and looks the name up again);
  - adopt_ms: what adopting the records took the new daemon before it served (its log);
  - the new daemon's VmHWM 10 s after, and its resident memory (of which shared: the records
    it adopted), against `budget + 64 MiB + 150 B x known`;
  - the old daemon's peak (VmHWM) and the names it knew (cubetorchfs_inodes).
Prints one JSON line; bench/README.md has the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import free_port, proc_status_mib, unmount, vm_hwm_mib, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    return float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dirs", type=int, default=10_000)
    p.add_argument("--files", type=int, default=1_000, help="files a directory")
    p.add_argument("--memory-bytes", default="256MiB", help="the daemon's cache budget")
    p.add_argument("--bin", default=str(REPO / "build/bin/cubetorchfs"))
    args = p.parse_args()
    if args.dirs < 2 or args.files < 1 or args.dirs * args.files > 50_000_000:
        p.error("--dirs must be at least 2, --files positive, at most 50 M names in all")
    if not Path(args.bin).is_file():
        p.error(f"{args.bin}: no daemon binary (cmake --build build --target cubetorchfs)")
    names = args.dirs * args.files
    row: dict[str, object] = {"names": names, "memory_bytes": args.memory_bytes}
    work = Path(tempfile.mkdtemp(prefix="crash_bench."))
    mnt = work / "mnt"
    mnt.mkdir()
    vol = f"crashbench{os.getpid()}"
    port = free_port()
    config = {"volName": vol, "mountPoint": str(mnt), "logDir": str(work / "log"),
              "exporterPort": port,
              "backend": {"type": "synthetic", "synthetic": {
                  "dirs": args.dirs, "files_per_dir": args.files, "min_bytes": 1024,
                  "max_bytes": 3072}},
              "cache": {"memory_bytes": args.memory_bytes},
              "prefetch": {"control_socket": str(work / "ctl.sock")}}
    (work / "config.json").write_text(json.dumps(config))
    control = work / f"cube_torch.config.{vol}"
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=vol)
    try:
        subprocess.run([args.bin, "-c", str(work / "config.json")], check=True, env=env,
                       timeout=120)
        info = json.loads(control.read_text())
        pid = info["pid"]
        began = time.monotonic()
        listed = 0
        for d in range(args.dirs - 1):
            with os.scandir(mnt / f"n{d:08d}") as it:
                for e in it:
                    e.stat()  # answered from what READDIRPLUS gave the kernel
                    listed += 1
            if d % max(1, args.dirs // 10) == 0:
                print(f"  {listed:,} / {names:,} names listed", file=sys.stderr, flush=True)
        row["list_s"] = round(time.monotonic() - began, 1)
        row["known_before"] = int(gauge(port, "cubetorchfs_inodes"))
        row["vmhwm_before_mib"] = round(vm_hwm_mib(pid), 1)
        last = args.dirs - 1
        probe = mnt / f"n{last:08d}" / f"n{last:08d}_{args.files - 1}.JPEG"
        known = mnt / "n00000000" / f"n00000000_{args.files - 1}.JPEG"
        fd = os.open(known, os.O_RDONLY)
        try:
            want = os.read(fd, 1 << 20)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # its pages go; its inode stays
        finally:
            os.close(fd)

        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()

        def stat_answers() -> bool:
            try:
                os.stat(probe)
                return True
            except OSError:
                return False

        assert wait_for(stat_answers, 120, interval=0.01), "the mount did not answer again"
        row["restart_s"] = round(time.monotonic() - killed, 3)

        def read_answers() -> bool:
            try:
                return known.read_bytes() == want
            except OSError:
                return False

        assert wait_for(read_answers, 60, interval=0.01), "the file did not read back"
        row["read_ok_s"] = round(time.monotonic() - killed, 3)
        info = json.loads(control.read_text())
        new_pid = info["pid"]
        row["generation"] = info.get("generation")
        time.sleep(max(0.0, 10 - (time.monotonic() - killed)))
        row["vmhwm_new_10s_mib"] = round(vm_hwm_mib(new_pid), 1)
        log = work / "log"

        def log_text() -> str:
            return "".join(f.read_text(errors="replace") for f in log.rglob("*") if f.is_file())

        # The new daemon either adopted the old one's inode records (the kernel's numbers go on
        # naming their files), or could not and drops the old names under the root.
        adopted = re.search(r"kept (\d+) inode records of the process before in (\d+) ms "
                            r"\((\d+) dropped", log_text())
        if adopted:
            row["adopted"], row["adopt_ms"], row["adopt_dropped"] = map(int, adopted.groups())
        else:
            row["drop_logged"] = wait_for(lambda: "the kernel dropped" in log_text(), 600,
                                          interval=0.5)
            row["drop_s"] = round(time.monotonic() - killed, 1)
        row["known_after"] = int(gauge(port, "cubetorchfs_inodes"))
        row["vmhwm_new_mib"] = round(vm_hwm_mib(new_pid), 1)
        row["rss_new_mib"] = round(proc_status_mib(new_pid, "VmRSS"), 1)
        # Of which the adopted records: shared memory the old process had written.
        row["rss_shmem_new_mib"] = round(proc_status_mib(new_pid, "RssShmem"), 1)
        print(json.dumps(row), flush=True)
    finally:
        unmount(mnt)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

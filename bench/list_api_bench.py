#!/usr/bin/env python3
"""A file list of 180 M paths registered with a live daemon through its control API (POST
/v1/lists, NUL-separated paths, as the hook sends them), then an epoch's worth of positions
published from it: what the daemon holds per path, measured on the daemon itself.

    bench/list_api_bench.py                                   # 180 M paths (140,625 x 1,280)
    bench/list_api_bench.py --dirs 10000 --files 1000         # 10 M

The store is the synthetic one (backend.type synthetic; its paths are ImageNet's shape,
<mount>/n00000007/n00000007_<i>.JPEG, about 60 bytes with the mount's own path). Each path is
resolved and its directories checked for the caller at registration, as the daemon does for
every list. Measured: the seconds to register, the list's bytes as the daemon counts them
(`/v1/stats` global.lists.bytes), the daemon's resident memory and peak (VmRSS, VmHWM) before
and after, against `budget + 64 MiB + 24 B x paths + 150 B x known`; then --positions random
positions (100,000) published into a stream (requests of 65,536) and the seconds that took. The
daemon's list limits are raised to 4 GiB for the run (a 180 M-path list needs about 2 GiB).
Prints one JSON line; bench/README.md has the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import proc_status_mib, unmount, vm_hwm_mib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hooks"))
from cube_torch._client import ControlClient  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dirs", type=int, default=140_625)
    p.add_argument("--files", type=int, default=1_280, help="files a directory")
    p.add_argument("--per-request", type=int, default=100_000, help="paths a POST")
    p.add_argument("--positions", type=int, default=100_000)
    p.add_argument("--memory-bytes", default="256MiB", help="the daemon's cache budget")
    p.add_argument("--bin", default=str(REPO / "build/bin/cubetorchfs"))
    args = p.parse_args()
    paths = args.dirs * args.files
    if args.dirs < 1 or args.files < 1 or paths > 400_000_000:
        p.error("--dirs and --files must be positive, at most 400 M paths")
    if not 1 <= args.per_request <= 131_072:
        p.error("--per-request must be 1 to 131,072 (control.max_json_elements)")
    if not Path(args.bin).is_file():
        p.error(f"{args.bin}: no daemon binary (cmake --build build --target cubetorchfs)")
    row: dict[str, object] = {"paths": paths, "memory_bytes": args.memory_bytes}
    work = Path(tempfile.mkdtemp(prefix="list_api_bench."))
    mnt = work / "mnt"
    mnt.mkdir()
    vol = f"listapibench{os.getpid()}"
    sock = work / "ctl.sock"
    config = {"volName": vol, "mountPoint": str(mnt), "logDir": str(work / "log"),
              "backend": {"type": "synthetic", "synthetic": {
                  "dirs": args.dirs, "files_per_dir": args.files}},
              "cache": {"memory_bytes": args.memory_bytes},
              "control": {"max_body_bytes": "64MiB", "body_memory_bytes": "128MiB"},
              "prefetch": {"control_socket": str(sock), "max_list_bytes": "4GiB",
                           "max_list_bytes_per_uid": "4GiB"}}
    (work / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=vol)
    try:
        subprocess.run([args.bin, "-c", str(work / "config.json")], check=True, env=env,
                       timeout=120)
        pid = json.loads((work / f"cube_torch.config.{vol}").read_text())["pid"]
        client = ControlClient(str(sock), timeout=600)
        row["rss_before_mib"] = round(proc_status_mib(pid, "VmRSS"), 1)
        row["vmhwm_before_mib"] = round(vm_hwm_mib(pid), 1)
        root = os.fsencode(str(mnt))
        list_id = None
        sent = 0
        path_bytes = 0
        began = time.monotonic()
        batch: list[bytes] = []
        rejected = 0

        def flush() -> None:
            nonlocal list_id, sent, path_bytes, rejected
            raw = b"".join(batch)
            path_bytes += len(raw) - len(batch)
            out = client.register_list_raw(raw, len(batch), list_id)
            list_id = out["id"]
            rejected += out["rejected"]
            sent += len(batch)
            batch.clear()

        report = max(1, paths // 20)
        for d in range(args.dirs):
            dname = b"n%08d" % d
            prefix = root + b"/" + dname + b"/" + dname + b"_"
            for i in range(args.files):
                batch.append(prefix + b"%d.JPEG\0" % i)
                if len(batch) == args.per_request:
                    flush()
                    if sent % report < args.per_request:
                        print(f"  {sent:,} / {paths:,} paths registered "
                              f"({time.monotonic() - began:.0f} s, daemon VmRSS "
                              f"{proc_status_mib(pid, 'VmRSS'):,.0f} MiB)",
                              file=sys.stderr, flush=True)
        if batch:
            flush()
        row["register_s"] = round(time.monotonic() - began, 1)
        row["register_us_per_path"] = round(row["register_s"] * 1e6 / paths, 2)
        row["path_bytes"] = round(path_bytes / paths, 1)
        row["rejected"] = rejected
        lists = client.stats()["global"]["lists"]
        row["list_entries"] = lists["entries"]
        row["list_bytes_per_path"] = round(lists["bytes"] / paths, 2)
        rss = proc_status_mib(pid, "VmRSS")
        hwm = vm_hwm_mib(pid)
        row["rss_after_mib"] = round(rss, 1)
        row["vmhwm_after_mib"] = round(hwm, 1)
        row["rss_growth_bytes_per_path"] = round(
            (rss - float(row["rss_before_mib"])) * 2**20 / paths, 2)
        budget = float(args.memory_bytes.rstrip("MiB")) if args.memory_bytes.endswith("MiB") \
            else float("nan")
        row["formula_mib"] = round(budget + 64 + 24 * paths / 2**20, 1)

        stream = client.create_stream("list_api_bench", os.getpid(), list_id=list_id)
        rng = random.Random(5)
        began = time.monotonic()
        done = 0
        while done < args.positions:
            n = min(65_536, args.positions - done)
            body = struct.pack(f"<{n}I", *(rng.randrange(paths) for _ in range(n)))
            client.publish_positions(stream, body)
            done += n
        row["positions_s"] = round(time.monotonic() - began, 2)
        row["vmhwm_end_mib"] = round(vm_hwm_mib(pid), 1)
        print(json.dumps(row), flush=True)
    finally:
        unmount(mnt)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

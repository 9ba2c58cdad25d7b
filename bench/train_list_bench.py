#!/usr/bin/env python3
"""A dataset of 100 M samples named by `train_data_list()`, read through the mount with the
hook: how soon the first batch comes, the hit ratio over a 1 M-sample slice of the epoch, and
what the training process and the daemon hold.

    bench/train_list_bench.py                       # 100 M names, 1 M samples read
    bench/train_list_bench.py --dirs 1000 --samples 200000

The store is the synthetic one (backend.type synthetic, --dirs x 1,000 files of 1-3 KB,
--latency-us a request): no disk holds 100 M files here. The dataset's `train_data_list()`
returns a sequence that makes each path when asked, as a job with 180 M samples keeps its
names (a Python list of 100 M str would take 12 GB before any hook). Its sampler is torch's
RandomSampler drawing --samples indices of the whole range (with replacement). Measured: the seconds from the DataLoader's
first `next()` to the first batch, samples a second, the daemon's hit ratio over the
slice (cubetorchfs_reads_total), the training process's resident memory before and after
(the hook's share is what grows), the daemon's VmHWM. One JSON line; bench/README.md has the
figures. Runs under the project venv (torch 2).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import free_port, unmount, vm_hwm_mib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PER_DIR = 1000


def reads(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("cubetorchfs_reads_total{"):
            key, _, value = line.rpartition(" ")
            result = key.split('result="', 1)[1].split('"', 1)[0]
            out[result] = out.get(result, 0.0) + float(value)
    return out


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "hooks"))
    import cube_torch  # noqa: F401  (patches DataLoader iteration)
    import torch
    from torch.utils.data import DataLoader, Dataset, RandomSampler

    root, total = args.child, args.dirs * PER_DIR

    class Names:
        """Path i of the mount's synthetic tree, made when asked."""

        def __len__(self) -> int:
            return total

        def __getitem__(self, i: int) -> str:
            if not 0 <= i < total:
                raise IndexError(i)
            d = i // PER_DIR
            return f"{root}/n{d:08d}/n{d:08d}_{i % PER_DIR}.JPEG"

    class Samples(Dataset):
        def __init__(self) -> None:
            self.names = Names()

        def __len__(self) -> int:
            return total

        def train_data_list(self) -> Names:
            return self.names

        def __getitem__(self, i: int) -> int:
            with open(self.names[i], "rb") as f:
                return len(f.read())

    # --samples random indices of the whole range, drawn 32 at a time (with replacement, so
    # torch makes no permutation of 100 M).
    dataset = Samples()
    loader = DataLoader(dataset, batch_size=args.batch,
                        sampler=RandomSampler(dataset, replacement=True, num_samples=args.samples),
                        num_workers=args.workers, collate_fn=list)
    port = int(os.environ["TRAIN_LIST_BENCH_PORT"])
    rss0 = rss_mib()
    before = reads(port)
    start = time.monotonic()
    it = iter(loader)
    first = next(it)
    first_s = time.monotonic() - start
    n = len(first)
    for batch in it:
        n += len(batch)
    seconds = time.monotonic() - start
    after = reads(port)
    got = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    total_reads = sum(got.values())
    print(json.dumps({
        "names": total, "samples": n, "first_batch_s": round(first_s, 2),
        "seconds": round(seconds, 1), "samples_per_s": round(n / seconds),
        "hit": round(got.get("hit", 0.0) / total_reads, 5) if total_reads else None,
        "reads": got, "train_rss_mib": [round(rss0), round(rss_mib())],
        "hook": cube_torch.stats()["client"]}), flush=True)
    del torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dirs", type=int, default=100_000, help="directories of 1,000 files")
    p.add_argument("--samples", type=int, default=1_000_000, help="samples read")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--latency-us", type=int, default=1000, help="the store's latency a request")
    p.add_argument("--memory-bytes", default="4GiB", help="the daemon's cache budget")
    p.add_argument("--bin", default=str(REPO / "build/bin/cubetorchfs"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    if not 1 <= args.dirs <= 1_000_000 or args.samples < 1:
        p.error("--dirs must be 1..1,000,000 and --samples positive")
    if not Path(args.bin).is_file():
        p.error(f"{args.bin}: no daemon binary (cmake --build build --target cubetorchfs)")
    work = Path(tempfile.mkdtemp(prefix="train_list_bench."))
    mnt = work / "mnt"
    mnt.mkdir()
    vol, port = f"trainlist{os.getpid()}", free_port()
    config = {"volName": vol, "mountPoint": str(mnt), "logDir": str(work / "log"),
              "exporterPort": port, "profile": "ai_prefetch",
              "backend": {"type": "synthetic", "inject": {"latency_us": args.latency_us},
                          "synthetic": {"dirs": args.dirs, "files_per_dir": PER_DIR,
                                        "min_bytes": 1024, "max_bytes": 3072}},
              "cache": {"memory_bytes": args.memory_bytes},
              "prefetch": {"control_socket": str(work / "ctl.sock")}}
    (work / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=vol,
               TRAIN_LIST_BENCH_PORT=str(port))
    subprocess.run([args.bin, "-c", str(work / "config.json")], check=True, env=env, timeout=120)
    try:
        pid = json.loads((work / f"cube_torch.config.{vol}").read_text())["pid"]
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(mnt), "--dirs", str(args.dirs),
             "--samples", str(args.samples), "--batch", str(args.batch),
             "--workers", str(args.workers)],
            env=env, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"training process failed:\n{out.stdout[-2000:]}\n"
                               f"{out.stderr[-4000:]}")
        for line in out.stderr.splitlines():
            if "cube_torch" in line:
                print(line, file=sys.stderr)  # the hook's warnings, if any
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["daemon_vmhwm_mib"] = round(vm_hwm_mib(pid), 1)
        print(json.dumps(row), flush=True)
    finally:
        unmount(mnt)
    return 0


if __name__ == "__main__":
    sys.exit(main())

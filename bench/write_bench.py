#!/usr/bin/python3
"""Checkpoint writes through cubetorchfs vs straight to the backend directory.

The pattern of torch.distributed.checkpoint's FileSystemWriter: --shards files written by 4
threads in 4 MiB writes, each fsynced, then .metadata.tmp written, fsynced and renamed to
.metadata, and the directory fsynced. --gib GiB in all (default 1; 1-4 per docs/benchmarks.md).

Rounds alternate direct, mount, direct, mount, ... (each round writes a fresh checkpoint
directory and deletes the previous one first, outside the timing). The mount uses the posix
backend over the same directory the direct rows write to, with profile ai_prefetch (the
training profile). Prints the median and min-max of GB/s per side, the daemon's peak RSS
(VmHWM) against its RAM budget, and a last line `ratio: mount/direct = X (target >= 0.7)`.

--direct-write-sizes 1 4: no mount; the same pattern written directly into the backend
directory with each write size in turn (MiB; rounds alternate), to see what the write size
alone does (the mount hands the store max_write = 1 MiB writes). Last line:
`ratio: direct 1 MiB / 4 MiB writes = X`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WRITE = 4 << 20


def write_checkpoint(directory: Path, shards: int, shard_bytes: int, payload: bytes,
                     write: int = WRITE) -> None:
    directory.mkdir(parents=True)
    errors: list[BaseException] = []

    view = memoryview(payload)  # slices of it are not copies: only the write is measured

    def writer(t: int) -> None:
        try:
            for i in range(t, shards, 4):
                fd = os.open(directory / f"__{i}_0.distcp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                             0o644)
                try:
                    done = 0
                    while done < shard_bytes:
                        n = min(write, shard_bytes - done)
                        # A different slice per shard and offset: no two writes carry the same bytes.
                        start = (i * 7919 + done // write * 104729) % (len(payload) - write)
                        done += os.write(fd, view[start:start + n])
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    fd = os.open(directory / ".metadata.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps({"shards": shards, "bytes": shard_bytes}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(directory / ".metadata.tmp", directory / ".metadata")
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def compare_write_sizes(args: argparse.Namespace) -> None:
    """The checkpoint pattern written directly with each write size in turn."""
    sizes = [m << 20 for m in args.direct_write_sizes]
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    store = work / "store"
    store.mkdir(parents=True)
    largest = max(sizes)
    shard_bytes = int(args.gib * (1 << 30)) // args.shards // largest * largest
    total = shard_bytes * args.shards
    payload = os.urandom(64 << 20)  # random bytes, never zeros
    results: dict[int, list[float]] = {w: [] for w in sizes}
    try:
        for r in range(args.rounds):
            for w in sizes:
                shutil.rmtree(store / "ckpt", ignore_errors=True)
                subprocess.run(["sync"], check=False, timeout=300)
                start = time.monotonic()
                write_checkpoint(store / "ckpt", args.shards, shard_bytes, payload, w)
                rate = total / (time.monotonic() - start) / 1e9
                results[w].append(rate)
                print(f"[write_bench] round {r + 1}: direct {w >> 20} MiB writes {rate:.2f} GB/s",
                      file=sys.stderr)
    finally:
        shutil.rmtree(store / "ckpt", ignore_errors=True)

    print(f"write_bench direct write sizes - nproc {os.cpu_count()}, {total / (1 << 30):.2f} GiB in "
          f"{args.shards} shards, 4 writer threads, fsync each, {args.rounds} rounds, in {work}")
    for w, rates in results.items():
        print(f"direct {w >> 20:>3} MiB writes {statistics.median(rates):6.2f} GB/s  "
              f"({min(rates):.2f}-{max(rates):.2f})")
    first, last = sizes[0], sizes[-1]
    ratio = statistics.median(results[first]) / statistics.median(results[last])
    print(f"ratio: direct {first >> 20} MiB / {last >> 20} MiB writes = {ratio:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint size (1-4 GiB)")
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workdir", default="/tmp/cubetorchfs-write-bench",
                   help="on the disk to measure (the backend directory lives here)")
    p.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN",
                                                   str(REPO / "build/bin/cubetorchfs")))
    p.add_argument("--direct-write-sizes", type=int, nargs="+", metavar="MIB",
                   help="no mount: compare these write sizes (MiB), direct only (e.g. 1 4)")
    args = p.parse_args()
    if args.direct_write_sizes:
        compare_write_sizes(args)
        return

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    store, mnt = work / "store", work / "mnt"
    store.mkdir(parents=True)
    mnt.mkdir()
    shard_bytes = int(args.gib * (1 << 30)) // args.shards // WRITE * WRITE
    total = shard_bytes * args.shards
    payload = os.urandom(64 << 20)  # random bytes, never zeros
    memory = "1GiB"
    config = {"volName": "writebench", "mountPoint": str(mnt), "profile": "ai_prefetch",
              "logDir": str(work), "cache": {"memory_bytes": memory},
              "prefetch": {"control_socket": str(work / "ctl.sock")},
              "backend": {"type": "posix", "root": str(store)}}
    (work / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work))
    subprocess.run([args.bin, "-c", str(work / "config.json")], check=True, env=env, timeout=60)
    results: dict[str, list[float]] = {"direct": [], "mount": []}
    try:
        pid = json.loads((work / "cube_torch.config.writebench").read_text())["pid"]
        for r in range(args.rounds):
            for side, base in (("direct", store), ("mount", mnt)):
                shutil.rmtree(store / "ckpt", ignore_errors=True)
                subprocess.run(["sync"], check=False, timeout=300)
                start = time.monotonic()
                write_checkpoint(base / "ckpt", args.shards, shard_bytes, payload)
                rate = total / (time.monotonic() - start) / 1e9
                results[side].append(rate)
                print(f"[write_bench] round {r + 1}: {side} {rate:.2f} GB/s", file=sys.stderr)
        size = sum(f.stat().st_size for f in (store / "ckpt").iterdir())
        assert size > total, "the checkpoint did not reach the backend"
        hwm = vm_hwm_kib(pid)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False, timeout=60)
        shutil.rmtree(store / "ckpt", ignore_errors=True)

    print(f"write_bench - nproc {os.cpu_count()}, {total / (1 << 30):.2f} GiB in {args.shards} "
          f"shards, 4 writer threads, {WRITE >> 20} MiB writes, fsync each, {args.rounds} rounds")
    for side, rates in results.items():
        print(f"{side:7} {statistics.median(rates):6.2f} GB/s  ({min(rates):.2f}-{max(rates):.2f})")
    print(f"daemon VmHWM {hwm / 1024:.0f} MiB vs budget {memory} + 64 MiB")
    ratio = statistics.median(results["mount"]) / statistics.median(results["direct"])
    print(f"ratio: mount/direct = {ratio:.2f} (target >= 0.7)")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""pwrite into a memory file (memfd), as the daemon fills a model file for the loader.

The pattern of prefetch/model_fetch.cc: memfd_create, ftruncate to the size, then --threads
threads each take the next --chunk-mib chunk and pwrite it from a buffer of random bytes.
Two ways, alternating each round, for every thread count:

  fresh      a new memfd each time: every 4 KiB shmem page is allocated (and zeroed) by the
             write that first touches it; this is what filling a memory file costs
  overwrite  the same memfd written a second time: its pages exist, so only the copy is left
             (the reference)

The table shows median and min-max GB/s; the last line gives fresh GB/s per thread count with
fresh/overwrite (the share page allocation leaves) and fresh(N threads)/fresh(1 thread).
bench/README.md quotes the fresh figure (2.4-2.8 GB/s at any thread count on the 2-core VM).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time

MIB = 1 << 20


def fill(fd: int, size: int, chunk: int, threads: int, src: memoryview) -> float:
    """Writes [0, size) of fd in `chunk` pieces from `threads` threads; returns seconds."""
    chunks = (size + chunk - 1) // chunk
    counter = itertools.count()  # next() is atomic under the GIL
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while (c := next(counter)) < chunks:
                off = c * chunk
                n = min(chunk, size - off)
                # A different slice of the source per chunk: no two writes carry the same bytes.
                start = (c * 104729 * 4096) % (len(src) - n + 1)
                done = 0
                while done < n:
                    done += os.pwrite(fd, src[start + done:start + n], off + done)
        except BaseException as e:  # reported by the caller
            errors.append(e)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    begin = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - begin
    if errors:
        raise errors[0]
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="size of the memory file (MiB)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--chunk-mib", type=int, default=4, help="bytes per pwrite (cache.chunk_bytes)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if not hasattr(os, "memfd_create"):
        sys.exit("memfd_bench: os.memfd_create is not available (Linux, Python 3.8+)")

    size, chunk = args.mib * MIB, args.chunk_mib * MIB
    src = memoryview(os.urandom(max(64 * MIB, 2 * chunk)))  # random bytes, never zeros
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for threads in args.threads:
            fd = os.memfd_create("memfd_bench", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                fresh = size / fill(fd, size, chunk, threads, src) / 1e9
                over = size / fill(fd, size, chunk, threads, src) / 1e9
            finally:
                os.close(fd)  # frees the pages: the next fresh memfd allocates again
            results.setdefault(("fresh", threads), []).append(fresh)
            results.setdefault(("overwrite", threads), []).append(over)
            print(f"[memfd_bench] round {r + 1}: {threads} threads: fresh {fresh:.2f} GB/s, "
                  f"overwrite {over:.2f} GB/s", file=sys.stderr, flush=True)

    print(f"memfd_bench - nproc {os.cpu_count()}, {args.mib} MiB memfd, {args.chunk_mib} MiB pwrites, "
          f"{args.rounds} rounds, median (min-max) GB/s")
    print(f"{'threads':>7} {'fresh':>7} {'min-max':>11} {'overwrite':>10} {'min-max':>11} {'fresh/over':>10}")
    med = {k: statistics.median(v) for k, v in results.items()}
    for threads in args.threads:
        f, o = results[("fresh", threads)], results[("overwrite", threads)]
        print(f"{threads:>7} {med[('fresh', threads)]:>7.2f} {min(f):>5.2f}-{max(f):<5.2f} "
              f"{med[('overwrite', threads)]:>10.2f} {min(o):>5.2f}-{max(o):<5.2f} "
              f"{med[('fresh', threads)] / med[('overwrite', threads)]:>10.2f}")
    base = args.threads[0]
    print("ratio: " + " | ".join(
        f"{t} threads fresh {med[('fresh', t)]:.2f} GB/s, fresh/overwrite="
        f"{med[('fresh', t)] / med[('overwrite', t)]:.2f}, vs {base} thread(s)="
        f"{med[('fresh', t)] / med[('fresh', base)]:.2f}" for t in args.threads))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Page-probe benchmark: what asking the kernel about a file costs the daemon, against what
fetching it costs.

One mount (ai_prefetch, posix store on local disk, no added latency) over --files JPEGs of
~110 KB:

  fetch   a stream of every file is published with the kernel holding none of them: each is
          fetched from the store into the window (the reference)
  probe   every file is read through the mount (the kernel keeps the pages; the daemon marks
          them), then the same stream is published again: each file is probed and passed over

For each phase: the daemon's CPU seconds (user + system, from /proc) and the wall time until the
prefetcher is done, per file, and probe/fetch ratios. Rounds use a fresh mount each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from epoch_bench import Mount, StoreCap, drop_caches, generate  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "integration"))
from cubefs_harness import UnixHTTPConnection, call  # noqa: E402


def log(msg: str) -> None:
    print(f"[probe_bench] {msg}", file=sys.stderr, flush=True)


def request(sock: str, method: str, target: str, body: object = None) -> dict:
    status, data = call(UnixHTTPConnection(sock, timeout=30), method, target, body)
    if status >= 300:
        raise RuntimeError(f"{method} {target}: {status} {data[:200]!r}")
    return json.loads(data) if data else {}


def prefetch_stats(sock: str) -> dict:
    return request(sock, "GET", "/v1/stats")["global"]["prefetch"]


def run_stream(m: Mount, sock: str, paths: list[str], key: str, timeout: float = 600) -> tuple[float, float]:
    """Publishes `paths` as one stream and waits until `key` (a prefetch counter) has grown by
    len(paths) and nothing is in flight; returns (daemon CPU seconds, wall seconds)."""
    start_count = prefetch_stats(sock)[key]
    cpu0, t0 = m.cpu_seconds(), time.monotonic()
    sid = request(sock, "POST", "/v1/streams", {"name": "probe_bench", "pid": os.getpid()})["id"]
    for i in range(0, len(paths), 5000):
        request(sock, "POST", f"/v1/streams/{sid}/paths", {"paths": paths[i:i + 5000]})
    deadline = time.monotonic() + timeout
    while True:
        s = prefetch_stats(sock)
        if s[key] - start_count >= len(paths) and s["inflight"] == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{key}: {s[key] - start_count} of {len(paths)} after {timeout} s: {s}")
        time.sleep(0.002)
    wall, cpu = time.monotonic() - t0, m.cpu_seconds() - cpu0
    request(sock, "DELETE", f"/v1/streams/{sid}")
    return cpu, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=4000)
    p.add_argument("--classes", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workdir", default="/tmp/cubetorchfs-probe-bench")
    p.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN", str(REPO / "build/bin/cubetorchfs")))
    args = p.parse_args()

    data = Path(args.workdir) / "data"
    generate(data, args.files, args.classes)
    rows: dict[str, list[tuple[float, float]]] = {"fetch": [], "probe": []}
    for r in range(args.rounds):
        drop_caches()
        work = Path(tempfile.mkdtemp(prefix="probe-", dir=args.workdir))
        m = Mount(args.bin, data, work, 0, "4GiB", StoreCap())
        try:
            sock = json.loads((work / f"cube_torch.config.{m.vol}").read_text())["control_socket"]
            files = sorted(m.mnt.glob("*/*.jpg"))
            paths = [str(f) for f in files]
            if len(paths) != args.files:
                raise RuntimeError(f"{len(paths)} files under the mount, not {args.files}")
            rows["fetch"].append(run_stream(m, sock, paths, "fetched"))
            for f in files:  # whole reads: the kernel keeps the pages
                with open(f, "rb") as fh:
                    fh.read()
            rows["probe"].append(run_stream(m, sock, paths, "page_resident"))
            s = prefetch_stats(sock)
            log(f"round {r + 1}: fetch {rows['fetch'][-1][0]:.3f} s CPU {rows['fetch'][-1][1]:.3f} s wall; "
                f"probe {rows['probe'][-1][0]:.3f} s CPU {rows['probe'][-1][1]:.3f} s wall; "
                f"probed absent {s['probed_absent']}")
        finally:
            m.close()
            shutil.rmtree(work, ignore_errors=True)
    n = args.files
    med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in rows.items()}
    print(f"probe_bench - nproc {os.cpu_count()}, {n} JPEGs of ~110 KB, {args.rounds} rounds, medians")
    for k in ("fetch", "probe"):
        print(f"{k:6} daemon CPU {med[k][0] * 1e6 / n:7.1f} us/file   wall {med[k][1] * 1e6 / n:7.1f} us/file")
    print(f"ratios: probe/fetch CPU={med['probe'][0] / med['fetch'][0]:.2f} "
          f"wall={med['probe'][1] / med['fetch'][1]:.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A kill -9 or an upgrade of the daemon in the middle of an epoch read through the hook: how
many reads reach the store again because of it, against the requests in flight.

    bench/restart_bench.py                        # 200,000 files, a kill -9 at 40 %
    bench/restart_bench.py --event upgrade
    bench/restart_bench.py --event none           # the reference: the same epoch, no event
    bench/restart_bench.py --dirs 1000 --files 1000

The store is the synthetic one (--dirs x --files files of 1-3 KB, 1 ms a request), mounted
read-only with the ai_prefetch profile. A training process (`import cube_torch`, an
ImageFolder over the mount, shuffled, batch 256, 2 workers, one epoch) reads every file once;
when the loop has taken --at of the epoch the daemon is killed (or upgraded). Measured:
  - `remaining`: files the epoch had still to read then (the loop's count: the workers may
    be a few batches ahead of it);
  - `store_reads_after`: store reads of the daemon that served the rest (its counter starts
    with it), and `again` = the store reads of both daemons less the files, the reads the
    event cost (the old daemon's reads in the moment between its last count and the event
    are not counted: a lower bound by that);
  - `in_flight`: the old daemon's prefetch fetches in flight and files in its window just
    before the event (/v1/stats), what a restart that lost only the requests under way would
    read again;
  - `store_stats_after`: the metadata requests of that daemon (a file adopted from the dead
    one's RAM cache costs one, its version checked, instead of a read), and what it adopted
    (`adopted` inode records, `cache_found` / `cache_kept` cached chunks);
  - the hook's `resent` count (positions sent again to the new daemon), errors reaching the
    loop (must be 0), the epoch's seconds and the new daemon's hit ratio.
Prints one JSON line; bench/README.md has the figures. Runs under the project venv.
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
from benchlib import free_port, unmount, venv_python, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
import cube_torch
import torch, torchvision
root, progress = sys.argv[1], sys.argv[3]
def raw(path):
    with open(path, "rb") as f:
        return f.read()
torch.manual_seed(0)
ds = torchvision.datasets.ImageFolder(root, loader=raw)
loader = torch.utils.data.DataLoader(ds, batch_size=256, shuffle=True, num_workers=2,
                                     collate_fn=list)
n, began = 0, time.monotonic()
for batch in loader:
    n += len(batch)
    with open(progress + ".tmp", "w") as f:
        f.write(str(n))
    os.replace(progress + ".tmp", progress)
print(json.dumps({"samples": n, "seconds": time.monotonic() - began,
                  "client": cube_torch.stats().get("client", {})}), flush=True)
"""


def metric(port: int, name: str, label: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line):
            total += float(line.rpartition(" ")[2])
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dirs", type=int, default=200)
    p.add_argument("--files", type=int, default=1000, help="files a directory")
    p.add_argument("--event", choices=["kill", "upgrade", "none"], default="kill",
                   help="none: the same epoch with no event, for the reads it costs anyway")
    p.add_argument("--at", type=float, default=0.4, help="share of the epoch read before it")
    p.add_argument("--latency-us", type=int, default=1000)
    p.add_argument("--max-inflight", type=int, default=64, help="prefetch.max_inflight")
    p.add_argument("--profile", default="ai_prefetch",
                   help='"" for the default profile (no page-cache stores: the window is RAM)')
    p.add_argument("--bin", default=str(REPO / "build/bin/cubetorchfs"))
    p.add_argument("--python", default=venv_python() or sys.executable)
    args = p.parse_args()
    if not 0 < args.at < 1:
        p.error("--at must lie between 0 and 1")
    files = args.dirs * args.files
    row: dict[str, object] = {"files": files, "event": args.event, "at": args.at}
    work = Path(tempfile.mkdtemp(prefix="restart_bench."))
    mnt = work / "mnt"
    mnt.mkdir()
    vol = f"restartbench{os.getpid()}"
    port = free_port()
    sock = work / "ctl.sock"
    config = {"volName": vol, "mountPoint": str(mnt), "logDir": str(work / "log"),
              "exporterPort": port, "profile": args.profile,
              "backend": {"type": "synthetic", "synthetic": {
                  "dirs": args.dirs, "files_per_dir": args.files, "min_bytes": 1024,
                  "max_bytes": 3072}, "inject": {"latency_us": args.latency_us}},
              "cache": {"memory_bytes": "1GiB"}, "fuse": {"read_only": True},
              "prefetch": {"control_socket": str(sock), "max_inflight": args.max_inflight}}
    (work / "config.json").write_text(json.dumps(config))
    control = work / f"cube_torch.config.{vol}"
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work), VOL_NAME=vol)
    progress = work / "progress"
    proc = None
    try:
        subprocess.run([args.bin, "-c", str(work / "config.json")], check=True, env=env,
                       timeout=120)
        old = json.loads(control.read_text())["pid"]
        # The training at a lower priority: on a machine of few cores this watcher must see
        # --at when the loop gets there, not seconds later.
        proc = subprocess.Popen(["nice", "-n", "10", args.python, "-c", CHILD, str(mnt),
                                 str(REPO / "hooks"), str(progress)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def done() -> int:
            try:
                return int(progress.read_text() or 0)
            except (OSError, ValueError):
                return 0

        if not wait_for(lambda: done() >= args.at * files or proc.poll() is not None, 1800,
                        interval=0.005):
            raise RuntimeError("the training made no progress")
        sys.path.insert(0, str(REPO / "hooks"))
        from cube_torch._client import ControlClient
        st = ControlClient(str(sock)).stats()["global"]["prefetch"]
        row["in_flight"] = st.get("inflight", 0)
        row["window_files"] = st.get("window_files", 0)
        # The old daemon's count is read last before the event: its reads between the two
        # are not counted (the figure is a lower bound by them). Read twice: what it read
        # during the second read of it (`drift`) is about what goes uncounted.
        first = int(metric(port, "cubetorchfs_backend_requests_total", 'op="read"'))
        taken = done()
        sampled = time.monotonic()
        row["store_reads_before"] = int(metric(port, "cubetorchfs_backend_requests_total",
                                               'op="read"'))
        row["sample_ms"] = round((time.monotonic() - sampled) * 1000, 1)
        row["drift"] = int(row["store_reads_before"]) - first
        row["remaining"] = files - taken
        if args.event == "kill":
            os.kill(old, signal.SIGKILL)
        elif args.event == "upgrade":
            up = subprocess.run([args.bin, "upgrade", str(mnt), "--timeout", "60"],
                                capture_output=True, text=True, timeout=120, env=env)
            if up.returncode != 0:
                raise RuntimeError(f"upgrade failed: {up.stderr}; log: " + "".join(
                    f.read_text(errors="replace")[-4000:] for f in (work / "log").rglob("*.log")))
        def new_daemon() -> bool:
            try:
                return json.loads(control.read_text()).get("pid") != old
            except (OSError, ValueError):
                return False

        if args.event != "none" and not wait_for(new_daemon, 60):
            raise RuntimeError(f"no new daemon: {control.read_text(errors='replace')}; log: "
                               + "".join(f.read_text(errors="replace")[-3000:]
                                         for f in (work / "log").rglob("*.log")))
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"training failed ({proc.returncode}): {err[-3000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        row["samples"] = result["samples"]
        row["epoch_s"] = round(result["seconds"], 1)
        client = result["client"]
        row["resent"] = client.get("resent", 0)
        row["errors"] = client.get("errors", 0)
        after = int(metric(port, "cubetorchfs_backend_requests_total", 'op="read"'))
        row["store_reads_after"] = after
        # Metadata requests of the daemon that served the rest: a file whose bytes it adopted
        # from the dead one's RAM cache costs one (its version checked) instead of a read.
        row["store_stats_after"] = int(metric(port, "cubetorchfs_backend_requests_total",
                                              'op="stat"'))
        # Every file needs one store read; what the old daemon read between the sample above
        # and the event is not counted, so this is a lower bound.
        # With no event the one daemon's count is both.
        row["again"] = (after if args.event == "none" else
                        int(row["store_reads_before"]) + after) - files
        reads = {k: metric(port, "cubetorchfs_reads_total", f'result="{k}"')
                 for k in ("hit", "late", "miss")}
        total = sum(reads.values())
        row["hit_after"] = round(reads["hit"] / total, 4) if total else None
        # How the next daemon's prefetcher found the files the dead one had marked.
        after_stats = ControlClient(str(sock)).stats()["global"]["prefetch"]
        for k in ("page_resident", "probed_absent", "page_drops", "trusted"):
            row[k] = after_stats.get(k, 0)
        # What the next daemon kept of the dead one's inode records (the kernel's cached pages
        # of a file whose record was dropped are lost with its inode number).
        log = "".join(f.read_text(errors="replace") for f in (work / "log").rglob("*.log"))
        m = re.search(r"kept (\d+) inode records of the process before in (\d+) ms "
                      r"\((\d+) dropped", log)
        if m:
            row["adopted"], row["adopt_ms"], row["dropped"] = map(int, m.groups())
        # And of its RAM cache (the window and the LRU: cache/cache_arena.h).
        m = re.search(r"found (\d+) cached chunks \((\d+) MiB\) of the process before in "
                      r"(\d+) ms", log)
        if m:
            row["cache_found"], row["cache_mib"], row["cache_adopt_ms"] = map(int, m.groups())
        m = re.search(r"cached again (\d+) of the \d+ chunks the process before held, in "
                      r"(\d+) ms \((\d+) before serving\)", log)
        if m:
            row["cache_kept"], row["cache_again_ms"], row["cache_before_serving"] = map(
                int, m.groups())
        print(json.dumps(row), flush=True)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        unmount(mnt)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

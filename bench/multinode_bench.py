#!/usr/bin/python3
"""Several training nodes on one CubeFS volume: where each node's bytes come from, epoch by
epoch, without and with CubeFS's distributed cache (FlashNodes).

A loopback cluster (../shared/cubefs/cluster.sh, with `--flash` its 2 flashnodes, each put
in a FlashGroup of its own) and --nodes "nodes", each a cubetorchfs daemon with its own mount,
RAM cache, NVMe tier, control socket and control-file directory, over the volume:

  native      backend.type cubefs (libcfs in the daemon), backend.cubefs.remote_cache on
              with --flash (libcfs-remotecache.so), off without
  cfs-client  backend.type posix over a cfs-client mount of its own per node (cfs-client reads
              through the flash cache by itself once the volume's remote cache is on)

One rank per node (tests/cubefs/multinode_job.py: torch.multiprocessing, gloo on the CPU,
DistributedSampler with set_epoch, `import cube_torch`) reads its share of an ImageFolder of
--files files of --kib KiB for --epochs epochs, as fast as the pipeline allows (--pause 0).
Each system reads its own copy of the dataset, so one does not warm the flash cache for the
other.

Per epoch and node it reports the bytes the rank read from the node's RAM and NVMe tier
(cubetorchfs_read_bytes_total, less what it fetched: a file the node holds in RAM or on NVMe
is put in the prefetch window and read from RAM), the bytes the node fetched from the volume
(cubetorchfs_backend_read_bytes_total) and the store requests; per epoch the bytes the
flashnodes and the datanodes served to the nodes, from what those processes wrote
(/proc/PID/io wchar: datanodes write what they serve, to nodes and to flashnodes filling
blocks; flashnodes write what they serve and what they cache, so fills = (datanodes + flash -
fetched) / 2), split among the nodes in proportion to what each fetched; the epoch's time;
and each daemon's peak RSS. Each node's RAM (--memory, 64 MiB) holds less than the files it
reads, so what it read before comes from both its RAM and its NVMe tier. --pause adds a
model step per batch: 0 measures the reads alone. Targets: with the flash cache, epochs 2-3
take >= 90 % of their bytes from node caches or the flash cache; no epoch slower with it
than without.

    bench/multinode_bench.py [--flash] [--files 1500] [--kib 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "cubefs"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.modules.setdefault("pytest", types.ModuleType("pytest"))  # the harness imports it
from benchlib import vm_hwm_mib  # noqa: E402
from cluster import Cluster, cubefs_problem  # noqa: E402
from cubefs_harness import BINARY, CubeFactory, deep_merge  # noqa: E402
from multinode_job import run_job, served  # noqa: E402

RUN_DIR = Path("/tmp/cubetorchfs-multinode-bench")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_dataset(root: Path, files: int, kib: int) -> None:
    """`files` files of about `kib` KiB (incompressible) in 10 classes."""
    for i in range(files):
        d = root / f"n{i % 10:08d}"
        d.mkdir(parents=True, exist_ok=True)
        size = kib * 1024 + (i * 613) % 4096
        (d / f"img_{i:06d}.JPEG").write_bytes(os.urandom(size))


def run_system(name: str, args: argparse.Namespace, cluster: Cluster, work: Path,
               rel: str, cfs_roots: list[Path]) -> dict[str, Any]:
    """Starts --nodes daemons of `name` (the test harness's CubeFactory), runs the job over
    them and stops them; returns the summary."""
    factory = CubeFactory(work / f"daemons-{name}")
    try:
        mounts = []
        for i in range(args.nodes):
            nvme = work / f"nvme-{name}{i}"
            nvme.mkdir()
            cache = {"cache": {"memory_bytes": args.memory, "disk_dir": str(nvme),
                               "disk_bytes": "1GiB"}}
            if name == "native":
                config = deep_merge(cluster.native_config(remote_cache=args.flash), cache)
                mounts.append(factory.mount(work / "unused", config))
            else:
                mounts.append(factory.mount(cfs_roots[i], cache))
        log(f"{name}: {args.nodes} ranks, {args.epochs} epochs")
        ranks = run_job(mounts, rel, str(work / f"job-{name}"), True, timeout=3600,
                        servers={"data": cluster.server_pids("data"),
                                 "flash": cluster.server_pids("flash")},
                        epochs=args.epochs, batch=args.batch, pause=args.pause,
                        workers=args.workers)
        rss = [vm_hwm_mib(m.learn_pid()) for m in mounts]
    finally:
        factory.cleanup_all()
    return summarize(ranks, rss)


def summarize(ranks: list[dict[str, Any]], rss: list[float]) -> dict[str, Any]:
    epochs = []
    for e in range(len(ranks[0]["epochs"])):
        per_node = [r["epochs"][e]["metrics"] for r in ranks]
        fetched = sum(m["store_bytes"] for m in per_node)
        came = served(ranks[0]["epochs"][e]["servers"], fetched)
        share = came["flash"] / fetched if fetched else 0.0
        nodes = []
        for m in per_node:
            read = m["ram_bytes"] + m["nvme_bytes"] + m["miss_bytes"]
            remote = m["store_bytes"]
            # A file the node holds (RAM or NVMe) that the prefetcher put in the window is read
            # from RAM; what came from the store was read from RAM too: the node's caches gave
            # what was read less what was fetched.
            nodes.append({"read": read, "local": max(0.0, read - remote),
                          "flash": remote * share, "datanodes": remote * (1 - share),
                          "store_reads": m["store_reads"]})
        read = sum(n["read"] for n in nodes)
        epochs.append({"seconds": max(r["epochs"][e]["seconds"] for r in ranks),
                       "nodes": nodes, "read": read, "fetched": fetched,
                       "flash_served": came["flash"], "datanodes_served": came["datanodes"],
                       "flash_fills": came["fills"],
                       "local_or_flash": max(0.0, 1 - came["datanodes"] / read) if read else 0.0})
    return {"epochs": epochs, "rss_mib": rss}


def report(results: dict[str, Any], flash: bool) -> None:
    mb = 1e6
    for system, res in results.items():
        print(f"\n{system} ({'with' if flash else 'without'} the flash cache); peak RSS per "
              f"daemon {', '.join(f'{r:.0f}' for r in res['rss_mib'])} MiB")
        print("epoch  node  read MB  node caches  flash  datanodes  store reads")
        for e, ep in enumerate(res["epochs"]):
            for i, n in enumerate(ep["nodes"]):
                print(f"{e + 1:5d}  {i:4d}  {n['read'] / mb:7.1f}  {n['local'] / mb:11.1f} "
                      f"{n['flash'] / mb:6.1f} {n['datanodes'] / mb:10.1f}  "
                      f"{n['store_reads']:11.0f}")
            print(f"epoch {e + 1}: {ep['seconds']:.2f} s; {ep['local_or_flash'] * 100:.1f} % of "
                  f"{ep['read'] / mb:.1f} MB from node caches or flash; flashnodes served "
                  f"{ep['flash_served'] / mb:.1f} MB, datanodes "
                  f"{ep['datanodes_served'] / mb:.1f} MB (+ {ep['flash_fills'] / mb:.1f} MB of "
                  "flash fills)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flash", action="store_true", help="start the cluster with its flash cache")
    ap.add_argument("--files", type=int, default=1500)
    ap.add_argument("--kib", type=int, default=100, help="file size (default 100 KiB)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--memory", default="64MiB",
                    help="each daemon's RAM (cache.memory_bytes); its NVMe tier holds 1 GiB")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds per batch (a model step)")
    ap.add_argument("--systems", default="native,cfs-client")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    problem = cubefs_problem()
    if problem:
        print(f"multinode_bench: {problem}", file=sys.stderr)
        return 2
    if not BINARY.exists():
        print(f"multinode_bench: no daemon at {BINARY} (build it, or set CUBETORCHFS_BIN)",
              file=sys.stderr)
        return 2
    systems = [s for s in args.systems.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="ctfs-multinode."))
    cluster = Cluster(flash=args.flash, run_dir=RUN_DIR)
    log(f"starting the cluster{' with its flash cache' if args.flash else ''}")
    cluster.start()
    results: dict[str, Any] = {}
    try:
        writer = cluster.mount_cfs_client(work / "writer")
        for s in systems:
            log(f"writing {args.files} files of {args.kib} KiB for {s}")
            write_dataset(writer / f"mn-{s}" / "train", args.files, args.kib)
        cfs_roots = []
        if "cfs-client" in systems:
            cfs_roots = [cluster.mount_cfs_client(work / f"cfs{i}") for i in range(args.nodes)]
        if args.flash:
            log("waiting for CubeFS's clients to take the FlashGroups (one minute at most)")
            cluster.wait_flash_view()
        for s in systems:
            results[s] = run_system(s, args, cluster, work, f"mn-{s}/train", cfs_roots)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(results, args.flash)
    if args.json:
        Path(args.json).write_text(json.dumps({"flash": args.flash, "args": vars(args),
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

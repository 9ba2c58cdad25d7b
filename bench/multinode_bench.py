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
import subprocess
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
from benchlib import free_port, vm_hwm_mib  # noqa: E402
from cluster import Cluster, cubefs_problem  # noqa: E402

BIN = Path(os.environ.get("CUBETORCHFS_BIN", REPO / "build" / "bin" / "cubetorchfs"))
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


class Node:
    """A cubetorchfs daemon of the bench: started with `cubetorchfs -c`, unmounted at stop."""

    def __init__(self, workdir: Path, config: dict[str, Any], memory: str) -> None:
        self.workdir = workdir
        self.mnt = workdir / "mnt"
        self.ctl = workdir / "ctl"
        for d in (self.mnt, self.ctl, workdir / "log", workdir / "nvme"):
            d.mkdir(parents=True, exist_ok=True)
        self.vol_name = "mn-" + workdir.name
        self.port = free_port()
        base = {"volName": self.vol_name, "mountPoint": str(self.mnt),
                "logDir": str(workdir / "log"), "exporterPort": self.port,
                "prefetch": {"control_socket": str(workdir / "ctl.sock")},
                "cache": {"memory_bytes": memory, "disk_dir": str(workdir / "nvme"),
                          "disk_bytes": "1GiB"}}
        config = merge(base, config)
        (workdir / "config.json").write_text(json.dumps(config, indent=2))
        env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(self.ctl))
        r = subprocess.run([str(BIN), "-c", str(workdir / "config.json"), str(self.mnt)],
                           capture_output=True, text=True, timeout=120, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"cubetorchfs did not start: {r.stderr.strip()}")
        control = self.ctl / f"cube_torch.config.{self.vol_name}"
        deadline = time.monotonic() + 60
        while not control.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no control file {control}")
            time.sleep(0.1)
        self.pid = json.loads(control.read_text())["pid"]

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{self.pid}") and time.monotonic() < deadline:
            time.sleep(0.1)


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_system(name: str, args: argparse.Namespace, cluster: Cluster, work: Path,
               rel: str, cfs_roots: list[Path]) -> dict[str, Any]:
    nodes: list[Node] = []
    try:
        for i in range(args.nodes):
            if name == "native":
                config: dict[str, Any] = dict(cluster.native_config(remote_cache=args.flash))
                config["backend"] = {k: v for k, v in config["backend"].items() if v is not None}
            else:
                config = {"backend": {"type": "posix", "root": str(cfs_roots[i])}}
            nodes.append(Node(work / f"{name}{i}", config, args.memory))
        out = work / f"job-{name}"
        out.mkdir()
        spec = {"nodes": [{"root": str(n.mnt / rel), "config_dir": str(n.ctl),
                           "vol_name": n.vol_name, "metrics_port": n.port} for n in nodes],
                "hook": True, "epochs": args.epochs, "batch": args.batch, "pause": args.pause,
                "workers": args.workers, "seed": 7, "out": str(out),
                "servers": {"data": cluster.server_pids("data"),
                            "flash": cluster.server_pids("flash")}}
        (out / "spec.json").write_text(json.dumps(spec))
        log(f"{name}: {args.nodes} ranks, {args.epochs} epochs")
        env = dict(os.environ, PYTHONPATH=str(REPO / "hooks"))
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "cubefs" / "multinode_job.py"),
                               str(out / "spec.json")], env=env, capture_output=True, text=True,
                              timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"the job failed: {proc.stderr[-3000:]}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nodes)]
        rss = [vm_hwm_mib(n.pid) for n in nodes]
    finally:
        for n in nodes:
            n.stop()
    return summarize(ranks, rss)


def summarize(ranks: list[dict[str, Any]], rss: list[float]) -> dict[str, Any]:
    epochs = []
    for e in range(len(ranks[0]["epochs"])):
        servers = ranks[0]["epochs"][e]["servers"]
        per_node = [r["epochs"][e]["metrics"] for r in ranks]
        fetched = sum(m["store_bytes"] for m in per_node)
        if servers.get("flash"):  # wchar: datanodes = to nodes + fills; flash = hits + fills
            fill = max(0.0, (servers["data"] + servers["flash"] - fetched) / 2)
            flash = max(0.0, servers["flash"] - fill)
            data = max(0.0, servers["data"] - fill)
        else:  # no flashnodes: every byte fetched came from the datanodes
            fill, flash, data = 0.0, 0.0, float(servers.get("data", 0))
        # What the nodes fetched, split between the two in the proportion the servers give.
        flash_share = flash / (flash + data) if flash + data > 0 else 0.0
        flash, data = fetched * flash_share, fetched * (1 - flash_share)
        nodes = []
        for m in per_node:
            read = m["ram_bytes"] + m["nvme_bytes"] + m["miss_bytes"]
            remote = m["store_bytes"]
            # A file the node holds (RAM or NVMe) that the prefetcher put in the window is read
            # from RAM; what came from the store was read from RAM too: the node's caches gave
            # what was read less what was fetched.
            nodes.append({"read": read, "local": max(0.0, read - remote),
                          "flash": remote * flash_share,
                          "datanodes": remote * (1 - flash_share),
                          "store_reads": m["store_reads"]})
        read = sum(n["read"] for n in nodes)
        epochs.append({"seconds": max(r["epochs"][e]["seconds"] for r in ranks),
                       "nodes": nodes, "read": read, "fetched": fetched,
                       "flash_served": flash, "datanodes_served": data, "flash_fills": fill,
                       "local_or_flash": max(0.0, 1 - data / read) if read else 0.0})
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
    if not BIN.exists():
        print(f"multinode_bench: no daemon at {BIN} (build it, or set CUBETORCHFS_BIN)",
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

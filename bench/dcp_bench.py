#!/usr/bin/python3
"""torch.distributed.checkpoint save and load: through a cubetorchfs mount vs the local disk.

4 ranks (torch.multiprocessing, gloo on the CPU; the project venv's python, torch 2.x) hold a
sharded state dict of --gib GiB (default 1): a transformer-like model of float32 DTensors
sharded along dim 0 (20 layers of d=1024: qkv, out, mlp up/down, 2 norms; and an embedding:
121 tensors, 1.07 GB), random bits. Each rank saves with `dcp.save(FileSystemWriter(dir,
thread_count=T, sync_files=True))` and loads with `dcp.load(FileSystemReader(dir))` into
tensors allocated once; the first load of each kind is checked byte for byte.

Systems, on the same disk (--workdir):
  local  WORKDIR/local, written and read directly
  mount  a cubetorchfs mount of WORKDIR/store (posix backend) with what a user gets by
         default: profile "" (--profile to change), cache.memory_bytes 4 GiB, every other key
         at its default (docs/config.md)

One process group does every measurement, so process start-up is not timed. Each round, for
each thread count (--thread-counts, default 1 4) and each system in turn (local, mount):
delete the previous checkpoint of that system and `sync` (outside the timing), then time
`dcp.save` into a fresh directory (barrier to barrier, rank 0's clock), `sync` and drop the page
cache (echo 3 > /proc/sys/vm/drop_caches, root; the daemon's RAM cache holds nothing of the
new files: writing drops their cached chunks), then time `dcp.load`. Both sides fsync every
file (sync_files=True) and end in the same rename of .metadata.

Prints a table (median seconds and min-max, GB/s of checkpoint bytes, mount/local as a speed
ratio), what the daemon did during the mount's saves and loads (FUSE requests by op, store
time by op, from its /metrics), its peak RSS, and a last line
`ratio: mount/local save tc1 X, tc4 Y; load tc1 Z, tc4 W (target >= 0.9)`.

`--worker SPEC` is the script's own worker mode (run under the venv's python).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from benchlib import cpu_seconds, drop_caches, free_port  # noqa: E402
WORLD = 4
MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[dcp_bench] {msg}", file=sys.stderr, flush=True)


def scrape(port: int, pid: int) -> dict[tuple[str, str], float]:
    """The daemon's counters that say where a phase's time went: FUSE requests by op and the
    store's request count and seconds by op."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        if name not in ("cubetorchfs_fuse_ops_total", "cubetorchfs_fuse_op_seconds_sum",
                        "cubetorchfs_backend_request_seconds_sum",
                        "cubetorchfs_backend_request_seconds_count"):
            continue
        op = next((kv.split("=", 1)[1].strip('"') for kv in labels.rstrip("}").split(",")
                   if kv.startswith("op=")), "")
        out[(name, op)] = out.get((name, op), 0.0) + float(value)
    out[("cpu", "")] = cpu_seconds(pid)
    return out


# --------------------------------------------------------------------------- the worker


def worker_rank(rank: int, spec: dict[str, Any]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (WORLD,))
    d, layers, vocab = 1024, spec["layers"], 16384
    shapes = {"embed.weight": (vocab, d)}
    for i in range(layers):
        shapes.update({f"layers.{i}.attn.qkv.weight": (3 * d, d),
                       f"layers.{i}.attn.out.weight": (d, d),
                       f"layers.{i}.mlp.up.weight": (4 * d, d),
                       f"layers.{i}.mlp.down.weight": (d, 4 * d),
                       f"layers.{i}.norm1.weight": (d,), f"layers.{i}.norm2.weight": (d,)})
    g = torch.Generator().manual_seed(1000 + rank)
    source, target = {}, {}
    for name, shape in shapes.items():
        local = (shape[0] // WORLD,) + tuple(shape[1:])
        n = torch.Size(local).numel()
        bits = torch.empty(n, dtype=torch.int32).random_(generator=g).bitwise_and_(0x3FFFFFFF)
        source[name] = DTensor.from_local(bits.view(torch.float32).reshape(local), mesh,
                                          [Shard(0)], run_check=False)
        target[name] = DTensor.from_local(torch.zeros(local), mesh, [Shard(0)], run_check=False)
    metrics_port, daemon = spec["metrics_port"], spec["daemon_pid"]
    rows = []
    checked: set[tuple[str, int]] = set()

    def timed(fn) -> tuple[float, float]:
        """Wall seconds (barrier to barrier) and the CPU seconds of all ranks together."""
        dist.barrier()
        cpu = time.process_time()
        start = time.monotonic()
        fn()
        dist.barrier()
        wall = time.monotonic() - start
        used = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
        dist.all_reduce(used)
        return wall, float(used)

    for rnd in range(spec["rounds"]):
        for tc in spec["thread_counts"]:
            for system, base in spec["systems"]:
                ckpt = Path(base) / f"ckpt-r{rnd}-tc{tc}"
                if rank == 0:
                    for old in Path(base).glob("ckpt-*"):
                        shutil.rmtree(old)
                    subprocess.run(["sync"], check=False, timeout=300)
                m0 = scrape(metrics_port, daemon) if rank == 0 and system == "mount" else {}
                writer = dcp.FileSystemWriter(ckpt, thread_count=tc, sync_files=True)
                save_s, save_cpu = timed(lambda: dcp.save(source, storage_writer=writer))
                m1 = scrape(metrics_port, daemon) if rank == 0 and system == "mount" else {}
                if rank == 0 and spec["cold"]:
                    drop_caches(log=None, sync_timeout=300)  # raises where it cannot
                reader = dcp.FileSystemReader(ckpt)
                load_s, load_cpu = timed(lambda: dcp.load(target, storage_reader=reader))
                m2 = scrape(metrics_port, daemon) if rank == 0 and system == "mount" else {}
                if (system, tc) not in checked:
                    for name, src in source.items():
                        a, b = src.to_local(), target[name].to_local()
                        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), \
                            f"{system} tc{tc}: {name} differs after load"
                    checked.add((system, tc))
                for t in target.values():
                    t.to_local().zero_()
                if rank == 0:
                    nbytes = sum(p.stat().st_size for p in ckpt.iterdir())
                    rows.append({"round": rnd, "tc": tc, "system": system, "save": save_s,
                                 "load": load_s, "save_cpu": save_cpu, "load_cpu": load_cpu,
                                 "bytes": nbytes,
                                 "save_metrics": delta(m0, m1), "load_metrics": delta(m1, m2)})
                    print(f"[dcp_bench] round {rnd + 1} tc{tc} {system:5}: save {save_s:6.2f} s, "
                          f"load {load_s:6.2f} s ({nbytes / 1e9:.2f} GB)", file=sys.stderr,
                          flush=True)
    if rank == 0:
        for _, base in spec["systems"]:
            for old in Path(base).glob("ckpt-*"):
                shutil.rmtree(old)
        Path(spec["result"]).write_text(json.dumps(rows))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads sometimes abort a normal interpreter exit


def delta(before: dict, after: dict) -> list:
    return [[k[0], k[1], after[k] - before.get(k, 0.0)] for k in after
            if after[k] - before.get(k, 0.0) > 0]


def worker_main(spec_path: str) -> None:
    import torch.multiprocessing as mp

    spec = json.loads(Path(spec_path).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec["port"] = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker_rank, args=(spec,), nprocs=WORLD, join=True)


# --------------------------------------------------------------------------- the driver


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def venv_python() -> str:
    """The project venv's python, made whole or not (not benchlib's, which wants it complete):
    a failing scripts/venv.sh raises, a missing python fails at the worker's start."""
    out = subprocess.run([str(REPO / "scripts/venv.sh")], capture_output=True, text=True,
                         timeout=30, check=True)
    return str(Path(out.stdout.strip()) / "bin/python")


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def local_read_ahead_kb(path: Path) -> int:
    """The readahead of the block device under path (its whole disk's), or -1."""
    dev = path.stat().st_dev
    sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for q in (sysdev / "queue/read_ahead_kb", sysdev / "../queue/read_ahead_kb"):
        if q.exists():
            return int(q.read_text())
    return -1


def report(rows: list[dict[str, Any]], args: argparse.Namespace, profile: str, hwm: int,
           readahead: dict[str, int]) -> None:
    gb = statistics.median(r["bytes"] for r in rows) / 1e9
    extra = json.loads(args.config_json)
    print(f"dcp_bench - nproc {os.cpu_count()}, {WORLD} ranks (gloo, CPU), {gb:.2f} GB of "
          f"checkpoint ({args.layers} layers, {6 * args.layers + 1} tensors), sync_files=True, "
          f"{args.rounds} rounds, {'cold loads (drop_caches)' if not args.hot else 'hot loads'}; "
          f"mount: posix backend, profile {profile!r}, "
          + (f"also {json.dumps(extra)}" if extra else "other keys default"))
    print(f"{'tc':>2} {'op':4} {'local s (min-max)':>22} {'mount s (min-max)':>22} "
          f"{'local GB/s':>10} {'mount GB/s':>10} {'mount/local':>11} "
          f"{'ranks CPU s local/mount':>24}")
    ratios = {}

    def cpu(tc: int, op: str, system: str) -> list[float]:
        return [r[f"{op}_cpu"] for r in rows if r["tc"] == tc and r["system"] == system]
    for tc in args.thread_counts:
        for op in ("save", "load"):
            local = [r[op] for r in rows if r["tc"] == tc and r["system"] == "local"]
            mount = [r[op] for r in rows if r["tc"] == tc and r["system"] == "mount"]
            ratio = statistics.median(local) / statistics.median(mount)
            ratios[(op, tc)] = ratio
            print(f"{tc:>2} {op:4} {fmt(local):>22} {fmt(mount):>22} "
                  f"{gb / statistics.median(local):10.2f} {gb / statistics.median(mount):10.2f} "
                  f"{ratio:11.2f} {statistics.median(cpu(tc, op, 'local')):11.2f}/"
                  f"{statistics.median(cpu(tc, op, 'mount')):.2f}")
    print("the daemon during the mount's phases (medians over rounds): FUSE requests by op "
          "[seconds in the daemon]; store requests by op [seconds]")
    for tc in args.thread_counts:
        for op in ("save", "load"):
            per_round = [dict(((k, o), v) for k, o, v in r[f"{op}_metrics"])
                         for r in rows if r["tc"] == tc and r["system"] == "mount"]
            keys = sorted({k for d in per_round for k in d})

            def med(k: tuple[str, str]) -> float:
                return statistics.median(d.get(k, 0.0) for d in per_round)
            fuse = ", ".join(f"{o} {med(('cubetorchfs_fuse_ops_total', o)):.0f} "
                             f"[{med(('cubetorchfs_fuse_op_seconds_sum', o)):.2f}]"
                             for n, o in keys if n == "cubetorchfs_fuse_ops_total")
            store = ", ".join(f"{o} {med(('cubetorchfs_backend_request_seconds_count', o)):.0f} "
                              f"[{med(('cubetorchfs_backend_request_seconds_sum', o)):.2f}]"
                              for n, o in keys if n == "cubetorchfs_backend_request_seconds_count")
            print(f"  tc{tc} {op}: daemon CPU {med(('cpu', '')):.2f} s; FUSE {fuse}")
            print(f"  tc{tc} {op}: store {store}")
    print(f"daemon VmHWM {hwm / 1024:.0f} MiB; kernel readahead: local disk "
          f"{readahead['local']} KiB, mount {readahead['mount']} KiB")
    parts = [f"{op} " + ", ".join(f"tc{tc} {ratios[(op, tc)]:.2f}" for tc in args.thread_counts)
             for op in ("save", "load")]
    print(f"ratio: mount/local {'; '.join(parts)} (target >= 0.9)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=20,
                   help="transformer layers of d=1024 (20: 1.07 GB with the embedding)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--thread-counts", type=int, nargs="+", default=[1, 4],
                   help="FileSystemWriter thread_count values")
    p.add_argument("--profile", default="", help='mount profile ("" = the default, or ai_prefetch)')
    p.add_argument("--mount-read-ahead-kb", type=int, metavar="KB",
                   help="set the mount's kernel readahead (/sys/class/bdi/MAJ:MIN/read_ahead_kb; "
                        "the kernel gives a FUSE mount 128) after mounting")
    p.add_argument("--config-json", default="{}", metavar="JSON",
                   help="keys merged into the mount's config (one level deep per section), for "
                        "experiments: '{\"cache\": {\"chunk_bytes\": \"16MiB\"}}'")
    p.add_argument("--hot", action="store_true", help="do not drop the page cache before loads")
    p.add_argument("--workdir", default="/tmp/cubetorchfs-dcp-bench",
                   help="on the disk to measure: local/, store/ (the mount's backend), mnt/")
    p.add_argument("--bin", default=os.environ.get("CUBETORCHFS_BIN",
                                                   str(REPO / "build/bin/cubetorchfs")))
    p.add_argument("--python", help="python with torch 2.x (default: the project venv's)")
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    if not args.hot and os.geteuid() != 0:
        p.error("dropping the page cache before loads needs root (or --hot)")

    work = Path(args.workdir)
    if (work / "mnt").is_mount():
        subprocess.run(["fusermount3", "-u", str(work / "mnt")], check=False, timeout=60)
    shutil.rmtree(work, ignore_errors=True)
    local, store, mnt = work / "local", work / "store", work / "mnt"
    for d in (local, store, mnt):
        d.mkdir(parents=True)
    port = free_port()
    config: dict[str, Any] = {"volName": "dcpbench", "mountPoint": str(mnt), "logDir": str(work),
                              "exporterPort": port,
                              "prefetch": {"control_socket": str(work / "ctl.sock")},
                              "backend": {"type": "posix", "root": str(store)}}
    if args.profile:
        config["profile"] = args.profile
    for key, value in json.loads(args.config_json).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    (work / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, CUBE_TORCH_CONFIG_DIR=str(work))
    subprocess.run([args.bin, "-c", str(work / "config.json")], check=True, env=env, timeout=60)
    try:
        pid = json.loads((work / "cube_torch.config.dcpbench").read_text())["pid"]
        dev = mnt.stat().st_dev
        bdi = Path("/sys/class/bdi") / f"{os.major(dev)}:{os.minor(dev)}"
        if args.mount_read_ahead_kb:
            (bdi / "read_ahead_kb").write_text(f"{args.mount_read_ahead_kb}\n")
        readahead = {"mount": int((bdi / "read_ahead_kb").read_text()),
                     "local": local_read_ahead_kb(local)}
        spec = {"layers": args.layers, "rounds": args.rounds, "thread_counts": args.thread_counts,
                "systems": [["local", str(local)], ["mount", str(mnt)]], "cold": not args.hot,
                "metrics_port": port, "daemon_pid": pid, "result": str(work / "result.json")}
        (work / "spec.json").write_text(json.dumps(spec))
        python = args.python or venv_python()
        log(f"{args.rounds} rounds x tc {args.thread_counts} x (local, mount), python {python}")
        budget = 120 + args.rounds * len(args.thread_counts) * 2 * 120
        proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--worker",
                                 str(work / "spec.json")], start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            rc = proc.wait(timeout=budget)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # every rank (the worker's process group)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        if rc != 0:
            sys.exit(f"dcp_bench: the worker failed ({rc})")
        rows = json.loads((work / "result.json").read_text())
        hwm = vm_hwm_kib(pid)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False, timeout=60)
    report(rows, args, args.profile, hwm, readahead)


if __name__ == "__main__":
    main()
